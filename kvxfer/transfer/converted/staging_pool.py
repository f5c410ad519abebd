"""The staging buffers converted transfers use, and the thread that places reads.

Threading: only the worker thread calls a :class:`StagingPool`; its converter thread only
runs placements. A read takes its buffers all or none; a failed read's buffers are held until
its prefill's connection is dropped (:meth:`StagingPool.drop_held`).

Design: docs/design/converted-reads.md#the-staging-pool
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvxfer.plan.descriptors import RankDescriptors
from kvxfer.plan.regions import MemoryRegion
from kvxfer.plan.staging import StagedRead
from kvxfer.transfer.nixl_agent import NixlAgent

LIMIT_BYTES = 4 << 30  # staging of the converted reads in flight at once, per rank
CHUNK_BYTES = 64 << 20  # buffers are allocated in multiples of this
PART_BYTES = 16 << 20  # a converted read is READ and placed in parts of about this


class StagingTooSmall(RuntimeError):
    """One transfer needs more staging than the pool may ever hold."""


def buffer_size(nbytes: int, granule: int = CHUNK_BYTES) -> int:
    """The size of the buffer allocated for ``nbytes``: whole ``granule``s."""
    return -(-nbytes // granule) * granule


@dataclass
class Staging:
    """A registered host buffer."""

    buffer: torch.Tensor
    handles: list[Any]


@dataclass(frozen=True)
class Placement:
    """Where a staged part's heads go: ``plan``'s heads into view ``groups``. ``guard``
    (a shared read's other member:
    :meth:`kvxfer.transfer.converted.shared_staging.StagedMeeting.writing`) says whether the
    placement may still start."""

    plan: StagedRead
    groups: Sequence[tuple[int, torch.Tensor]]
    guard: Callable[[], AbstractContextManager[bool]] | None = None


@dataclass(frozen=True)
class StagedPiece:
    """What a rank READs of one prefill rank through staging: ``remote_ids``' blocks,
    paired with ``local_ids`` (in staging order: :meth:`~kvxfer.plan.staging.StagedRead.ids`),
    placed into ``placements``."""

    plan: StagedRead
    local_ids: np.ndarray
    remote_ids: np.ndarray
    placements: tuple[Placement, ...]


@dataclass
class Part:
    """One READ of a converted read: some of its blocks, into ``staging`` at ``offset``."""

    plan: StagedRead
    staging: Staging
    offset: int
    local_ids: np.ndarray
    remote_blocks: int  # staged in this part, the remote ids' blocks paired with local_ids
    descs: RankDescriptors
    placements: tuple[Placement, ...]
    transfer: Any = None  # the posted READ
    placed: Future[None] | None = None

    def place(self) -> None:
        """Converter thread: copy the landed part's heads into every placement."""
        staging, ids = self.staging.buffer[self.offset:], torch.from_numpy(self.local_ids)
        for target in self.placements:
            with target.guard() if target.guard else nullcontext(True) as allowed:
                if allowed:
                    target.plan.convert(staging, target.groups, ids, self.plan.remote.kv_packing,
                                        target.plan.local.kv_packing, self.remote_blocks)


@dataclass
class StagedJob:
    """A converted read's parts and the buffers they land in."""

    parts: list[Part] = field(default_factory=list)
    stagings: list[Staging] = field(default_factory=list)


