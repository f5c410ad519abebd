"""The NIXL notification a decode rank sends each prefill rank it read from: :class:`ReadDone`.

Pure: msgspec and the standard library only, no I/O; a decode's
:class:`~kvxfer.transfer.peers.Peer` sends these bytes through NIXL and the prefill's
:class:`~kvxfer.transfer.leases.LeaseTable` receives them. On the wire: ``MAGIC``, then
the msgpack map of ``{version, done, signature}``, signed with the shared key when there is one.
"""

from __future__ import annotations

import hmac

import msgspec

from kvxfer.wire import version
from kvxfer.wire.framing import ENCODER, UNKNOWN_PEER, check_version, decode_strict, sign
from kvxfer.wire.protocol_errors import BadSignature, require
from kvxfer.wire.version import MAGIC


class ReadDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode rank → prefill rank, as a NIXL notification after its READ finished.

    ``ok`` is False when the reader gave up (the prefill may free early).
    ``expected_readers`` is how many decode ranks read from this prefill rank
    for the request; the prefill frees the blocks when that many said done.
    """

    request_id: str
    reader_engine_id: str
    reader_rank: int
    expected_readers: int
    ok: bool

    def __post_init__(self) -> None:
        require(bool(self.request_id), "ReadDone.request_id must not be empty")
        require(bool(self.reader_engine_id), "ReadDone.reader_engine_id must not be empty")
        require(self.reader_rank >= 0,
                f"ReadDone.reader_rank must not be negative, got {self.reader_rank}")
        require(self.expected_readers > 0,
                f"ReadDone.expected_readers must be positive, got {self.expected_readers}")


class _NotifFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A notification on the wire (after MAGIC); ``signature`` is HMAC-SHA256 over the
    magic, the version and ``done`` (absent without a key)."""

    version: int
    done: ReadDone
    signature: bytes | None = None


_FRAME = msgspec.msgpack.Decoder(_NotifFrame)


def _signed_bytes(number: int, done: ReadDone) -> bytes:
    """What the HMAC covers: the magic, the version ``number`` and ``done``."""
    return MAGIC + ENCODER.encode((number, done))


def encode_notif(done: ReadDone, hmac_key: bytes | None = None) -> bytes:
    """The NIXL notification bytes for ``done``: magic, then msgpack ``{version, done,
    signature}``; signed when a key is given.

    A notification has no nonce: the lease id it names is unique and used once,
    and a reader's "done" counts once per lease, so a replayed one changes nothing.
    """
    signature = None
    number = version.KVXFER_PROTOCOL_VERSION
    if hmac_key is not None:
        signature = sign(hmac_key, _signed_bytes(number, done))
    return MAGIC + ENCODER.encode(_NotifFrame(number, done, signature))


def decode_notif(raw: bytes, *, peer: str = UNKNOWN_PEER,
                 hmac_key: bytes | None = None) -> ReadDone:
    """Decode a notification strictly; anything else raises a :class:`ProtocolError`.

    With ``hmac_key`` an unsigned or badly signed one raises :class:`BadSignature`."""
    body = check_version(raw, "notification", peer)
    frame = decode_strict(_FRAME, body, "notification", peer)
    if hmac_key is not None:
        want = sign(hmac_key, _signed_bytes(frame.version, frame.done))
        if frame.signature is None or not hmac.compare_digest(want, frame.signature):
            raise BadSignature(frame.signature, peer=peer)
    return frame.done

