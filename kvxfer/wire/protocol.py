"""Wire messages of the handshake side channel and of NIXL "done" notifications.

Pure: msgspec and the standard library only, no I/O. ``kvxfer.transfer.handshake`` moves
these bytes over ZMQ; ``kvxfer.transfer.worker`` sends notifications through NIXL.

A handshake message on the wire is ``MAGIC`` followed by the msgpack map of an
:class:`Envelope`, whose ``payload`` is the msgpack map of one message
(:class:`MetadataRequest`, :class:`MetadataResponse`, :class:`ReleaseLease`,
:class:`ReleaseAck`, :class:`RenewLease`, :class:`RenewAck` or :class:`ErrorReply`).
Decoding is two-phase and strict:
:func:`decode_envelope` checks the magic, the protocol version, the envelope's
shape, the signature and the compatibility hash before anything else is looked
at; :func:`decode_payload` then decodes the inner message into its declared
type. Nothing is decoded into untyped dicts.

Two exchanges share the side channel: metadata (decode asks, prefill answers
with its ranks' NIXL metadata) and release (a decode that will not read a lease
tells the prefill, which frees the blocks at once instead of at lease expiry).
A release carries no KV metadata, so its compatibility hash is not checked
(:data:`HASH_FREE_KINDS`): a decode of another model, whose handshake was
refused for that very reason, must still be able to release. Magic, version,
shape and signature are checked as for every message.

With a shared key every envelope and notification is signed (HMAC-SHA256,
compared in constant time); a signed envelope also carries a timestamp and a
random nonce, and a receiver refuses stale or repeated ones (:class:`ReplayGuard`)
as :class:`ReplayedMessage`, a :class:`BadSignature`. A renewal (a decode still
waiting to read a lease asks the prefill to keep it) is hash-free like a release.

Every decoding failure raises a :class:`ProtocolError` subclass whose message
names the peer and what was expected and found, so a receiver can log it,
answer with an :class:`ErrorReply` and carry on.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Sequence
from typing import ClassVar, NamedTuple, TypeVar

import msgspec

from kvxfer.plan.packing import TOKEN_PACKING, VLLM_CPU_PACKING_PREFIX
from kvxfer.plan.regions import RegionPlan

# Version history; bump on every change of the bytes on the wire (envelope,
# messages, notifications, RegionPlan and its parts, the signed bytes).
#   1: first version: MAGIC + msgpack Envelope {version, compat_hash, kind,
#      payload, signature, sender}; MetadataRequest / MetadataResponse /
#      ErrorReply payloads; AgentMetadata carries a RegionPlan; ReadDone
#      notifications as MAGIC + msgpack {version, done}.
#   2: message kinds "release" (ReleaseLease, decode -> prefill) and "release_ack"
#      (ReleaseAck); neither has its compat hash checked.
#   3: signed envelopes carry a timestamp and a random nonce (both signed) so that
#      a receiver refuses replays; notifications carry an optional HMAC signature;
#      message kinds "renew" (RenewLease) and "renew_ack" (RenewAck), hash-free.
#   4: RenewLease.claim (a decode claims a lease before its first READ; the prefill
#      records the claimer and refuses every other engine) and RenewAck.reason.
#   5: CompatInfo.kv_packing (how K and V share a head's block: per token, as the
#      reference engine keeps them, or as vLLM's CPU attention kernels store them).
#   6: CompatInfo.kv_lora_rank (0: K and V heads; > 0: an MLA latent cache) and
#      RegionPlan.latent.
#   7: AgentMetadata.backends (the NIXL backends the rank's agent runs) and
#      AgentMetadata.kv_packing; CompatInfo.kv_packing no longer enters the compat hash
#      (peers with different packings talk, the decode converts).
#   8: RegionPlan.kernel_ratio and AgentMetadata.kernel_ratio: a rank's views may see each
#      logical block (what block ids count, block_size) as kernel_ratio kernel blocks,
#      the blocks its regions address; ids stay logical on the wire.
#   9: AgentMetadata.host_reads (HostReads): a prefill rank offers that a decode on its
#      host copies converted reads straight from its memory (kvxfer.transfer.converted.host_reads).
#  10: HostReads.memory (SharedRegion): the shared buffers (memfds) the rank's cache lies
#      in, which a decode on its host may map (kvxfer.transfer.converted.mapped_reads).
KVXFER_PROTOCOL_VERSION: int = 10

MAGIC = b"KVXF"
"""The first four bytes of every kvxfer handshake message and notification."""

_UNKNOWN_PEER = "<unnamed peer>"


class MessageKind(str, enum.Enum):
    """What an envelope's payload holds."""

    METADATA_REQUEST = "metadata_request"
    METADATA_RESPONSE = "metadata_response"
    RELEASE = "release"
    RELEASE_ACK = "release_ack"
    RENEW = "renew"
    RENEW_ACK = "renew_ack"
    ERROR_REPLY = "error_reply"


