"""The messages of the side channel, each a strict msgspec Struct, and their kinds.

Metadata (:class:`MetadataRequest`, :class:`MetadataResponse`), leases (:class:`ReleaseLease`,
:class:`RenewLease`, :class:`DoneReport` and their acks), liveness (:class:`Heartbeat`,
:class:`HeartbeatAck`) and refusals (:class:`ErrorReply`). An envelope names its payload's
:class:`MessageKind`.

Design: docs/design/side-channel.md#messages
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from kvxfer.wire.metadata import AgentMetadata
from kvxfer.wire.notification import ReadDone
from kvxfer.wire.protocol_errors import ErrorCode, MalformedMessage, require


class MessageKind(str, enum.Enum):
    """What an envelope's payload holds."""

    METADATA_REQUEST = "metadata_request"
    METADATA_RESPONSE = "metadata_response"
    RELEASE = "release"
    RELEASE_ACK = "release_ack"
    RENEW = "renew"
    RENEW_ACK = "renew_ack"
    DONE = "done"
    HEARTBEAT = "heartbeat"
    HEARTBEAT_ACK = "heartbeat_ack"
    ERROR_REPLY = "error_reply"


HASH_FREE_KINDS: frozenset[MessageKind] = frozenset({
    MessageKind.RELEASE, MessageKind.RELEASE_ACK, MessageKind.RENEW, MessageKind.RENEW_ACK,
    MessageKind.DONE})
"""Kinds whose compatibility hash :func:`decode_envelope` does not check: they carry
no KV metadata, only a lease id, so two instances of different models may exchange
them (a decode whose handshake was refused for a model mismatch still releases)."""


class MetadataRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode → prefill: send me the metadata of these prefill TP ranks (unique, >= 0)."""

    requester_engine_id: str
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        require(bool(self.requester_engine_id),
                "MetadataRequest.requester_engine_id must not be empty")
        require(bool(self.ranks), "MetadataRequest.ranks must not be empty")
        require(all(r >= 0 for r in self.ranks),
                f"MetadataRequest.ranks must not be negative, got {list(self.ranks)}")
        require(len(set(self.ranks)) == len(self.ranks),
                f"MetadataRequest.ranks has duplicates: {list(self.ranks)}")


class MetadataResponse(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill → decode: one :class:`AgentMetadata` per requested rank, in request order.

    Every entry has this response's ``engine_id`` and ``tp_size``, each rank
    appears once, and all ranks share one block size, kernel block size and layout.
    """

    engine_id: str
    tp_size: int
    ranks: tuple[AgentMetadata, ...]

    def __post_init__(self) -> None:
        require(bool(self.ranks), "MetadataResponse.ranks must not be empty")
        for meta in self.ranks:
            require(meta.engine_id == self.engine_id,
                    f"rank {meta.tp_rank} belongs to engine {meta.engine_id!r}, the response "
                    f"to engine {self.engine_id!r}")
            require(meta.tp_size == self.tp_size,
                    f"rank {meta.tp_rank} says TP size {meta.tp_size}, the response says "
                    f"{self.tp_size}")
        numbers = [m.tp_rank for m in self.ranks]
        require(len(set(numbers)) == len(numbers), f"ranks repeat in the response: {numbers}")
        first = self.ranks[0]
        for meta in self.ranks[1:]:
            require((meta.block_size, meta.layout) == (first.block_size, first.layout),
                    f"rank {meta.tp_rank} has block size {meta.block_size} and layout "
                    f"{meta.layout}, rank {first.tp_rank} has {first.block_size} and "
                    f"{first.layout}")
            require(meta.kernel_ratio == first.kernel_ratio,
                    f"rank {meta.tp_rank} splits each block into {meta.kernel_ratio} kernel "
                    f"blocks, rank {first.tp_rank} into {first.kernel_ratio}")


class ReleaseOutcome(str, enum.Enum):
    """How a released lease ends on the prefill (its ``leases_released`` label)."""

    ABANDONED = "abandoned"  # the decode will not read it (refused, aborted, failed)
    CACHED = "cached"        # the decode's prefix cache held all of it: nothing to read
    ANSWERED = "answered"    # the prefill's first token was the whole answer: nothing to read


