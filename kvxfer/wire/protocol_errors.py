"""What goes wrong talking to a peer: :class:`SideChannelError` and the protocol's errors.

Every decoding failure raises a :class:`ProtocolError` subclass whose message names the
peer and what was expected and found, so a receiver can log it, answer with an
:class:`~kvxfer.wire.messages.ErrorReply` carrying its :class:`ErrorCode` and carry on.
:class:`~kvxfer.wire.replay.ReplayedMessage` (a :class:`BadSignature`) lives beside the
guard that raises it.
"""

from __future__ import annotations

import enum
from typing import ClassVar, NamedTuple

from kvxfer.wire import version
from kvxfer.wire.version import MAGIC

AUTH_FAILED = "authentication failed"
"""All an unauthenticated peer is told (see :class:`BadSignature`)."""


class ErrorCode(str, enum.Enum):
    """Why a listener refused a request (the ``code`` of an :class:`ErrorReply`)."""

    BAD_MAGIC = "bad_magic"
    VERSION_MISMATCH = "version_mismatch"
    HASH_MISMATCH = "hash_mismatch"
    BAD_SIGNATURE = "bad_signature"
    MALFORMED = "malformed"
    UNKNOWN_RANK = "unknown_rank"
    UNAVAILABLE = "unavailable"  # the listener could not produce its metadata


def require(condition: bool, message: str) -> None:
    """Validation inside ``__post_init__`` (msgspec turns the ValueError into a
    ValidationError when it happens while decoding)."""
    if not condition:
        raise ValueError(message)


class SideChannelError(Exception):
    """Talking to a peer over a kvxfer side channel failed.

    ``peer`` names the other side (an address such as ``tcp://host:port``, or a
    listener's description of a client); ``expected`` and ``found`` hold the
    values that disagreed, where there are such values.
    """

    def __init__(self, message: str, *, peer: str, expected: object = None,
                 found: object = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.expected = expected
        self.found = found


class ProtocolError(SideChannelError):
    """Bytes from a peer broke the wire protocol; ``code`` is what a listener answers."""

    code: ClassVar[ErrorCode] = ErrorCode.MALFORMED


class BadMagic(ProtocolError):
    """The bytes do not start with :data:`MAGIC`: not a kvxfer message at all."""

    code = ErrorCode.BAD_MAGIC

    def __init__(self, raw: bytes, *, peer: str) -> None:
        head = bytes(raw[:8])
        super().__init__(f"peer {peer} sent {len(raw)} bytes that are not a kvxfer message: "
                         f"they start with {head!r}, expected the magic {MAGIC!r}",
                         peer=peer, expected=MAGIC, found=head)


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""

    code = ErrorCode.VERSION_MISMATCH

    def __init__(self, found: int, *, peer: str) -> None:
        here = version.KVXFER_PROTOCOL_VERSION
        super().__init__(f"peer {peer} speaks kvxfer protocol {found}, this side speaks "
                         f"{here}", peer=peer, expected=here, found=found)


class FieldDiff(NamedTuple):
    """One :class:`CompatInfo` field on which two sides disagree."""

    field: str
    here: object
    peer: object


_FIELD_HINTS = {"kv_lora_rank": " (0: a cache of K and V heads, > 0: an MLA latent cache)"}
"""What a differing :class:`CompatInfo` field means, where its name does not say it."""


class HashMismatch(ProtocolError):
    """The peer's compatibility hash differs: the two sides cannot share KV caches.

    ``differing`` lists the fields that differ when the peer sent its
    :class:`CompatInfo` (None when it did not).
    """

    code = ErrorCode.HASH_MISMATCH

    def __init__(self, expected: str, found: str, *, peer: str,
                 differing: tuple[FieldDiff, ...] | None = None) -> None:
        if differing is None:
            detail = "the peer did not send its CompatInfo, so the differing fields are unknown"
        elif not differing:
            detail = ("no CompatInfo field differs, so the peer computes the hash differently "
                      "(another kvxfer build?)")
        else:
            detail = "differing: " + "; ".join(
                f"{d.field}{_FIELD_HINTS.get(d.field, '')}: peer {d.peer!r}, here {d.here!r}"
                for d in differing)
        super().__init__(f"peer {peer} is not compatible: its compatibility hash is {found}, "
                         f"this side's is {expected}; {detail}",
                         peer=peer, expected=expected, found=found)
        self.differing = differing


class BadSignature(ProtocolError):
    """A key is configured here and the message is unsigned or its HMAC does not verify."""

    code = ErrorCode.BAD_SIGNATURE

    def __init__(self, signature: bytes | None, *, peer: str) -> None:
        if signature is None:
            what = "an unsigned message, but this side requires an HMAC-SHA256 signature"
        else:
            what = (f"a message whose {len(signature)}-byte signature does not verify with "
                    f"this side's key")
        super().__init__(f"peer {peer} sent {what}", peer=peer,
                         expected="a valid HMAC-SHA256 signature",
                         found="no signature" if signature is None else signature.hex())


class MalformedMessage(ProtocolError):
    """Right magic and version, but the content does not decode or does not make sense."""

    def __init__(self, what: str, detail: str, *, peer: str, expected: object = None,
                 found: object = None) -> None:
        super().__init__(f"peer {peer} sent a malformed {what}: {detail}", peer=peer,
                         expected=expected if expected is not None else what, found=found)