HASH_FREE_KINDS: frozenset[MessageKind] = frozenset({
    MessageKind.RELEASE, MessageKind.RELEASE_ACK, MessageKind.RENEW, MessageKind.RENEW_ACK})
"""Kinds whose compatibility hash :func:`decode_envelope` does not check: they carry
no KV metadata, only a lease id, so two instances of different models may exchange
them (a decode whose handshake was refused for a model mismatch still releases)."""

MAX_MESSAGE_AGE_S = 30.0
"""A signed message whose timestamp is further than this from the receiver's clock
is refused (so a captured message cannot be replayed later); nonces are remembered
for as long. Clocks of the two sides must agree to well within this."""

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


# -- errors ---------------------------------------------------------------------------------

class HandshakeError(Exception):
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


class ProtocolError(HandshakeError):
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
        super().__init__(f"peer {peer} speaks kvxfer protocol {found}, this side speaks "
                         f"{KVXFER_PROTOCOL_VERSION}", peer=peer,
                         expected=KVXFER_PROTOCOL_VERSION, found=found)


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


class ReplayedMessage(BadSignature):
    """A correctly signed message that is stale (timestamp outside the window) or
    whose nonce was seen already: a replay."""

    def __init__(self, why: str, *, peer: str) -> None:
        ProtocolError.__init__(self, f"peer {peer} sent a signed message that is refused as a "
                                     f"replay: {why}", peer=peer,
                               expected=f"a fresh message (within {MAX_MESSAGE_AGE_S:g} s, "
                                        f"new nonce)", found=why)


class MalformedMessage(ProtocolError):
    """Right magic and version, but the content does not decode or does not make sense."""

    def __init__(self, what: str, detail: str, *, peer: str, expected: object = None,
                 found: object = None) -> None:
        super().__init__(f"peer {peer} sent a malformed {what}: {detail}", peer=peer,
                         expected=expected if expected is not None else what, found=found)


# -- compatibility --------------------------------------------------------------------------

def _require(condition: bool, message: str) -> None:
    """Validation inside ``__post_init__`` (msgspec turns the ValueError into a
    ValidationError when it happens while decoding)."""
    if not condition:
        raise ValueError(message)


class CompatInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What two instances must agree on to exchange KV caches at all.

    Strings are canonical names chosen by the caller (dtypes without a
    ``torch.`` prefix, e.g. ``"bfloat16"``). ``total_kv_heads`` counts every KV
    head of the model, not one rank's share. TP size, block size and layout are
    deliberately absent: they may differ between the sides and are checked when
    descriptors are planned, with precise messages.

    ``kv_lora_rank`` is 0 for a cache of K and V heads. Above 0 the cache is an
    MLA latent one: per token one vector of ``head_size`` elements, the first
    ``kv_lora_rank`` the compressed KV and the rest the decoupled RoPE key, in a
    single head (``total_kv_heads == 1``) that every TP rank holds. Its bytes
    per token may equal some K/V cache's, so the two kinds must never pair.
    """

    model: str
    dtype: str
    cache_dtype: str
    head_size: int
    total_kv_heads: int
    num_layers: int
    kv_packing: str = TOKEN_PACKING  # see kvxfer.plan.packing
    kv_lora_rank: int = 0
    protocol_version: int = KVXFER_PROTOCOL_VERSION

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "cache_dtype"):
            _require(bool(getattr(self, name)), f"CompatInfo.{name} must not be empty")
        _require(self.kv_packing == TOKEN_PACKING or (
            self.kv_packing.startswith(VLLM_CPU_PACKING_PREFIX)
            and len(self.kv_packing) > len(VLLM_CPU_PACKING_PREFIX)),
            f"CompatInfo.kv_packing must be {TOKEN_PACKING!r} or "
            f"'{VLLM_CPU_PACKING_PREFIX}<isa>', got {self.kv_packing!r}")
        for name in ("head_size", "total_kv_heads", "num_layers", "protocol_version"):
            value = getattr(self, name)
            _require(value > 0, f"CompatInfo.{name} must be positive, got {value}")
        _require(self.kv_lora_rank >= 0,
                 f"CompatInfo.kv_lora_rank must not be negative, got {self.kv_lora_rank}")
        _require(not self.kv_lora_rank or (self.kv_lora_rank < self.head_size
                                           and self.total_kv_heads == 1),
                 f"CompatInfo of an MLA latent cache (kv_lora_rank {self.kv_lora_rank}) needs "
                 f"total_kv_heads 1 (got {self.total_kv_heads}) and a head_size above the "
                 f"rank, for the RoPE part (got {self.head_size})")


# What two peers may differ in and still exchange KV: a decode converts between the
# packings it knows (kvxfer.plan.staging); each rank's AgentMetadata says its own.
NEGOTIATED_FIELDS = ("kv_packing",)


def compat_hash(info: CompatInfo) -> str:
    """Hex SHA-256 of the canonical msgpack encoding of ``info``'s fields in declared
    order, :data:`NEGOTIATED_FIELDS` left out."""
    fields = [getattr(info, name) for name in CompatInfo.__struct_fields__
              if name not in NEGOTIATED_FIELDS]
    return hashlib.sha256(msgspec.msgpack.encode(fields)).hexdigest()


def compat_diff(here: CompatInfo, peer: CompatInfo) -> tuple[FieldDiff, ...]:
    """The fields on which ``here`` and ``peer`` differ, in declared order."""
    return tuple(FieldDiff(name, getattr(here, name), getattr(peer, name))
                 for name in CompatInfo.__struct_fields__
                 if name not in NEGOTIATED_FIELDS and getattr(here, name) != getattr(peer, name))


# -- messages -------------------------------------------------------------------------------

class SharedRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A buffer of the prefill's cache that a reader on its host may map: descriptor
    ``fd`` of the prefill process, mapped there at ``addr`` for ``size`` bytes."""

    fd: int
    addr: int
    size: int

    def __post_init__(self) -> None:
        _require(self.fd >= 0, f"SharedRegion.fd must not be negative, got {self.fd}")
        _require(self.addr > 0, f"SharedRegion.addr must be positive, got {self.addr}")
        _require(0 < self.size < 2**62, f"SharedRegion.size must be positive, got "
                 f"{self.size}")