MAX_LEASE_ID_CHARS = 1024  # a request id (<= 200 characters) plus "@<serial>", with room
MAX_HOST_CHARS = 255  # a DNS name's limit
MAX_RELEASE_REASON_CHARS = 1024  # senders truncate; the reason is only logged


class ReleaseLease(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode → prefill: the decode will not read lease ``lease_id``; free its blocks now.

    ``lease_id`` is the ``remote_request_id`` of the prefill's ``kv_transfer_params``
    (unique per prefill engine, so a release can never end another lease).
    ``reason`` is free text for the prefill's log (e.g. why the decode refused
    the request); ``outcome`` how the lease ends there. Sent only when no reader's
    "done" will come.
    """

    lease_id: str
    requester_engine_id: str
    reason: str
    outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED

    def __post_init__(self) -> None:
        require(bool(self.lease_id), "ReleaseLease.lease_id must not be empty")
        require(len(self.lease_id) <= MAX_LEASE_ID_CHARS,
                f"ReleaseLease.lease_id has {len(self.lease_id)} characters, at most "
                f"{MAX_LEASE_ID_CHARS} are allowed")
        require(bool(self.requester_engine_id),
                "ReleaseLease.requester_engine_id must not be empty")
        require(len(self.reason) <= MAX_RELEASE_REASON_CHARS,
                f"ReleaseLease.reason has {len(self.reason)} characters, at most "
                f"{MAX_RELEASE_REASON_CHARS} are allowed")


class ReleaseAck(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill → decode: the answer to a :class:`ReleaseLease`.

    ``found`` is True when the prefill held lease ``lease_id`` as the release
    arrived (it ends on the prefill's next engine-loop iteration), False when
    no such lease is held (ended already, or never existed): nothing changed.
    """

    lease_id: str
    found: bool

    def __post_init__(self) -> None:
        require(bool(self.lease_id), "ReleaseAck.lease_id must not be empty")


