"""``Ranks``: the transfer machinery of one process's TP ranks, built from one
:class:`~kvxfer.transfer.transfer_config.TransferConfig`.

A :class:`~kvxfer.transfer.worker.TransferWorker` per rank, all sharing the process's
:class:`~kvxfer.transfer.side_channel.reports.Reports` (every "done" report and release
goes out there), its :class:`~kvxfer.transfer.converted.process_shares.ProcessShares` and,
where the process reads, the heartbeats of the prefills it reads from; the side-channel
listener once :meth:`Ranks.serve` says what it answers. A sidecar makes one for all its
ranks, a vLLM worker process one for its own rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvxfer.transfer.converted.process_shares import ProcessShares
from kvxfer.transfer.lease_client import LeaseClient
from kvxfer.transfer.liveness import Liveness
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.heartbeats import Heartbeats
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.transfer.side_channel.reports import Reports
from kvxfer.transfer.side_channel.sender import SideChannelSender
from kvxfer.transfer.transfer_config import SIDECAR_LANES, TransferConfig
from kvxfer.transfer.worker import TransferWorker
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.lease_book import LeaseBook

if TYPE_CHECKING:
    import torch

    from kvxfer.plan.layout import CacheSpec, KVCacheLayout
    from kvxfer.transfer.leases import LeaseAnswers
    from kvxfer.transfer.results import Released, WorkerCounts
    from kvxfer.wire.messages import DoneReport, ReleaseOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answering:
    """Who answers the side channel's claims, renewals, releases and reports of the
    leases ``owns`` says are its own (listener thread: ``owns`` must be thread-safe)."""

    answers: LeaseAnswers
    owns: Callable[[str], bool] = lambda _lease_id: True


class Ranks:
    """One process's ranks ``ranks`` of ``tp_size`` (see the module docstring).
    ``reads``: the process reads KV (a decode): its ranks get read lanes and, unless
    ``config.kv_heartbeat_timeout`` is 0, heartbeats; ``lanes_default``: the process's
    copy threads when the config sets none."""

    def __init__(self, engine_id: str, compat: CompatInfo, config: TransferConfig, *,
                 ranks: Sequence[int], tp_size: int, total_kv_heads: int, reads: bool,
                 lanes_default: int | None = None) -> None:
        self.engine_id, self.compat, self.config = engine_id, compat, config
        self.reports = Reports(engine_id, compat, config.kv_key)
        self.heartbeats: Heartbeats | None = None
        self.listener: SideChannelListener | None = None
        self.workers: list[TransferWorker] = []
        self._answering: list[Answering] = []
        try:
            liveness = None
            if reads and config.kv_heartbeat_timeout:
                liveness = Liveness(config.kv_heartbeat_timeout)
                self.heartbeats = Heartbeats(liveness, engine_id, compat, config.kv_key)
            lanes = config.lanes_per_rank(len(ranks), lanes_default or SIDECAR_LANES) \
                if reads else 1  # a process that only serves reads would leave lanes idle
            shares = ProcessShares()  # the ranks run in this process: they share their reads
            for rank in ranks:
                self.workers.append(TransferWorker(
                    engine_id, rank, tp_size, compat, config, total_kv_heads=total_kv_heads,
                    read_lanes=lanes, shares=shares, reports=self.reports, liveness=liveness))
        except BaseException:
            self.stop()
            self.close()
            raise

    def register(self, index: int, caches: Mapping[str, torch.Tensor], spec: CacheSpec,
                 num_blocks: int, layout: KVCacheLayout | str | None = None) -> None:
        """Register the KV cache of ``self.workers[index]``'s rank (once each)."""
        self.workers[index].register_kv_caches(caches, spec, num_blocks, layout)

    def lease_client(self) -> LeaseClient:
        """A decode's client of the leases it reads: claims and renewals from a thread of
        its own (a claim must not wait behind messages to a dead prefill), releases
        through :attr:`reports`."""
        renewer = SideChannelSender(SideChannelClient(self.engine_id, self.compat,
                                                      hmac_key=self.config.kv_key,
                                                      keep_connections=True))
        return LeaseClient(LeaseBook(self.config.kv_key, max_age=self.config.max_age),
                           self.reports, renewer, read_timeout=self.config.kv_read_timeout)

    def serve(self, port: int, answering: Sequence[Answering],
              on_claimer: Callable[[str, tuple[str, int]], None] | None = None) -> int:
        """Start the side-channel listener on ``config.side_channel_host:port``: every
        rank's metadata, and the lease answers of ``answering`` (each lease to the first
        that owns it); ``on_claimer`` hears who claimed a reservation. Its port."""
        self._answering = list(answering)
        releases = any(a.answers.releasable for a in self._answering)
        self.listener = SideChannelListener(
            self.config.side_channel_host, port, engine_id=self.engine_id,
            compat=self.compat, metadata=lambda: [w.metadata() for w in self.workers],
            hmac_key=self.config.kv_key, on_request=self._connecting,
            on_release=self._on_release if releases else None,
            on_renew=self._on_renew if self._answering else None,
            on_done=self._on_done if self._answering else None,
            on_claimer=on_claimer).start()
        return self.listener.port

    @property
    def port(self) -> int | None:
        """The listener's port; None when it does not serve."""
        return None if self.listener is None else self.listener.port

    def lease_ends(self) -> Iterator[tuple[int, Released]]:
        """(rank index, lease end) for every lease any rank ended since the last call."""
        for index, worker in enumerate(self.workers):
            for item in worker.poll_released():
                yield index, item

    def take_counts(self) -> list[WorkerCounts]:
        return [worker.take_counts() for worker in self.workers]

    def stop(self) -> None:
        """Stop serving and transferring: the listener, the workers, the heartbeats
        (idempotent); :attr:`reports` still sends."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for worker in self.workers:
            worker.close()
        if self.heartbeats is not None:
            self.heartbeats.close()
            self.heartbeats = None

    def close(self) -> None:
        """After :meth:`stop` and whatever its owner still releases: send what is queued
        for about a second, then stop the senders (idempotent)."""
        self.reports.close()

    # -- the listener's thread ----------------------------------------------------------
    def _connecting(self, _requester: str) -> None:
        for worker in self.workers:
            worker.peer_connecting()

    def _owner(self, lease_id: str) -> LeaseAnswers:
        for answering in self._answering:
            if answering.owns(lease_id):
                return answering.answers
        return self._answering[0].answers  # nobody's: answered "not held" by any

    def _on_release(self, lease_id: str, requester: str, reason: str,
                    outcome: ReleaseOutcome) -> bool:
        return self._owner(lease_id).on_release(lease_id, requester, reason, outcome)

    def _on_renew(self, lease_id: str, requester: str, claim: bool) -> float:
        return self._owner(lease_id).on_renew(lease_id, requester, claim)

    def _on_done(self, report: DoneReport, requester: str) -> bool:
        return self._owner(report.done.request_id).on_done(report, requester)
