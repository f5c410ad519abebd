"""What a decode rank needs to READ from one prefill rank: :class:`AgentMetadata`.

A prefill's handshake listener answers a metadata request with one of these per
requested rank (:class:`~kvxfer.wire.messages.MetadataResponse`); a rank on the
decode's host may also offer reads straight from its memory (:class:`HostReads`).
"""

from __future__ import annotations

import msgspec

from kvxfer.plan.packing import TOKEN_PACKING
from kvxfer.plan.regions import RegionPlan
from kvxfer.wire.protocol_errors import require


class SharedRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A buffer of the prefill's cache that a reader on its host may map: buffer ``id``
    of the prefill process (what a reader asks its handover socket for, never a
    descriptor number), mapped there at ``addr`` for ``size`` bytes."""

    id: int
    addr: int
    size: int

    def __post_init__(self) -> None:
        require(0 < self.id < 2**63, f"SharedRegion.id must be positive, got {self.id}")
        require(self.addr > 0, f"SharedRegion.addr must be positive, got {self.addr}")
        require(0 < self.size < 2**62, f"SharedRegion.size must be positive, got "
                f"{self.size}")


class HostReads(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prefill rank's offer that a decode on its host may copy from its memory with
    ``process_vm_readv`` (:mod:`kvxfer.transfer.converted.host_reads`), or map the shared buffers
    its cache lies in (``memory``, :mod:`kvxfer.transfer.converted.mapped_reads`). ``host`` names
    the host and pid namespace (a pid means nothing outside them); ``canary`` is what a reader must
    find at ``canary_addr`` of ``pid`` before it trusts that pid to be this rank's process.
    A reader takes a buffer's descriptor from the abstract Unix socket ``handover`` (its name,
    the leading NUL byte included) by proving it read the secret at ``proof_addr`` of ``pid``
    (:mod:`kvxfer.transfer.converted.fd_handover`); the secret itself is never on the wire.
    Both are set exactly when ``memory`` names a buffer."""

    host: str
    pid: int
    canary_addr: int
    canary: bytes
    memory: tuple[SharedRegion, ...] = ()
    proof_addr: int = 0
    handover: str = ""

    def __post_init__(self) -> None:
        require(bool(self.host), "HostReads.host must not be empty")
        require(self.pid > 0, f"HostReads.pid must be positive, got {self.pid}")
        require(self.canary_addr > 0,
                f"HostReads.canary_addr must be positive, got {self.canary_addr}")
        require(8 <= len(self.canary) <= 64,
                f"HostReads.canary must be 8 to 64 bytes, got {len(self.canary)}")
        require(len(self.memory) <= 64,
                f"HostReads.memory may name at most 64 buffers, got {len(self.memory)}")
        require(self.proof_addr >= 0,
                f"HostReads.proof_addr must not be negative, got {self.proof_addr}")
        # sun_path holds 108 bytes; an abstract name starts with a NUL byte
        require(self.handover == "" or (self.handover.startswith("\0")
                                        and 1 < len(self.handover.encode()) <= 108),
                f"HostReads.handover must name an abstract Unix socket (a NUL byte, then at "
                f"most 107 bytes), got {self.handover!r}")
        require(bool(self.memory) == bool(self.handover) == (self.proof_addr > 0),
                "HostReads.memory, handover and proof_addr come together: buffers are "
                "offered with the socket and the proof that hand them over")


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
        require(bool(self.engine_id), "AgentMetadata.engine_id must not be empty")
        require(bool(self.agent_name), "AgentMetadata.agent_name must not be empty")
        require(self.tp_size > 0, f"AgentMetadata.tp_size must be positive, got {self.tp_size}")
        require(0 <= self.tp_rank < self.tp_size,
                f"AgentMetadata.tp_rank {self.tp_rank} is outside TP size {self.tp_size}")
        require(self.device_id >= 0,
                f"AgentMetadata.device_id must not be negative, got {self.device_id}")
        require(bool(self.backends) and all(self.backends),
                f"AgentMetadata.backends must name at least one backend, got "
                f"{list(self.backends)}")
        for name in ("num_blocks", "block_size", "layout", "kernel_ratio"):
            mine, planned = getattr(self, name), getattr(self.plan, name)
            require(mine == planned, f"AgentMetadata.{name} is {mine!r} but its plan says "
                                     f"{planned!r} (rank {self.tp_rank})")
        require(self.num_blocks > 0,
                f"AgentMetadata.num_blocks must be positive, got {self.num_blocks}")
        require(self.kernel_ratio > 0 and self.block_size > 0
                and self.block_size % self.kernel_ratio == 0,
                f"AgentMetadata.kernel_ratio {self.kernel_ratio} does not divide its "
                f"block_size {self.block_size} into kernel blocks (rank {self.tp_rank})")