class RenewLease(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode → prefill: the decode will still read lease ``lease_id`` (it waits, e.g.
    for free blocks, or reads); keep it for another lease TTL.

    With ``claim`` it is the decode's claim, sent once before its first READ: the
    prefill grants it only to the first engine that claims a held lease, and
    renews a lease only for its claimer, so params sent to a second decode (or to
    a restarted one, which has a new engine id) are never read.

    A prefill claims a decode's reservation (push mode) the same way, before its first
    WRITE, naming its own side channel (``claimer_host``, ``claimer_port``): the decode
    asks there whether the claimer still runs when the reservation is overdue.
    """

    lease_id: str
    requester_engine_id: str
    claim: bool = False
    claimer_host: str = ""
    claimer_port: Annotated[int, Meta(ge=0, le=65535)] = 0

    def __post_init__(self) -> None:
        require(bool(self.lease_id), "RenewLease.lease_id must not be empty")
        require(len(self.lease_id) <= MAX_LEASE_ID_CHARS,
                f"RenewLease.lease_id has {len(self.lease_id)} characters, at most "
                f"{MAX_LEASE_ID_CHARS} are allowed")
        require(bool(self.requester_engine_id),
                "RenewLease.requester_engine_id must not be empty")
        require(len(self.claimer_host) <= MAX_HOST_CHARS,
                f"RenewLease.claimer_host has more than {MAX_HOST_CHARS} characters")


class RenewAck(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill → decode: the answer to a :class:`RenewLease`.

    ``found`` is True when the lease was held (and, for a claim or a renewal,
    claimed by the requester) and now lasts ``expires_in`` seconds from when the
    prefill answered; False when it had ended, was claimed by another engine or
    reached its maximum age (the decode must not read it): ``reason`` says which.
    """

    lease_id: str
    found: bool
    expires_in: float
    reason: str = ""

    def __post_init__(self) -> None:
        require(bool(self.lease_id), "RenewAck.lease_id must not be empty")
        require(self.expires_in >= 0,
                f"RenewAck.expires_in must not be negative, got {self.expires_in}")


class DoneReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode rank → prefill rank ``prefill_rank``, over the side channel: the same
    :class:`~kvxfer.wire.notification.ReadDone` its NIXL notification carries (or would
    have carried: reads copied on the prefill's host send none).

    The prefill counts it as that notification: once per reader and lease, so the copy
    that arrives second changes nothing. The answer is a :class:`ReleaseAck` whose
    ``found`` says whether the lease was still held as the report arrived; a decode
    resends a report that got no answer (see
    :class:`~kvxfer.transfer.side_channel.sender.SideChannelSender`).

    Push mode sends it the other way: a prefill rank that WRITEs into a reservation reports
    its "done" to the decode rank holding it (``prefill_rank`` then names that rank: the
    rank of the instance whose side channel it reaches).
    """

    prefill_rank: int
    done: ReadDone

    def __post_init__(self) -> None:
        require(self.prefill_rank >= 0,
                f"DoneReport.prefill_rank must not be negative, got {self.prefill_rank}")
        require(len(self.done.request_id) <= MAX_LEASE_ID_CHARS,
                f"DoneReport's lease id has {len(self.done.request_id)} characters, at most "
                f"{MAX_LEASE_ID_CHARS} are allowed")


class Heartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode → prefill: does this side channel still answer? Sent while the decode has a
    READ in flight from the prefill (:mod:`kvxfer.transfer.side_channel.heartbeats`); it
    changes nothing on the prefill. ``seq`` counts the heartbeats of one connection
    from 0; the :class:`HeartbeatAck` echoes it."""

    requester_engine_id: str
    seq: int

    def __post_init__(self) -> None:
        require(bool(self.requester_engine_id),
                "Heartbeat.requester_engine_id must not be empty")
        require(self.seq >= 0, f"Heartbeat.seq must not be negative, got {self.seq}")


class HeartbeatAck(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill → decode: the answer to :class:`Heartbeat` ``seq``, sent at once, by engine
    ``engine_id`` (a push-mode decode asks a heartbeat of a reservation's claimer to learn
    whether it still runs there)."""

    seq: int
    engine_id: str = ""

    def __post_init__(self) -> None:
        require(self.seq >= 0, f"HeartbeatAck.seq must not be negative, got {self.seq}")


class RenewRefused(Exception):
    """A prefill will not claim or renew a lease for the decode that asked: it ended, another
    decode claimed it, or it reached its maximum age. The message says which; the listener
    answers it as a :class:`RenewAck` with ``found=False`` and that ``reason``."""


class ErrorReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill → decode: the request was refused; ``message`` names the reason."""

    code: ErrorCode
    message: str


Message = (MetadataRequest | MetadataResponse | ReleaseLease | ReleaseAck | RenewLease
           | RenewAck | DoneReport | Heartbeat | HeartbeatAck | ErrorReply)
MessageT = TypeVar("MessageT", MetadataRequest, MetadataResponse, ReleaseLease, ReleaseAck,
                   RenewLease, RenewAck, DoneReport, Heartbeat, HeartbeatAck, ErrorReply)

KIND_OF: dict[type[msgspec.Struct], MessageKind] = {
    MetadataRequest: MessageKind.METADATA_REQUEST,
    MetadataResponse: MessageKind.METADATA_RESPONSE,
    ReleaseLease: MessageKind.RELEASE,
    ReleaseAck: MessageKind.RELEASE_ACK,
    RenewLease: MessageKind.RENEW,
    RenewAck: MessageKind.RENEW_ACK,
    DoneReport: MessageKind.DONE,
    Heartbeat: MessageKind.HEARTBEAT,
    HeartbeatAck: MessageKind.HEARTBEAT_ACK,
    ErrorReply: MessageKind.ERROR_REPLY,
}
"""The kind each message type travels as."""


def check_response(response: MetadataResponse, ranks: Sequence[int], *,
                   peer: str) -> MetadataResponse:
    """Check that ``response`` holds exactly the requested ``ranks``, each once; return it.

    The response's internal consistency (engine ids, TP size, unique ranks) was
    checked when it was decoded.
    """
    found = tuple(m.tp_rank for m in response.ranks)
    if sorted(found) != sorted(ranks):
        raise MalformedMessage("metadata response",
                               f"it holds ranks {list(found)} but ranks {list(ranks)} were "
                               f"requested", peer=peer, expected=tuple(ranks), found=found)
    return response

