"""``LanesPath``: the direct READs of a large request, split over this rank's read lanes.

Taken instead of :class:`~kvxfer.transfer.reads.direct.DirectPath` where the rank has
lanes (:mod:`kvxfer.transfer.lanes`), the read has no staged part and its descriptors
number at least :data:`~kvxfer.transfer.lanes.LANE_MIN_DESCRIPTORS`. Each prefill rank's
list is cut into one contiguous part per agent, every agent copies its parts on its own
thread, and :meth:`LanesPath.post` returns once every part ended. Only then are the
"done" notifications sent (a prefill never frees blocks still being read by a lane), so
the path has landed when posted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvxfer.plan.descriptors import RankDescriptors
from kvxfer.transfer.lanes import Lanes
from kvxfer.transfer.local_rank import LocalRank
from kvxfer.transfer.peers import Peer
from kvxfer.transfer.reads.path import TIMEOUT, ReadFailed, ReadPath, Stale, Waiting
from kvxfer.transfer.reads.read import Read
from kvxfer.transfer.results import ReadStats

log = logging.getLogger(__name__)


class LanesPath(ReadPath):
    """``descs`` as for a direct read; the lanes give the READs up at the read's deadline
    (:meth:`~kvxfer.transfer.reads.read.Read.overdue`: its timeout, or its peer's
    silence)."""

    notifies = True  # told right after the copy, before the path is reported landed
    lands_in_post = True

    def __init__(self, local: LocalRank, lanes: Lanes, peer: Peer, read: Read,
                 descs: Sequence[RankDescriptors]) -> None:
        super().__init__([d.remote_rank for d in descs])
        self._local, self._lanes, self._peer, self._read = local, lanes, peer, read
        self._descs = descs
        self.lanes = 1  # agents that copied a part
        self._stale: list[Any] = []  # READs given up in flight (Stale)

    def post(self) -> None:
        peer = self._peer
        parts = self._lanes.split(self._descs, peer.agents, peer.remote_cuda)
        self.num_bytes += sum(d.num_bytes for d in self._descs)
        self.descriptors += sum(len(d) for d in self._descs)
        self.lanes = sum(1 for part in parts if part)
        read, deadlines = self._read, self._local.deadlines
        waiting = Waiting(f"READ still in progress after {TIMEOUT} s",
                          peer=f"prefill {peer.engine_id} at {peer.address}")
        def overdue() -> ReadFailed | None:  # as the reader gives up a read in flight
            return read.overdue(waiting, deadlines.read_timeout, deadlines.liveness,
                                time.monotonic())

        try:
            self.nixl_span = self._lanes.copy(parts, self._local.is_cuda, overdue,
                                              self._stale)
        except ReadFailed:
            raise
        except Exception as exc:
            raise ReadFailed(f"prefill {peer.engine_id} at {peer.address}: READ failed: {exc}",
                             peer_gone=str(exc)) from exc
        if not peer.tell(self._local, self._read.lease_id, self.ranks, ok=True):
            log.info("request %s was read, but not every prefill rank could be told by NIXL "
                     "(its side-channel report still will)", self._read.request_id)

    def finish(self) -> None:
        """Nothing is held: every lane's READs were released as they landed."""

    def abandon(self, reason: str) -> Stale | None:
        """The READs a lane gave up while they were in flight, as :class:`Stale`."""
        stale, self._stale = self._stale, []
        return Stale(stale, self._read.request_id) if stale else None

    def add_to(self, stats: ReadStats) -> ReadStats:
        stats = super().add_to(stats)
        return replace(stats, lanes=max(stats.lanes, self.lanes))
