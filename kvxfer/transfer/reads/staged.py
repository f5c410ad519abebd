"""``StagedPath``: converted reads READ into staging and placed by the converter thread.

Staging is taken for all staged ranks at once or not at all (:meth:`StagedPath.reserve`);
sibling ranks of one process may share one staged read, which lands only when every
member's share ended. No READ carries a "done": the reader sends it once the read landed.

Design: docs/design/reads.md#staged
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvxfer.plan.staging import StagedRead
from kvxfer.transfer.converted.shared_staging import StagedMeeting, Target
from kvxfer.transfer.converted.staging_pool import Placement, StagedJob, StagedPiece
from kvxfer.transfer.local_rank import LocalRank
from kvxfer.transfer.nixl_agent import release_transfers
from kvxfer.transfer.peers import Peer
from kvxfer.transfer.reads.path import (
    LANDED,
    TIMEOUT,
    Progress,
    ReadFailed,
    ReadPath,
    Stale,
    Waiting,
    abandon_transfers,
    reads_landed,
)
from kvxfer.transfer.reads.read import Read
from kvxfer.transfer.results import ReadStats, TransferError


class StagedPath(ReadPath):
    """``reads``: (a staged prefill rank's plan, local ids, remote ids) per rank, in
    staging order (:meth:`~kvxfer.plan.staging.StagedRead.ids`). Joins the sibling
    meetings of the shared ones at once."""

    name = "staged"

    def __init__(self, local: LocalRank, peer: Peer, read: Read,
                 reads: Sequence[tuple[StagedRead, np.ndarray, np.ndarray]]) -> None:
        super().__init__([plan.remote_rank for plan, _, _ in reads])
        self._local, self._peer, self._read = local, peer, read
        self._job = StagedJob()  # the parts and buffers, once reserved
        self._transfers: list[Any] = []
        self._meetings: list[StagedMeeting] = []  # each settled once every share ended
        self._shares_ended = False
        self.members = 0  # in-process ranks that shared it (0: alone)
        try:
            self._pieces = [piece for staged in reads for piece in self._cut(*staged)]
        except BaseException as exc:  # a meeting failed: leave those joined already
            self.abandon(f"prefill {peer.engine_id} at {peer.address}: {exc}")
            raise

    @property
    def has_parts(self) -> bool:
        """Whether this rank READs anything itself (a member's share may be empty)."""
        return any(len(piece.remote_ids) for piece in self._pieces)

    def _cut(self, plan: StagedRead, local_ids: np.ndarray, remote_ids: np.ndarray
             ) -> list[StagedPiece]:
        """What this rank READs of one staged prefill rank and where it places it: all of
        it into its own views, or, shared with its in-process siblings, its share into
        every member's views."""
        local = self._local
        alone = [StagedPiece(plan, local_ids, remote_ids, (Placement(plan, local.view_groups),))]
        if plan.remote_rank not in self._peer.shared:
            return alone
        meeting = local.shares.staging.join(
            local.engine_id, self._peer.engine_id, self._read.lease_id,
            Target(local.rank, plan, local.view_groups, local.wake), local_ids, remote_ids)
        if meeting is None:
            return alone
        self._meetings.append(meeting)
        self.members = max(self.members, len(meeting.targets))
        placements = tuple(Placement(t.plan, t.groups, None if t.rank == local.rank else
                                     functools.partial(meeting.writing, t.rank))
                           for t in meeting.targets.values())
        lshare, rshare = meeting.shares[local.rank]
        return [StagedPiece(plan, local_ids[lshare], remote_ids[rshare], placements)] \
            if rshare.stop > rshare.start else []

    def reserve(self) -> bool:
        job = self._local.staging.take(self._pieces)
        if job is None:
            return False
        self._job = job  # from here on, abandon gives the buffers back
        return True

    def post(self) -> None:
        """Post the parts one after the other, each placed as soon as it landed (a READ
        over cma copies inside the post: the next one then copies while the converter
        places this one)."""
        local, peer = self._local, self._peer
        for part in self._job.parts:
            rank = part.plan.remote_rank
            try:
                part.transfer = local.agent.read(  # into host staging
                    peer.agents[rank], part.descs.local, part.descs.remote,
                    local_is_cuda=False, remote_is_cuda=peer.remote_cuda[rank])
            except Exception as exc:
                raise ReadFailed(f"prefill {peer.engine_id} rank {rank} at {peer.address}: "
                                 f"READ could not be posted: {exc}", peer_gone=str(exc)) from exc
            self._transfers.append(part.transfer)
            self.num_bytes += part.descs.num_bytes
            self.descriptors += len(part.descs)
            local.staging.place_landed(self._job)

    def progress(self) -> Progress:
        remote, staging = self._read.remote, self._local.staging
        engine, where = remote.remote_engine_id, f"prefill {remote.remote_engine_id}"
        try:
            landed = reads_landed(self._transfers)
        except TransferError as exc:
            raise ReadFailed(f"{where} at {remote.address}: {exc}", peer_gone=str(exc)) from exc
        placed = staging.place_landed(self._job)
        if not landed:
            return Waiting(f"READ still in progress after {TIMEOUT} s",
                           peer=f"{where} at {remote.address}")
        if placed is False:  # every byte landed, the placing copy is slow: not the peer's
            return Waiting(f"placing the read from {where} took longer than {TIMEOUT} s")
        if placed is not True:
            raise ReadFailed(f"placing the read from {where} failed: {placed}")
        if not self._shares_ended:  # this rank's parts are placed: its staging goes back
            self._shares_ended = True  # now, not after the siblings'
            staging.settle(self._job, engine)
            for meeting in self._meetings:
                meeting.end_share(self._local.rank)
        if not all(m.settled for m in self._meetings):  # a sibling's share is still read
            return Waiting(f"{where}: a sibling decode rank's share of the read did not "
                           f"end within {TIMEOUT} s")
        failed = next((m.error for m in self._meetings if m.error is not None), None)
        if failed is not None:
            raise ReadFailed(f"{where}: a sibling decode rank's share of the read failed: "
                             f"{failed}")
        return LANDED

    def finish(self) -> None:
        release_transfers(self._transfers, self._read.request_id)
        self._local.staging.settle(self._job, self._read.engine)

    def abandon(self, reason: str) -> Stale | None:
        """Also end this rank's shares: siblings fail too, and place nothing more here.
        READs still in flight land in staging, never in blocks (nothing places them now):
        they are :class:`Stale`, and their staging stays held (the pool holds a failed
        read's buffers until its peer is dropped, which waits for them to settle)."""
        stale = abandon_transfers(self._transfers, self._read.request_id, blocks=False)
        self._local.staging.settle(self._job, self._read.engine)
        for meeting in self._meetings:
            meeting.end_share(self._local.rank, reason)
            meeting.close(self._local.rank)
        return stale

    def add_to(self, stats: ReadStats) -> ReadStats:
        stats = super().add_to(stats)
        return replace(stats, members=max(stats.members, self.members),
                       staged_ranks=stats.staged_ranks + len(self.ranks))
