"""``DirectPath``: one NIXL READ per prefill rank, straight into this rank's views.

The default path: the request's descriptors toward each prefill rank whose heads byte
copies can place (:func:`~kvxfer.plan.descriptors.build_requests_descriptors`), posted
at once, each READ carrying that rank's signed "done" notification, which NIXL delivers
after the bytes landed. The prefill rank thus learns of the read with no message of
ours; the path has landed once every READ reports DONE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvxfer.plan.descriptors import RankDescriptors
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
from kvxfer.transfer.results import TransferError, merge_spans


class DirectPath(ReadPath):
    """``descs``: the request's descriptors, one list per prefill rank."""

    notifies = True

    def __init__(self, local: LocalRank, peer: Peer, read: Read,
                 descs: Sequence[RankDescriptors]) -> None:
        super().__init__([d.remote_rank for d in descs])
        self._local, self._peer, self._read, self._descs = local, peer, read, descs
        self._transfers: list[Any] = []

    def post(self) -> None:
        local, peer = self._local, self._peer
        for rank_descs in self._descs:
            rank = rank_descs.remote_rank
            try:
                transfer = local.agent.read(
                    peer.agents[rank], rank_descs.local, rank_descs.remote,
                    peer.done(local, self._read.lease_id, rank, ok=True),
                    local_is_cuda=local.is_cuda, remote_is_cuda=peer.remote_cuda[rank])
            except Exception as exc:
                raise ReadFailed(f"prefill {peer.engine_id} rank {rank} at {peer.address}: "
                                 f"READ could not be posted: {exc}", peer_gone=str(exc)) from exc
            self._transfers.append(transfer)
            self.num_bytes += rank_descs.num_bytes
            self.descriptors += len(rank_descs)

    def progress(self) -> Progress:
        remote = self._read.remote
        where = f"prefill {remote.remote_engine_id} at {remote.address}"
        try:
            landed = reads_landed(self._transfers)
        except TransferError as exc:
            raise ReadFailed(f"{where}: {exc}", peer_gone=str(exc)) from exc
        if landed:
            self.nixl_span = merge_spans(t.span for t in self._transfers)
            return LANDED
        return Waiting(f"READ still in progress after {TIMEOUT} s", peer=where)

    def finish(self) -> None:
        release_transfers(self._transfers, self._read.request_id)

    def abandon(self, reason: str) -> Stale | None:
        """Its READs still in flight stay open, as :class:`Stale`."""
        return abandon_transfers(self._transfers, self._read.request_id)