class HostReads(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prefill rank's offer that a decode on its host may copy from its memory with
    ``process_vm_readv`` (:mod:`kvxfer.transfer.converted.host_reads`), or map the shared buffers
    its cache lies in (``memory``, :mod:`kvxfer.transfer.converted.mapped_reads`). ``host`` names
    the host and pid namespace (a pid means nothing outside them); ``canary`` is what a reader must
    find at ``canary_addr`` of ``pid`` before it trusts that pid to be this rank's process."""

    host: str
    pid: int
    canary_addr: int
    canary: bytes
    memory: tuple[SharedRegion, ...] = ()

    def __post_init__(self) -> None:
        _require(bool(self.host), "HostReads.host must not be empty")
        _require(self.pid > 0, f"HostReads.pid must be positive, got {self.pid}")
        _require(self.canary_addr > 0,
                 f"HostReads.canary_addr must be positive, got {self.canary_addr}")
        _require(8 <= len(self.canary) <= 64,
                 f"HostReads.canary must be 8 to 64 bytes, got {len(self.canary)}")
        _require(len(self.memory) <= 64,
                 f"HostReads.memory may name at most 64 buffers, got {len(self.memory)}")


class AgentMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a decode rank needs to READ from one prefill TP rank.

    ``agent_blob`` is the NIXL agent metadata (``get_agent_metadata()``);
    ``plan`` carries the memory registrations and per-region geometry (base
    address, block_len and block_stride in bytes, head geometry).
    ``num_blocks``, ``block_size``, ``layout`` and ``kernel_ratio`` repeat the plan's
    values so a peer can check them without reading the plan; they must agree with it.
    ``num_blocks`` and ``block_size`` are logical (what block ids count); each block is
    ``kernel_ratio`` kernel blocks of ``block_size // kernel_ratio`` tokens, as the
    rank's attention kernel sees its cache (1: no split).
    ``backends`` are the NIXL backends its agent runs: a reader needs one in common.
    ``kv_packing`` is how it packs K and V in a head's block; a reader with another
    packing converts (:mod:`kvxfer.plan.staging`).
    """

    engine_id: str
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_blob: bytes
    device_id: int
    num_blocks: int
    block_size: int
    layout: str
    plan: RegionPlan
    backends: tuple[str, ...] = ("UCX",)
    kv_packing: str = TOKEN_PACKING  # how this rank packs K and V (kvxfer.plan.packing)
    kernel_ratio: int = 1  # kernel blocks per logical block (RegionPlan.kernel_ratio)
    host_reads: HostReads | None = None  # None: read it over NIXL only

    def __post_init__(self) -> None:
        _require(bool(self.engine_id), "AgentMetadata.engine_id must not be empty")
        _require(bool(self.agent_name), "AgentMetadata.agent_name must not be empty")
        _require(self.tp_size > 0, f"AgentMetadata.tp_size must be positive, got {self.tp_size}")
        _require(0 <= self.tp_rank < self.tp_size,
                 f"AgentMetadata.tp_rank {self.tp_rank} is outside TP size {self.tp_size}")
        _require(self.device_id >= 0,
                 f"AgentMetadata.device_id must not be negative, got {self.device_id}")
        _require(bool(self.backends) and all(self.backends),
                 f"AgentMetadata.backends must name at least one backend, got "
                 f"{list(self.backends)}")
        for name in ("num_blocks", "block_size", "layout", "kernel_ratio"):
            mine, planned = getattr(self, name), getattr(self.plan, name)
            _require(mine == planned, f"AgentMetadata.{name} is {mine!r} but its plan says "
                                      f"{planned!r} (rank {self.tp_rank})")
        _require(self.num_blocks > 0,
                 f"AgentMetadata.num_blocks must be positive, got {self.num_blocks}")
        _require(self.kernel_ratio > 0 and self.block_size > 0
                 and self.block_size % self.kernel_ratio == 0,
                 f"AgentMetadata.kernel_ratio {self.kernel_ratio} does not divide its "
                 f"block_size {self.block_size} into kernel blocks (rank {self.tp_rank})")


class MetadataRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode → prefill: send me the metadata of these prefill TP ranks (unique, >= 0)."""

    requester_engine_id: str
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        _require(bool(self.requester_engine_id),
                 "MetadataRequest.requester_engine_id must not be empty")
        _require(bool(self.ranks), "MetadataRequest.ranks must not be empty")
        _require(all(r >= 0 for r in self.ranks),
                 f"MetadataRequest.ranks must not be negative, got {list(self.ranks)}")
        _require(len(set(self.ranks)) == len(self.ranks),
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
        _require(bool(self.ranks), "MetadataResponse.ranks must not be empty")
        for meta in self.ranks:
            _require(meta.engine_id == self.engine_id,
                     f"rank {meta.tp_rank} belongs to engine {meta.engine_id!r}, the response "
                     f"to engine {self.engine_id!r}")
            _require(meta.tp_size == self.tp_size,
                     f"rank {meta.tp_rank} says TP size {meta.tp_size}, the response says "
                     f"{self.tp_size}")
        numbers = [m.tp_rank for m in self.ranks]
        _require(len(set(numbers)) == len(numbers), f"ranks repeat in the response: {numbers}")
        first = self.ranks[0]
        for meta in self.ranks[1:]:
            _require((meta.block_size, meta.layout) == (first.block_size, first.layout),
                     f"rank {meta.tp_rank} has block size {meta.block_size} and layout "
                     f"{meta.layout}, rank {first.tp_rank} has {first.block_size} and "
                     f"{first.layout}")
            _require(meta.kernel_ratio == first.kernel_ratio,
                     f"rank {meta.tp_rank} splits each block into {meta.kernel_ratio} kernel "
                     f"blocks, rank {first.tp_rank} into {first.kernel_ratio}")


MAX_LEASE_ID_CHARS = 1024  # a request id (<= 200 characters) plus "@<serial>", with room
MAX_RELEASE_REASON_CHARS = 1024  # senders truncate; the reason is only logged


class ReleaseLease(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode → prefill: the decode will not read lease ``lease_id``; free its blocks now.

    ``lease_id`` is the ``remote_request_id`` of the prefill's ``kv_transfer_params``
    (unique per prefill engine, so a release can never end another lease).
    ``reason`` is free text for the prefill's log (e.g. why the decode refused
    the request). Sent only when no NIXL "done" notification will come.
    """

    lease_id: str
    requester_engine_id: str
    reason: str

    def __post_init__(self) -> None:
        _require(bool(self.lease_id), "ReleaseLease.lease_id must not be empty")
        _require(len(self.lease_id) <= MAX_LEASE_ID_CHARS,
                 f"ReleaseLease.lease_id has {len(self.lease_id)} characters, at most "
                 f"{MAX_LEASE_ID_CHARS} are allowed")
        _require(bool(self.requester_engine_id),
                 "ReleaseLease.requester_engine_id must not be empty")
        _require(len(self.reason) <= MAX_RELEASE_REASON_CHARS,
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
        _require(bool(self.lease_id), "ReleaseAck.lease_id must not be empty")


class RenewLease(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode → prefill: the decode will still read lease ``lease_id`` (it waits, e.g.
    for free blocks, or reads); keep it for another lease TTL.

    With ``claim`` it is the decode's claim, sent once before its first READ: the
    prefill grants it only to the first engine that claims a held lease, and
    renews a lease only for its claimer, so params sent to a second decode (or to
    a restarted one, which has a new engine id) are never read.
    """

    lease_id: str
    requester_engine_id: str
    claim: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.lease_id), "RenewLease.lease_id must not be empty")
        _require(len(self.lease_id) <= MAX_LEASE_ID_CHARS,
                 f"RenewLease.lease_id has {len(self.lease_id)} characters, at most "
                 f"{MAX_LEASE_ID_CHARS} are allowed")
        _require(bool(self.requester_engine_id),
                 "RenewLease.requester_engine_id must not be empty")


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
        _require(bool(self.lease_id), "RenewAck.lease_id must not be empty")
        _require(self.expires_in >= 0,
                 f"RenewAck.expires_in must not be negative, got {self.expires_in}")


class ErrorReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill → decode: the request was refused; ``message`` names the reason."""

    code: ErrorCode
    message: str


Message = (MetadataRequest | MetadataResponse | ReleaseLease | ReleaseAck | RenewLease
           | RenewAck | ErrorReply)
MessageT = TypeVar("MessageT", MetadataRequest, MetadataResponse, ReleaseLease, ReleaseAck,
                   RenewLease, RenewAck, ErrorReply)

_KIND_OF: dict[type[msgspec.Struct], MessageKind] = {
    MetadataRequest: MessageKind.METADATA_REQUEST,
    MetadataResponse: MessageKind.METADATA_RESPONSE,
    ReleaseLease: MessageKind.RELEASE,
    ReleaseAck: MessageKind.RELEASE_ACK,
    RenewLease: MessageKind.RENEW,
    RenewAck: MessageKind.RENEW_ACK,
    ErrorReply: MessageKind.ERROR_REPLY,
}


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


# -- the envelope ---------------------------------------------------------------------------

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


class _Header(msgspec.Struct):
    """Phase one: only the version, ignoring other fields, so that a peer speaking
    another version (whose envelope may have other fields) gets VersionMismatch."""

    version: int


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
        _require(bool(self.request_id), "ReadDone.request_id must not be empty")
        _require(bool(self.reader_engine_id), "ReadDone.reader_engine_id must not be empty")
        _require(self.reader_rank >= 0,
                 f"ReadDone.reader_rank must not be negative, got {self.reader_rank}")
        _require(self.expected_readers > 0,
                 f"ReadDone.expected_readers must be positive, got {self.expected_readers}")


class _NotifFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A notification on the wire (after MAGIC); ``signature`` is HMAC-SHA256 over the
    magic, the version and ``done`` (absent without a key)."""

    version: int
    done: ReadDone
    signature: bytes | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODED: tuple[type[msgspec.Struct], ...] = (*_KIND_OF, Envelope, _Header, _NotifFrame)
