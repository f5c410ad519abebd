"""Read lanes: extra NIXL agents of one decode rank, each copying on its own thread.

With NIXL's cma transport a READ copies inside the posting call, on one core, and each
descriptor costs a few microseconds, so one thread cannot move many small descriptors
at memory speed. A lane is an extra agent with the same (host) memory registered,
connected to the same peers; a large request's descriptor lists are split across the
rank's own agent and the lanes (:meth:`Lanes.split`), each part copied by its own
thread while the worker thread copies the first and waits for all of them
(:meth:`Lanes.copy`), so every agent is still used by one thread at a time. The lanes'
threads also serve the host and mapped reads' copy shares
(:mod:`kvxfer.transfer.converted`). Only the worker thread calls a :class:`Lanes`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvxfer.plan.descriptors import RankDescriptors
from kvxfer.plan.regions import MemoryRegion
from kvxfer.transfer.nixl_agent import NixlAgent, in_flight
from kvxfer.transfer.results import Span, TransferError, merge_spans
from kvxfer.transfer.threads import run_all

log = logging.getLogger(__name__)

LANE_MIN_DESCRIPTORS = 64  # smaller requests: one thread (lanes cost a thread hand-off)
LANE_POLL_S = 0.0002       # a lane waiting for a READ the transport did not finish at once

# One agent's share of a read: (remote agent, local descriptors, remote descriptors,
# whether the remote side is GPU memory), one per prefill rank it reads from.
Part = tuple[str, Any, Any, bool]
# Whether a copy must give up now: the error to raise, or None to go on waiting.
Overdue = Callable[[], Exception | None]


class Lanes:
    """``count`` extra agents beside ``agent``, with ``memory`` registered, each copying on
    its own thread; called by the worker thread only."""

    def __init__(self, agent: NixlAgent, count: int, memory: Sequence[MemoryRegion],
                 rank: int) -> None:
        self.agent = agent
        self.agents: list[NixlAgent] = []
        try:
            for lane in range(1, count + 1):
                extra = NixlAgent(f"{agent.name}-lane{lane}", agent.backends)
                self.agents.append(extra)
                extra.register(memory)
        except BaseException:
            self.close()
            raise
        self.pool = ThreadPoolExecutor(max_workers=count,
                                       thread_name_prefix=f"kvxfer-lane-r{rank}")

    @staticmethod
    def pay_for(descriptors: int) -> bool:
        """Whether a read of ``descriptors`` is worth splitting over the lanes."""
        return descriptors >= LANE_MIN_DESCRIPTORS

    @property
    def threads(self) -> int:
        """Threads a copy is shared out to: the caller's and the lanes'."""
        return 1 + len(self.agents)

    def connect(self, blob: bytes, name: str, probe: MemoryRegion) -> None:
        """Load a peer's agent (``name``, as the rank's own agent loaded it) into every lane
        and warm each connection."""
        for lane in self.agents:
            lane.add_remote(blob)
            lane.connect(name, probe=probe)

    def remove(self, name: str) -> None:
        for lane in self.agents:
            try:
                lane.remove_remote(name)
            except Exception as exc:
                log.info("removing remote agent %s from %s failed: %s", name, lane.name, exc)

    def split(self, descs: Sequence[RankDescriptors], agents: dict[int, str],
              remote_cuda: dict[int, bool]) -> list[list[Part]]:
        """Each prefill rank's list cut into one contiguous part per agent (the rank's
        own first); part ``i`` of every list goes to agent ``i``."""
        parts: list[list[Part]] = [[] for _ in range(self.threads)]
        for rank_descs in descs:
            name = agents[rank_descs.remote_rank]
            bounds = np.linspace(0, len(rank_descs), self.threads + 1).astype(int)
            for lane, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                if hi > lo:
                    parts[lane].append((name, rank_descs.local[lo:hi], rank_descs.remote[lo:hi],
                                        remote_cuda[rank_descs.remote_rank]))
        return parts

    def copy(self, parts: Sequence[Sequence[Part]], local_cuda: bool, overdue: Overdue,
             stale: list[Any] | None = None) -> Span | None:
        """READ every agent's ``parts`` at once (the rank's own agent on this thread);
        return once all landed (with NIXL's span of them all), or raise the first error
        once every one ended (each lane gives up once ``overdue`` returns an error:
        :func:`copy_parts`, which leaves a READ it gave up in flight in ``stale``)."""
        agents = [self.agent, *self.agents]
        lanes = run_all([functools.partial(copy_parts, agent, part, local_cuda, overdue, stale)
                         for agent, part in zip(agents, parts, strict=True)], self.pool)
        return merge_spans(span for lane in lanes for span in lane)

    def close(self) -> None:
        """Wait for the lanes' threads, then close their agents."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for lane in self.agents:
            lane.close()


def copy_parts(agent: NixlAgent, parts: Sequence[Part], local_cuda: bool,
               overdue: Overdue, stale: list[Any] | None = None) -> list[Span | None]:
    """Lane (or worker) thread: READ each part with ``agent`` and wait until it landed
    (NIXL's span of each READ: ``Transfer.span``); raise what ``overdue()`` returns (any
    thread may call it) as soon as it is not None. A READ given up while NIXL still
    reports it in flight goes, unreleased, into ``stale`` when given (its bytes may still
    land: :class:`~kvxfer.transfer.reads.path.Stale`), else is released."""
    spans: list[Span | None] = []
    for remote, local, remote_descs, remote_cuda in parts:
        transfer = agent.read(remote, local, remote_descs, local_is_cuda=local_cuda,
                              remote_is_cuda=remote_cuda)
        landed = False
        try:
            while transfer.state() != "DONE":
                failure = overdue()
                if failure is not None:
                    raise failure
                time.sleep(LANE_POLL_S)
            landed = True
            spans.append(transfer.span)
        finally:
            if stale is not None and not landed and in_flight([transfer]):
                stale.append(transfer)
            else:
                transfer.release()
    return spans


def overdue_after(timeout: float) -> Overdue:
    """An ``overdue`` for :func:`copy_parts`: a TransferError once ``timeout`` seconds
    passed from now (a copy that is not a request's read: the probe of a path)."""
    deadline = time.monotonic() + timeout

    def overdue() -> Exception | None:
        if time.monotonic() > deadline:
            return TransferError(f"READ still in progress after {timeout:.0f} s")
        return None

    return overdue
