"""``HostPath`` and ``MappedPath``: reads copied on this host, in the post.

For a prefill rank that is a process on this host and offers it: copied from its mapped cache
(:class:`MappedPath`) or with ``process_vm_readv`` (:class:`HostPath`, converted reads only).
Either copy ends within ``post``, on the rank's copy threads; the reader sends the "done". A
copy that fails because the prefill process is gone takes the peer for dead.

Design: docs/design/reads.md#host-and-mapped
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Generic, TypeVar

import numpy as np

from kvxfer.transfer.converted.host_reads import HostRead, HostReadError
from kvxfer.transfer.converted.mapped_reads import MappedRead, share_count
from kvxfer.transfer.local_rank import LocalRank
from kvxfer.transfer.peers import Peer
from kvxfer.transfer.reads.path import ReadFailed, ReadPath
from kvxfer.transfer.reads.read import Read
from kvxfer.transfer.results import ReadStats
from kvxfer.transfer.threads import run_pulled

R = TypeVar("R", HostRead, MappedRead)


class _CopyPath(ReadPath, Generic[R]):
    """``copies``: (the prefill rank's planned copy, local ids, remote ids) per rank."""

    lands_in_post = True

    def __init__(self, local: LocalRank, peer: Peer, read: Read,
                 copies: Sequence[tuple[R, np.ndarray, np.ndarray]]) -> None:
        super().__init__([runs.remote_rank for runs, _, _ in copies])
        self._local, self._peer, self._read = local, peer, read
        self._copies: Sequence[tuple[R, np.ndarray, np.ndarray]] = copies
        self.lanes = 1  # threads that copied
        self.members = 0  # in-process ranks that copied together (1: alone)

    def finish(self) -> None:
        """Nothing is held: the copies ended within :meth:`post`."""

    def add_to(self, stats: ReadStats) -> ReadStats:
        stats = super().add_to(stats)
        return replace(stats, lanes=max(stats.lanes, self.lanes),
                       members=max(stats.members, self.members),
                       host_ranks=stats.host_ranks + len(self.ranks))


class HostPath(_CopyPath[HostRead]):
    """Host reads, with the in-process siblings that read the same request."""

    name = "host"

    def post(self) -> None:
        local, peer = self._local, self._peer
        for runs, local_ids, remote_ids in self._copies:
            try:
                num_bytes, _, members = local.shares.copies.copy(
                    local.engine_id, peer.engine_id, self._read.lease_id, local.rank, runs,
                    local_ids, remote_ids, local.lanes.pool if local.lanes else None,
                    local.threads)
            except Exception as exc:  # HostReadError, or a bug: this request only
                gone = isinstance(exc, HostReadError) and exc.gone
                raise ReadFailed(f"prefill {peer.engine_id} rank {runs.remote_rank} at "
                                 f"{peer.address}: host read failed: {exc}",
                                 peer_gone=str(exc) if gone else None) from exc
            self.members = max(self.members, members)
            self.lanes = max(self.lanes, local.threads)
            self.num_bytes += num_bytes
            self.descriptors += len(local_ids) * runs.runs_per_block


class MappedPath(_CopyPath[MappedRead]):
    """Copies from the prefill's cache, mapped into this process: every prefill rank's
    blocks cut into shares (:func:`~kvxfer.transfer.converted.mapped_reads.share_count`
    per rank), all taken in turn by the rank's copy threads
    (:func:`~kvxfer.transfer.threads.run_pulled`), so that the prefill ranks of a TP split
    are copied at once and no thread waits at a rank's end for another."""

    name = "mapped"

    def post(self) -> None:
        local = self._local
        pool = local.lanes.pool if local.lanes else None
        threads = local.threads if pool else 1
        shares = [functools.partial(self._share, runs.remote_rank, share)
                  for runs, local_ids, remote_ids in self._copies
                  for share in runs.shares(local_ids, remote_ids, share_count(threads))]
        run_pulled(shares, pool, threads)
        self.num_bytes += sum(runs.placed(local_ids, remote_ids)
                              for runs, local_ids, remote_ids in self._copies)
        self.descriptors += min(threads, len(shares))
        self.members, self.lanes = 1, threads

    def _share(self, rank: int, share: Callable[[], None]) -> None:
        try:
            share()
        except Exception as exc:  # a bug: the mapping outlives the prefill process
            raise ReadFailed(f"prefill {self._peer.engine_id} rank {rank} at "
                             f"{self._peer.address}: copy from its mapped cache failed: "
                             f"{type(exc).__name__}: {exc}") from exc

    def add_to(self, stats: ReadStats) -> ReadStats:
        stats = super().add_to(stats)
        return replace(stats, mapped_ranks=stats.mapped_ranks + len(self.ranks))