class StagingPool:
    """One rank's registered staging buffers (at most ``limit`` bytes) and its converter
    thread; called by the worker thread only."""

    def __init__(self, agent: NixlAgent, name: str, limit: int = LIMIT_BYTES) -> None:
        self._agent, self._name, self.limit = agent, name, limit
        self._free: list[Staging] = []
        self._held: dict[str, list[Staging]] = {}  # by prefill engine
        self._bytes = 0  # allocated: free, in use or held
        self._converter: ThreadPoolExecutor | None = None

    def take(self, reads: Sequence[StagedPiece]) -> StagedJob | None:
        """Buffers for ``reads``, cut into parts; None while the buffers in use leave too
        little room."""
        needs = [len(read.remote_ids) * read.plan.bytes_per_block for read in reads]
        stagings = self.buffers(needs)
        if stagings is None:
            return None
        job = StagedJob(stagings=stagings)
        for read, staging in zip(reads, job.stagings, strict=True):
            plan, local, remote = read.plan, read.local_ids, read.remote_ids
            for lpart, rpart in plan.parts(len(local), len(remote), PART_BYTES):
                offset = rpart.start * plan.bytes_per_block
                descs = plan.descriptors(remote[rpart], staging.buffer.data_ptr() + offset)
                job.parts.append(Part(plan, staging, offset, local[lpart],
                                      rpart.stop - rpart.start, descs, read.placements))
        return job

    def buffers(self, needs: Sequence[int], granule: int = CHUNK_BYTES
                ) -> list[Staging] | None:
        """A registered buffer of at least each of ``needs`` bytes (a new one: whole
        ``granule``s), all or none: None while the buffers in use leave too little room;
        :class:`StagingTooSmall` when they never could. Given back with :meth:`give`."""
        if sum(buffer_size(n, granule) for n in needs) > self.limit:
            raise StagingTooSmall(
                f"converting this transfer needs {sum(needs) >> 20} MiB of staging, more "
                f"than the {self.limit >> 20} MiB limit; use layouts both sides can copy "
                f"directly (see kvxfer plan), or pull mode, which converts in parts")
        taken: list[Staging] = []
        try:
            for need in needs:
                staging = self._take(need, granule)
                if staging is None:
                    self._free.extend(taken)
                    return None
                taken.append(staging)
        except Exception:
            self._free.extend(taken)
            raise
        return taken

    def give(self, stagings: Sequence[Staging], held_for: str | None = None) -> None:
        """Buffers of :meth:`buffers` back: to the pool, or, where a transfer given up
        may still touch them, held until :meth:`drop_held` for ``held_for`` (the peer
        engine whose connection would carry it)."""
        if held_for is None:
            self._free.extend(stagings)
        else:
            self._held.setdefault(held_for, []).extend(stagings)

    def _take(self, nbytes: int, granule: int = CHUNK_BYTES) -> Staging | None:
        fits = [s for s in self._free if s.buffer.numel() >= nbytes]
        if fits:
            best = min(fits, key=lambda s: s.buffer.numel())
            self._free.remove(best)
            return best
        size = buffer_size(nbytes, granule)
        while self._bytes + size > self.limit and self._free:
            self._release(self._free.pop())  # free ones too small: make room
        if self._bytes + size > self.limit:
            return None
        buffer = torch.empty(size, dtype=torch.uint8)
        handles = self._agent.register([MemoryRegion(buffer.data_ptr(), size, 0)])
        self._bytes += size
        return Staging(buffer, handles)

    def _release(self, staging: Staging) -> None:
        with contextlib.suppress(Exception):
            self._agent.deregister(staging.handles)
        self._bytes -= staging.buffer.numel()

    def place_landed(self, job: StagedJob) -> bool | str:
        """Start placing every part that landed (once each) into its placements; True when
        all are placed, False while some are not yet, or why a placement failed."""
        for part in job.parts:
            self._start_placing(part)
        for part in job.parts:
            if part.placed is None or not part.placed.done():
                return False
            error = part.placed.exception()
            if error is not None:
                return f"{type(error).__name__}: {error}"
        return True

    def _start_placing(self, part: Part) -> None:
        if part.placed is not None or part.transfer is None:
            return
        try:
            landed = part.transfer.state() == "DONE"
        except Exception:  # a failed READ: the worker fails the read from its state
            return
        if not landed:
            return
        if self._converter is None:
            self._converter = ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix=f"kvxfer-convert-{self._name}")
        part.placed = self._converter.submit(part.place)

    def settle(self, job: StagedJob, engine_id: str) -> None:
        """Wait for placements still running (a failed read's blocks are about to be
        freed), then give the buffers back: to the pool when every posted part landed,
        else held until :meth:`drop_held` for ``engine_id``, as a cancelled READ may
        still write into them."""
        landed = True
        for part in job.parts:
            if part.placed is not None:
                with contextlib.suppress(Exception):
                    part.placed.result()
            elif part.transfer is not None:
                landed = False
        if landed:
            self._free.extend(job.stagings)
        else:
            self._held.setdefault(engine_id, []).extend(job.stagings)
        job.parts.clear()
        job.stagings.clear()

    def drop_held(self, engine_id: str) -> None:
        """``engine_id``'s connection is gone: no cancelled READ writes into its held
        buffers any more, no cancelled WRITE reads them."""
        for staging in self._held.pop(engine_id, []):
            self._release(staging)

    @property
    def allocated(self) -> int:
        """Bytes of the buffers allocated: free, in use or held."""
        return self._bytes

    @property
    def free(self) -> int:
        """Buffers free for the next transfer."""
        return len(self._free)

    @property
    def held(self) -> int:
        """Buffers held for failed reads and cut-off pushes."""
        return sum(len(v) for v in self._held.values())

    def close(self) -> None:
        """Stop the converter thread (placements finish first)."""
        if self._converter is not None:
            self._converter.shutdown(wait=True)
