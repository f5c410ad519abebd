"""``Route``: the path this decode rank reads one prefill rank over, chosen once per peer.

One of :data:`PATHS` (``mapped``, ``host``, ``staged``, ``nixl``). :func:`candidates` runs on
a pool thread, from the handshake (no NIXL); :func:`choose` on the worker's thread, once NIXL
connected: it probes each candidate into scratch memory (never the cache) and keeps the first
unless a later one was :data:`MARGIN` times faster. The chosen path's probe rate (bytes per
second) is its ceiling.

Design: docs/design/reads.md#routes
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Final

import numpy as np
import torch

from kvxfer.plan.descriptors import PeerReadPlan, SideGeometry
from kvxfer.plan.regions import MemoryRegion
from kvxfer.plan.staging import StagedRead, plan_staged_read
from kvxfer.plan.topology import HeadSlice
from kvxfer.transfer.converted.host_reads import (
    HostRead,
    check_offer,
    copy_vectors,
    plan_host_read,
)
from kvxfer.transfer.converted.mapped_reads import MappedRead, copy_alone, map_prefill
from kvxfer.transfer.lanes import Part, copy_parts, overdue_after
from kvxfer.transfer.local_rank import LocalRank
from kvxfer.transfer.threads import run_all
from kvxfer.wire.metadata import AgentMetadata, HostReads

log = logging.getLogger(__name__)

PATHS: Final = ("mapped", "host", "staged", "nixl")
# per probe pass (two per candidate): ~1.5 ms copied, ~3 ms over cma, ~27 ms over TCP
PROBE_BYTES: Final = 16 << 20
MARGIN: Final = 1.25  # how much faster a later candidate must probe to be taken
PROBE_MIN_BYTES: Final = 1 << 20  # smaller probes time per-call costs: they do not choose
SLOW_PROBE_S: Final = 0.05  # a first 1 MiB this slow (under ~20 MB/s) times its path alone
_ALIGN = 4096  # probe shares start at page boundaries


@dataclass(frozen=True)
class Route:
    """How one prefill rank is read: ``path`` (:data:`PATHS`), the handshake's ``plan``
    for it, the ``copy`` a path on this host copies with (mapped, host), and the path's
    ``ceiling`` in bytes per second (:func:`choose`; None: not measured)."""

    path: str
    plan: PeerReadPlan | StagedRead
    copy: MappedRead | HostRead | None = None
    ceiling: float | None = None

    @property
    def remote_rank(self) -> int:
        return self.plan.remote_rank


# -- pool thread: what the handshake offers -----------------------------------------------

def candidates(local: LocalRank, plans: Sequence[PeerReadPlan | StagedRead],
               metas: Mapping[int, AgentMetadata], geometries: Mapping[int, SideGeometry],
               slices: Sequence[HeadSlice], *, on_host: bool) -> dict[int, tuple[Route, ...]]:
    """Each planned prefill rank's candidate routes, in the handshake's order of preference
    (a converted rank: one of mapped, host, staged; a direct one: mapped then NIXL, or NIXL);
    ``on_host``: whether copies on this host may be taken.
    Raises nothing for a copy that cannot be planned or mapped: the rank is read over
    NIXL then (logged)."""
    out: dict[int, tuple[Route, ...]] = {}
    for plan in plans:
        rank = plan.remote_rank
        elsewhere = Route("staged" if isinstance(plan, StagedRead) else "nixl", plan)
        here = _on_host(local, plan, metas[rank], geometries[rank],
                        [s for s in slices if s.remote_rank == rank]) if on_host else None
        if isinstance(plan, StagedRead):
            out[rank] = (here or elsewhere,)
        else:
            out[rank] = (elsewhere,) if here is None else (here, elsewhere)
    return out


def _on_host(local: LocalRank, plan: PeerReadPlan | StagedRead, meta: AgentMetadata,
             remote: SideGeometry, slices: Sequence[HeadSlice]) -> Route | None:
    """The copy on this host ``plan``'s rank can be read with: mapped, else (converted
    reads) a host read; None where none can (logged)."""
    rank, offer = plan.remote_rank, meta.host_reads
    why = "this rank's cache is GPU memory" if local.is_cuda else \
        "its cache is not host memory" if any(m.is_cuda for m in meta.plan.memory) else \
        check_offer(offer)
    if why is not None or offer is None:
        log.info("rank %d: prefill rank %d is not read on this host: %s", local.rank, rank, why)
        return None
    mapped = _mapped(local, plan, offer, remote, slices)
    if mapped is not None:
        log.info("rank %d can read prefill rank %d (%s -> %s) from its mapped cache, %d bytes "
                 "per block", local.rank, rank, mapped.plan.remote.layout,
                 mapped.plan.local.layout, mapped.plan.placed_per_block)
        return Route("mapped", plan, mapped)
    if not isinstance(plan, StagedRead):
        return None  # a direct read's only copy here is a mapped one: NIXL's cma is the other
    runs = plan_host_read(plan, local.view_groups, offer)
    if runs is None:
        log.info("rank %d: prefill rank %d is not host-read: its runs are too short to pay, or "
                 "the block sizes differ", local.rank, rank)
        return None
    log.info("rank %d host-reads prefill rank %d (%s -> %s): %d runs, %d bytes per block",
             local.rank, rank, plan.remote.layout, plan.local.layout, runs.runs_per_block,
             runs.bytes_per_block)
    return Route("host", plan, runs)


def _mapped(local: LocalRank, plan: PeerReadPlan | StagedRead, offer: HostReads,
            remote: SideGeometry, slices: Sequence[HeadSlice]) -> MappedRead | None:
    """``plan``'s read from the offered mapped cache (a direct plan as the copy of the same
    heads), or None where the cache is not mapped (logged)."""
    try:
        copy = plan if isinstance(plan, StagedRead) else \
            plan_staged_read(local.geometry, remote, plan.remote_rank, slices)
        mapped = map_prefill(copy, local.view_groups, offer, local.shares.mappings)
    except Exception as exc:  # IncompatibleLayoutError, HostReadError, or anything else
        log.info("rank %d: prefill rank %d's cache is not mapped: %s: %s", local.rank,
                 plan.remote_rank, type(exc).__name__, exc)
        return None
    if mapped is None:
        log.info("rank %d: prefill rank %d's cache is not mapped: it offers no shared buffer "
                 "around its chunks, or they do not lie at fixed strides", local.rank,
                 plan.remote_rank)
    return mapped


# -- worker thread: measured, chosen ------------------------------------------------------

def choose(local: LocalRank, options: Sequence[Route], agent: str, memory: MemoryRegion
           ) -> tuple[Route, dict[str, float]]:
    """The route to read one prefill rank over, its ceiling set, and every candidate's
    probe rate (bytes per second; a path missing failed or was not probed). ``agent``:
    the prefill rank's NIXL agent, connected; ``memory``: its first registered entry."""
    rates: dict[str, float] = {}
    for route in options:
        rate = _probe(local, route, agent, memory)
        if rate is not None:
            rates[route.path] = rate
    best = options[0]
    if min(PROBE_BYTES, memory.nbytes) >= PROBE_MIN_BYTES:
        for other in options[1:]:
            mine, theirs = rates.get(best.path), rates.get(other.path)
            if theirs is not None and (mine is None or theirs > MARGIN * mine):
                best = other
    return replace(best, ceiling=rates.get(best.path)), rates


