"""``LocalRank``: one decode rank as a reader, fixed once its KV caches are registered.

What every part of a read needs to know about the rank it reads for: who it is
(engine, rank), the memory it reads into (region plan, geometry, the views by layer
group for converted reads, the memory kind), the collaborators it reads with (its
NIXL agent and read lanes, its staging pool, the shares of its in-process siblings, the
key that signs its "done" notifications, the event that wakes its worker thread and
the tally of what only metrics count), and how long it waits (:class:`Deadlines`).
:class:`~kvxfer.transfer.worker.TransferWorker` builds it in ``register_kv_caches`` and
hands it to its peers and reads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxfer.plan.descriptors import SideGeometry
from kvxfer.plan.regions import MemoryRegion, RegionPlan
from kvxfer.transfer.converted.process_shares import ProcessShares
from kvxfer.transfer.converted.staging_pool import StagingPool
from kvxfer.transfer.lanes import Lanes
from kvxfer.transfer.liveness import Liveness
from kvxfer.transfer.nixl_agent import NixlAgent
from kvxfer.transfer.results import Tally, TransferError


def memory_kind(memory: Sequence[MemoryRegion], whose: str) -> bool:
    """Whether ``memory`` is GPU memory (True) or host memory; a READ's descriptors on
    one side are all of one kind, so a cache mixing both is refused."""
    kinds = {m.is_cuda for m in memory}
    if len(kinds) != 1:
        raise TransferError(f"{whose} registers both host and GPU memory; one cache must be "
                            f"one kind" if kinds else f"{whose} registers no memory")
    return kinds.pop()


@dataclass
class Deadlines:
    """How long a decode rank waits: a handshake up to ``1 + handshake_retries`` attempts
    of ``handshake_timeout`` seconds
    (:meth:`~kvxfer.transfer.side_channel.client.SideChannelClient.fetch`), a read
    ``read_timeout`` seconds once posted (or waiting for staging before it is), or, with
    ``liveness``, less: a read in flight from a prefill whose side channel has left a
    heartbeat unanswered for ``liveness.timeout`` seconds fails then. The worker's
    attributes of the same names set them; what starts next uses them."""

    handshake_timeout: float
    handshake_retries: int
    read_timeout: float
    liveness: Liveness | None = None  # shared by the instance's ranks (thread-safe)


@dataclass(frozen=True)
class LocalRank:
    """This decode rank as its reads see it: identity, memory, collaborators, deadlines."""

    engine_id: str
    rank: int
    tp_size: int
    plan: RegionPlan
    geometry: SideGeometry
    # where converted reads land: the views by logical layer, as layer groups
    view_groups: list[tuple[int, torch.Tensor]]
    is_cuda: bool  # the memory kind of the registered cache
    agent: NixlAgent
    lanes: Lanes | None  # extra agents (host caches with read_lanes > 1)
    staging: StagingPool
    shares: ProcessShares
    key: bytes | None  # signs "done" notifications
    wake: threading.Event
    tally: Tally
    deadlines: Deadlines

    @property
    def threads(self) -> int:
        """Threads a host or mapped copy is shared out to."""
        return self.lanes.threads if self.lanes else 1

    def agents(self) -> list[NixlAgent]:
        """The rank's own agent and its lanes'."""
        return [self.agent, *(self.lanes.agents if self.lanes else ())]