_DECODERS: dict[type[msgspec.Struct], msgspec.msgpack.Decoder[msgspec.Struct]] = {
    t: msgspec.msgpack.Decoder(t) for t in _DECODED
}


def _signed_bytes(envelope: Envelope) -> bytes:
    """What the HMAC covers: the magic and every envelope field except the signature."""
    return MAGIC + _ENCODER.encode((envelope.version, envelope.compat_hash, envelope.kind.value,
                                    envelope.payload, envelope.sender, envelope.timestamp,
                                    envelope.nonce))


def _sign(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def encode_message(message: Message, *, compat: CompatInfo, hmac_key: bytes | None = None,
                   include_compat: bool = True) -> bytes:
    """The wire bytes of ``message``: magic, envelope, payload; signed when a key is given.

    ``include_compat`` sends this side's :class:`CompatInfo` along, so a peer
    with a different hash can say which fields differ.
    """
    kind = _KIND_OF[type(message)]
    payload = _ENCODER.encode(message)
    sender = compat if include_compat else None
    envelope = Envelope(KVXFER_PROTOCOL_VERSION, compat_hash(compat), kind, payload, None,
                        sender)
    if hmac_key is not None:
        envelope = msgspec.structs.replace(envelope, timestamp=time.time(),
                                           nonce=os.urandom(NONCE_BYTES))
        envelope = msgspec.structs.replace(envelope,
                                           signature=_sign(hmac_key, _signed_bytes(envelope)))
    return MAGIC + _ENCODER.encode(envelope)


def _decode(kind: type[msgspec.Struct], data: bytes, what: str, peer: str) -> msgspec.Struct:
    try:
        return _DECODERS[kind].decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(what, str(exc), peer=peer) from None


def _check_version(raw: bytes, what: str, peer: str) -> bytes:
    """Phase one, shared by envelopes and notifications: magic, then version.
    Returns the bytes after the magic."""
    if raw[:len(MAGIC)] != MAGIC:
        raise BadMagic(raw, peer=peer)
    body = bytes(raw[len(MAGIC):])
    header = _decode(_Header, body, what, peer)
    assert isinstance(header, _Header)
    if header.version != KVXFER_PROTOCOL_VERSION:
        raise VersionMismatch(header.version, peer=peer)
    return body


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
    body = _check_version(raw, "envelope", peer)
    envelope = _decode(Envelope, body, "envelope", peer)
    assert isinstance(envelope, Envelope)
    if hmac_key is not None:
        want = _sign(hmac_key, _signed_bytes(envelope))
        if envelope.signature is None or not hmac.compare_digest(want, envelope.signature):
            raise BadSignature(envelope.signature, peer=peer)
        (replay or _FRESHNESS).check(envelope.nonce, envelope.timestamp, peer=peer)
    sender = envelope.sender
    if sender is not None and compat_hash(sender) != envelope.compat_hash:
        raise MalformedMessage("envelope", f"its compat_hash {envelope.compat_hash} is not the "
                                           f"hash of the CompatInfo it carries", peer=peer)
    if (expected_hash is not None and envelope.kind not in HASH_FREE_KINDS
            and envelope.compat_hash != expected_hash):
        differing = None
        if sender is not None and local_compat is not None:
            differing = compat_diff(local_compat, sender)
        raise HashMismatch(expected_hash, envelope.compat_hash, peer=peer, differing=differing)
    return envelope


def decode_payload(envelope: Envelope, kind: type[MessageT], *,
                   peer: str = _UNKNOWN_PEER) -> MessageT:
    """Phase two: decode the payload strictly as ``kind``, which must match the envelope's."""
    want = _KIND_OF[kind]
    if envelope.kind is not want:
        raise MalformedMessage("message", f"expected a {want.value}, found a "
                                          f"{envelope.kind.value}", peer=peer,
                               expected=want, found=envelope.kind)
    message = _decode(kind, envelope.payload, want.value, peer)
    assert isinstance(message, kind)
    return message


# -- notifications --------------------------------------------------------------------------

def _notif_signed_bytes(version: int, done: ReadDone) -> bytes:
    return MAGIC + _ENCODER.encode((version, done))


def encode_notif(done: ReadDone, hmac_key: bytes | None = None) -> bytes:
    """The NIXL notification bytes for ``done``: magic, then msgpack ``{version, done,
    signature}``; signed when a key is given.

    A notification has no nonce: the lease id it names is unique and used once,
    and a reader's "done" counts once per lease, so a replayed one changes nothing.
    """
    signature = None
    if hmac_key is not None:
        signature = _sign(hmac_key, _notif_signed_bytes(KVXFER_PROTOCOL_VERSION, done))
    return MAGIC + _ENCODER.encode(_NotifFrame(KVXFER_PROTOCOL_VERSION, done, signature))


def decode_notif(raw: bytes, *, peer: str = _UNKNOWN_PEER,
                 hmac_key: bytes | None = None) -> ReadDone:
    """Decode a notification strictly; anything else raises a :class:`ProtocolError`.

    With ``hmac_key`` an unsigned or badly signed one raises :class:`BadSignature`."""
    body = _check_version(raw, "notification", peer)
    frame = _decode(_NotifFrame, body, "notification", peer)
    assert isinstance(frame, _NotifFrame)
    if hmac_key is not None:
        want = _sign(hmac_key, _notif_signed_bytes(frame.version, frame.done))
        if frame.signature is None or not hmac.compare_digest(want, frame.signature):
            raise BadSignature(frame.signature, peer=peer)
    return frame.done


# -- replays --------------------------------------------------------------------------------

NONCE_BYTES = 16


class ReplayGuard:
    """Refuses signed messages that are stale or whose nonce was seen (thread-safe).

    Nonces are remembered for ``2 * max_age`` seconds (a message is accepted up to
    ``max_age`` early or late), at most ``max_nonces`` of them; only messages whose
    signature verified are recorded, so only key holders can fill it.
    """

    def __init__(self, max_age: float = MAX_MESSAGE_AGE_S, *, remember: bool = True,
                 max_nonces: int = 1_000_000) -> None:
        self.max_age, self._remember, self._max = max_age, remember, max_nonces
        self._seen: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._next_purge = 0.0

    def check(self, nonce: bytes, timestamp: float, *, peer: str,
              now: float | None = None) -> None:
        """Raise :class:`ReplayedMessage` unless the message is fresh; record its nonce."""
        now = time.time() if now is None else now
        if not abs(now - timestamp) <= self.max_age:
            raise ReplayedMessage(f"its timestamp is {now - timestamp:+.1f} s from this side's "
                                  f"clock, more than {self.max_age:g} s", peer=peer)
        if not self._remember:
            return
        if len(nonce) != NONCE_BYTES:
            raise ReplayedMessage(f"its nonce has {len(nonce)} bytes, not {NONCE_BYTES}",
                                  peer=peer)
        with self._lock:
            if now >= self._next_purge or len(self._seen) >= self._max:
                self._purge(now)
            if nonce in self._seen:
                raise ReplayedMessage("its nonce was seen already", peer=peer)
            if len(self._seen) >= self._max:
                raise ReplayedMessage("too many recent messages to remember", peer=peer)
            self._seen[nonce] = now + 2 * self.max_age

    def _purge(self, now: float) -> None:
        self._seen = {n: until for n, until in self._seen.items() if until > now}
        self._next_purge = now + self.max_age


_FRESHNESS = ReplayGuard(remember=False)  # a caller without a guard still refuses stale ones