def _probe(local: LocalRank, route: Route, agent: str, memory: MemoryRegion) -> float | None:
    """Bytes per second ``route``'s path moved a probe at, or None (not probed, failed)."""
    if local.is_cuda:
        return None
    try:
        if isinstance(route.copy, MappedRead):
            return _copy_rate(local, route.copy.mapping.bytes)
        if isinstance(route.copy, HostRead):
            return _host_rate(local, route.copy.offer, memory)
        return _read_rate(local, agent, memory)
    except Exception as exc:  # a probe only informs the choice; the reads report failures
        log.info("rank %d: probing prefill rank %d over %s failed: %s", local.rank,
                 route.remote_rank, route.path, exc)
        return None


def _timed(run: Callable[[], object]) -> float:
    """Seconds of ``run``'s second call (the first faults pages in on both sides)."""
    run()
    start = time.perf_counter()
    run()
    return max(time.perf_counter() - start, 1e-9)


def _rate(move: Callable[[int], object], nbytes: int) -> float:
    """Bytes per second of ``move(n)``, which moves the first ``n`` of ``nbytes`` bytes.
    A first move of :data:`PROBE_MIN_BYTES` that takes longer than :data:`SLOW_PROBE_S`
    and again is a slow path (a slow link: page faults cost microseconds) and the second
    times it, so that probing a slow link costs two small moves, not two whole probes;
    any other path is timed on its second move of all ``nbytes``."""
    small = min(nbytes, PROBE_MIN_BYTES)

    def once() -> float:
        start = time.perf_counter()
        move(small)
        return max(time.perf_counter() - start, 1e-9)

    if once() > SLOW_PROBE_S and (took := once()) > SLOW_PROBE_S:  # twice: not a first-use cost
        return small / took
    return nbytes / _timed(lambda: move(nbytes))


