"""What every kvxfer frame shares, envelope and notification alike: magic and version
first, strict msgpack decoding, HMAC-SHA256 signatures.

Decoding starts here: :func:`check_version` checks the magic, then the protocol version
(decoding only that field, so that a peer speaking another version gets
:class:`~kvxfer.wire.protocol_errors.VersionMismatch` whatever else its frame holds), before
anything else is looked at.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TypeVar

import msgspec

from kvxfer.wire import version
from kvxfer.wire.protocol_errors import BadMagic, MalformedMessage, VersionMismatch
from kvxfer.wire.version import MAGIC

T = TypeVar("T")

UNKNOWN_PEER = "<unnamed peer>"
"""Who sent a frame, where the caller does not say (only used in messages)."""

ENCODER = msgspec.msgpack.Encoder()
"""The encoder of every kvxfer frame and of the bytes an HMAC covers."""


class _Header(msgspec.Struct):
    """Phase one: only the version, ignoring other fields, so that a peer speaking
    another version (whose envelope may have other fields) gets VersionMismatch."""

    version: int


_HEADER = msgspec.msgpack.Decoder(_Header)


def sign(key: bytes, data: bytes) -> bytes:
    """HMAC-SHA256 of ``data`` with the shared ``key``."""
    return hmac.new(key, data, hashlib.sha256).digest()


def decode_strict(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str,
                  peer: str) -> T:
    """``data`` decoded by ``decoder``; anything that does not decode into its type raises
    :class:`~kvxfer.wire.protocol_errors.MalformedMessage` naming ``what`` and ``peer``."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(what, str(exc), peer=peer) from None


def check_version(raw: bytes, what: str, peer: str) -> bytes:
    """Phase one, shared by envelopes and notifications: magic, then version.
    Returns the bytes after the magic."""
    if raw[:len(MAGIC)] != MAGIC:
        raise BadMagic(raw, peer=peer)
    body = bytes(raw[len(MAGIC):])
    header = decode_strict(_HEADER, body, what, peer)
    if header.version != version.KVXFER_PROTOCOL_VERSION:
        raise VersionMismatch(header.version, peer=peer)
    return body
