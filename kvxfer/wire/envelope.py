"""The envelope of every side-channel message: encoding, signing and two-phase decoding.

Pure: msgspec and the standard library, no I/O. :func:`decode_envelope` checks magic,
version, shape, signature and (except for :data:`~kvxfer.wire.messages.HASH_FREE_KINDS`) the
compatibility hash before anything else; :func:`decode_payload` then decodes the message into
its declared type. With a key, stale or repeated envelopes are refused.

Design: docs/design/side-channel.md#the-envelope
"""

from __future__ import annotations

import hmac
import os
import time

import msgspec

from kvxfer.wire import version
from kvxfer.wire.compat import CompatInfo, compat_diff, compat_hash
from kvxfer.wire.framing import ENCODER, UNKNOWN_PEER, check_version, decode_strict, sign
from kvxfer.wire.messages import HASH_FREE_KINDS, KIND_OF, Message, MessageKind, MessageT
from kvxfer.wire.protocol_errors import BadSignature, HashMismatch, MalformedMessage
from kvxfer.wire.replay import NONCE_BYTES, ReplayGuard
from kvxfer.wire.version import MAGIC


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The outer frame of every handshake message; on the wire it follows :data:`MAGIC`.

    ``signature`` is HMAC-SHA256 with the shared key over every other field
    (see :func:`_signed_bytes`), absent when the sender has no key. ``sender``
    is the sender's :class:`CompatInfo`, so that a hash mismatch can name the
    fields that differ. A signed envelope carries ``timestamp`` (seconds since
    the epoch, the sender's clock) and a random 16-byte ``nonce``, so that a
    receiver can refuse replays (:class:`ReplayGuard`).
    """

    version: int
    compat_hash: str
    kind: MessageKind
    payload: bytes
    signature: bytes | None = None
    sender: CompatInfo | None = None
    timestamp: float = 0.0
    nonce: bytes = b""


ANONYMOUS_HASH = ""
"""The ``compat_hash`` of an error reply to a peer that did not authenticate: it names
no model, and a receiver checks no hash on it."""

_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_PAYLOADS: dict[type[msgspec.Struct], msgspec.msgpack.Decoder[msgspec.Struct]] = {
    t: msgspec.msgpack.Decoder(t) for t in KIND_OF
}
_FRESHNESS = ReplayGuard(remember=False)  # a caller without a guard still refuses stale ones


def _signed_bytes(envelope: Envelope) -> bytes:
    """What the HMAC covers: the magic and every envelope field except the signature."""
    return MAGIC + ENCODER.encode((envelope.version, envelope.compat_hash, envelope.kind.value,
                                    envelope.payload, envelope.sender, envelope.timestamp,
                                    envelope.nonce))


def encode_message(message: Message, *, compat: CompatInfo, hmac_key: bytes | None = None,
                   include_compat: bool = True, anonymous: bool = False) -> bytes:
    """The wire bytes of ``message``: magic, envelope, payload; signed when a key is given.

    ``include_compat`` sends this side's :class:`CompatInfo` along, so a peer
    with a different hash can say which fields differ. ``anonymous`` (an
    :class:`~kvxfer.wire.messages.ErrorReply` only, to a peer that did not
    authenticate) sends neither it nor its hash (:data:`ANONYMOUS_HASH`): the hash
    of the model's compatibility info would let anyone confirm which model is served.
    """
    kind = KIND_OF[type(message)]
    if anonymous and kind is not MessageKind.ERROR_REPLY:
        raise ValueError(f"only an error reply may be anonymous, not a {kind.value}")
    payload = ENCODER.encode(message)
    sender = compat if include_compat and not anonymous else None
    digest = ANONYMOUS_HASH if anonymous else compat_hash(compat)
    envelope = Envelope(version.KVXFER_PROTOCOL_VERSION, digest, kind, payload, None, sender)
    if hmac_key is not None:
        envelope = msgspec.structs.replace(envelope, timestamp=time.time(),
                                           nonce=os.urandom(NONCE_BYTES))
        envelope = msgspec.structs.replace(envelope,
                                           signature=sign(hmac_key, _signed_bytes(envelope)))
    return MAGIC + ENCODER.encode(envelope)


def decode_envelope(raw: bytes, *, expected_hash: str | None, peer: str,
                    hmac_key: bytes | None = None,
                    local_compat: CompatInfo | None = None,
                    replay: ReplayGuard | None = None) -> Envelope:
    """Phase one of decoding a handshake message; the payload stays undecoded.

    Checks, in order: magic, version, the envelope's shape, the signature (when
    ``hmac_key`` is set; without a key, signatures are ignored), its freshness
    (with a key: the timestamp within :data:`MAX_MESSAGE_AGE_S`, and with
    ``replay`` a nonce never seen before), and the compatibility hash against
    ``expected_hash``. The hash is not checked for
    :data:`HASH_FREE_KINDS`, nor when ``expected_hash`` is None (a caller that
    expects only a reply to a release, which may come from another model). With
    ``local_compat`` a hash mismatch names the differing fields. ``peer`` is
    only used in messages.
    """
    body = check_version(raw, "envelope", peer)
    envelope = decode_strict(_ENVELOPE, body, "envelope", peer)
    if hmac_key is not None:
        want = sign(hmac_key, _signed_bytes(envelope))
        if envelope.signature is None or not hmac.compare_digest(want, envelope.signature):
            raise BadSignature(envelope.signature, peer=peer)
        (replay or _FRESHNESS).check(envelope.nonce, envelope.timestamp, peer=peer)
    sender = envelope.sender
    if sender is not None and compat_hash(sender) != envelope.compat_hash:
        raise MalformedMessage("envelope", f"its compat_hash {envelope.compat_hash} is not the "
                                           f"hash of the CompatInfo it carries", peer=peer)
    anonymous = envelope.kind is MessageKind.ERROR_REPLY and \
        envelope.compat_hash == ANONYMOUS_HASH
    if (expected_hash is not None and envelope.kind not in HASH_FREE_KINDS
            and not anonymous and envelope.compat_hash != expected_hash):
        differing = None
        if sender is not None and local_compat is not None:
            differing = compat_diff(local_compat, sender)
        raise HashMismatch(expected_hash, envelope.compat_hash, peer=peer, differing=differing)
    return envelope


def decode_payload(envelope: Envelope, kind: type[MessageT], *,
                   peer: str = UNKNOWN_PEER) -> MessageT:
    """Phase two: decode the payload strictly as ``kind``, which must match the envelope's."""
    want = KIND_OF[kind]
    if envelope.kind is not want:
        raise MalformedMessage("message", f"expected a {want.value}, found a "
                                          f"{envelope.kind.value}", peer=peer,
                               expected=want, found=envelope.kind)
    message = decode_strict(_PAYLOADS[kind], envelope.payload, want.value, peer)
    assert isinstance(message, kind)
    return message