def _cuts(nbytes: int, count: int) -> list[tuple[int, int]]:
    """``nbytes`` cut into ``count`` shares at page boundaries (empty ones at the end)."""
    bounds = [min(nbytes, nbytes * i // count // _ALIGN * _ALIGN) for i in range(count)]
    return list(zip(bounds, [*bounds[1:], nbytes], strict=True))


def _shared_out(local: LocalRank, share: Callable[[int, int], object]
                ) -> Callable[[int], None]:
    """A move of the first ``n`` bytes by ``share(lo, hi)``, cut into one share per copy
    thread of the rank, as a mapped or host read is shared out."""
    pool = local.lanes.pool if local.lanes else None

    def move(nbytes: int) -> None:
        run_all([functools.partial(share, lo, hi) for lo, hi in _cuts(nbytes, local.threads)
                 if hi > lo], pool)

    return move


def _copy_rate(local: LocalRank, mapped: torch.Tensor) -> float:
    """A copy out of the mapping's first bytes, as a mapped read copies."""
    source = mapped[:PROBE_BYTES]
    target = torch.empty_like(source)
    return _rate(_shared_out(local, lambda lo, hi: copy_alone(target[lo:hi], source[lo:hi])),
                 len(source))


def _host_rate(local: LocalRank, offer: HostReads, memory: MemoryRegion) -> float:
    """``process_vm_readv`` of the cache's first bytes."""
    nbytes = min(PROBE_BYTES, memory.nbytes)
    target = np.zeros(nbytes, dtype=np.uint8)
    base = target.ctypes.data

    def share(lo: int, hi: int) -> None:
        copy_vectors(offer.pid, np.array([[base + lo, hi - lo]], dtype=np.uint64),
                     np.array([[memory.addr + lo, hi - lo]], dtype=np.uint64))

    return _rate(_shared_out(local, share), nbytes)


def _read_rate(local: LocalRank, agent: str, memory: MemoryRegion) -> float:
    """NIXL READs of the cache's first bytes, shared out over the rank's agents as a
    large read is (:class:`~kvxfer.transfer.lanes.Lanes`)."""
    nbytes = min(PROBE_BYTES, memory.nbytes)
    agents = local.agents()
    timeout = local.deadlines.read_timeout
    with ExitStack() as stack:
        scratch = [stack.enter_context(own.scratch(hi - lo)) if hi > lo else None
                   for own, (lo, hi) in zip(agents, _cuts(nbytes, len(agents)), strict=True)]

        def parts(n: int) -> list[list[Part]]:
            out: list[list[Part]] = []
            for rows, (lo, hi) in zip(scratch, _cuts(n, len(agents)), strict=True):
                if rows is None or hi <= lo:
                    out.append([])
                    continue
                local_rows = rows.copy()
                local_rows[0, 1] = hi - lo
                remote = np.array([[memory.addr + lo, hi - lo, memory.device_id]],
                                  dtype=np.uint64)
                out.append([(agent, local_rows, remote, memory.is_cuda)])
            return out

        lanes = local.lanes
        if lanes is None:
            return _rate(lambda n: copy_parts(local.agent, parts(n)[0], False,
                                              overdue_after(timeout)), nbytes)
        return _rate(lambda n: lanes.copy(parts(n), False, overdue_after(timeout)), nbytes)
