"""``TransferWorker``: one per TP rank; moves KV blocks with NIXL READs (and WRITEs).

The thin owner of one rank's thread and NIXL agent; reads, peers, leases, lanes and pushes
are the objects it hands that thread to. Contract, who calls what:

* both sides, once: ``register_kv_caches``, then ``metadata()`` for the instance's listener;
* decode: ``start_read`` queues a read (any thread, returns at once); ``poll()`` returns what
  ended; the caller sends ``PollResult.reports`` and releases ``PollResult.unnotified``;
* prefill: ``hold``, ``end_lease``, ``poll_released()``; lease ids are unique per lease, and
  the caller frees released blocks (the worker never does);
* push mode: ``start_push``, ``push_layers``, ``seal_push`` (prefill); a reservation is a
  ``hold`` with ``readers=None`` on the decode;
* ``take_counts()`` for metrics; ``peer_connecting()`` once the listener served a handshake.

Every NIXL call is made on the worker's thread (read lanes: their own agents and threads).
With ``hmac_key`` a "done" that does not verify is ignored.

Design: docs/design/transfer-worker.md#who-calls-what
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvxfer.plan.descriptors import SideGeometry
from kvxfer.plan.layout import CacheSpec, KVCacheLayout
from kvxfer.plan.regions import RegionPlan, distinct_views, plan_regions
from kvxfer.plan.staging import layer_groups
from kvxfer.transfer.converted.host_reads import Canary
from kvxfer.transfer.converted.mapped_reads import shared_offer
from kvxfer.transfer.converted.process_shares import ProcessShares
from kvxfer.transfer.converted.staging_pool import StagingPool
from kvxfer.transfer.lanes import Lanes
from kvxfer.transfer.leases import LeaseTable
from kvxfer.transfer.liveness import Liveness
from kvxfer.transfer.local_rank import Deadlines, LocalRank, memory_kind
from kvxfer.transfer.nixl_agent import NixlAgent
from kvxfer.transfer.peers import Peers
from kvxfer.transfer.pushes.pusher import Pusher
from kvxfer.transfer.pushes.targets import Targets
from kvxfer.transfer.reads.read import Read
from kvxfer.transfer.reads.reader import Reader
from kvxfer.transfer.results import PollResult, ReadResults, Released, Tally, WorkerCounts
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.reports import Reports
from kvxfer.transfer.transfer_config import HANDSHAKE_RETRIES, TransferConfig
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.metadata import AgentMetadata
from kvxfer.wire.notification import ReadDone
from kvxfer.wire.params import RemoteParams
from kvxfer.wire.reservations import Reservation

log = logging.getLogger(__name__)

IDLE_POLL_S = 1.0        # idle: whatever needs the thread (a lease, a read, a push, a
                         # handshake served) wakes it; each idle wake-up costs CPU
BUSY_POLL_S = 0.0005     # reads in flight or leases waiting for "done"
CONNECT_WINDOW_S = 3.0   # fast progress after serving a handshake


class TransferWorker:
    """See the module docstring for the contract."""

    def __init__(self, engine_id: str, rank: int, tp_size: int, compat: CompatInfo,
                 config: TransferConfig, *, total_kv_heads: int, read_lanes: int = 1,
                 shares: ProcessShares | None = None, reports: Reports | None = None,
                 liveness: Liveness | None = None) -> None:
        if read_lanes < 1:
            raise ValueError(f"read_lanes must be at least 1, got {read_lanes}")
        self.engine_id, self.rank, self.tp_size = engine_id, rank, tp_size
        self.compat, self.config = compat, config
        self.total_kv_heads = total_kv_heads
        self._deadlines = Deadlines(config.handshake_attempt_s, HANDSHAKE_RETRIES,
                                    config.kv_read_timeout, liveness)
        self.read_lanes = read_lanes  # this rank's share of the instance's copy threads
        # offer (prefill) and use (decode) host reads of converted reads on one host
        self.host_reads = config.host_reads
        self._key = config.kv_key  # signs and verifies "done" notifications
        self._shares = shares if shares is not None else ProcessShares()
        # "done" reports and releases: the instance's, else this rank's own
        self._own_reports = reports is None
        self._reports = reports if reports is not None else Reports(engine_id, compat,
                                                                    config.kv_key)
        self._client = SideChannelClient(engine_id, compat, hmac_key=self._key)
        self._agent = NixlAgent(f"{engine_id}-rank{rank}", config.nixl_backends)
        # converted reads land here; converted pushes take their shadows here
        self._staging = StagingPool(self._agent, f"r{rank}")
        self._tally = Tally()
        self._leases = LeaseTable(self._key, self._tally)
        self._results = ReadResults()
        # set at register_kv_caches
        self._plan: RegionPlan | None = None
        self._canary: Canary | None = None
        self._lanes: Lanes | None = None
        self._peers: Peers | None = None
        self._reads: Reader | None = None
        self._pusher: Pusher | None = None
        self._wake = threading.Event()
        self._fast_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-{engine_id}-r{rank}",
                                        daemon=True)
        self._thread.start()

    # a decode's deadlines (kvxfer.transfer.local_rank.Deadlines), settable at any time
    @property
    def handshake_timeout(self) -> float:
        return self._deadlines.handshake_timeout

    @handshake_timeout.setter
    def handshake_timeout(self, seconds: float) -> None:
        self._deadlines.handshake_timeout = seconds

    @property
    def handshake_retries(self) -> int:
        return self._deadlines.handshake_retries

    @handshake_retries.setter
    def handshake_retries(self, retries: int) -> None:
        self._deadlines.handshake_retries = retries

    @property
    def read_timeout(self) -> float:
        return self._deadlines.read_timeout

    @read_timeout.setter
    def read_timeout(self, seconds: float) -> None:
        self._deadlines.read_timeout = seconds

    @property
    def liveness(self) -> Liveness | None:
        """Heartbeats of the peers read from (None: a silent peer costs the read timeout)."""
        return self._deadlines.liveness

    @liveness.setter
    def liveness(self, liveness: Liveness | None) -> None:
        self._deadlines.liveness = liveness

    # -- both sides ---------------------------------------------------------------------
    def register_kv_caches(self, caches: Mapping[str, torch.Tensor], spec: CacheSpec,
                           num_blocks: int, layout: KVCacheLayout | str | None = None
                           ) -> RegionPlan:
        """Plan regions for this rank's views and register their memory (call once).

        ``spec`` and ``num_blocks`` are logical (what block ids count, here and on the
        wire); the views may be at a kernel block size dividing ``spec.block_size``
        (:func:`~kvxfer.plan.regions.plan_regions`)."""
        if self._plan is not None:
            raise RuntimeError(f"rank {self.rank} already registered its KV caches")
        plan = plan_regions(caches, spec, num_blocks, layout)
        is_cuda = memory_kind(plan.memory, f"rank {self.rank}'s KV cache")
        self._agent.register(plan.memory)
        if self.read_lanes > 1 and not is_cuda:
            self._lanes = Lanes(self._agent, self.read_lanes - 1, plan.memory, self.rank)
        if self.host_reads and not is_cuda:
            self._canary = Canary()
        local = LocalRank(self.engine_id, self.rank, self.tp_size, plan,
                          SideGeometry.from_plan(plan, self.compat.kv_packing),
                          layer_groups([view for _, view in distinct_views(caches)]), is_cuda,
                          self._agent, self._lanes, self._staging, self._shares, self._key,
                          self._wake, self._tally, self._deadlines)
        self._peers = Peers(local, self._client, total_kv_heads=self.total_kv_heads,
                            host_reads=self.host_reads)
        self._reads = Reader(local, self._peers, self._results, self._reports)
        self._pusher = Pusher(local, Targets(local, self._client,
                                             total_kv_heads=self.total_kv_heads),
                              self._leases, local.geometry.num_layers, self._reports)
        self._plan = plan
        return plan

    def metadata(self) -> AgentMetadata:
        """This rank's handshake answer: agent blob plus region geometry."""
        plan = self._require_plan()
        device = plan.memory[0].device_id if plan.memory else 0
        return AgentMetadata(engine_id=self.engine_id, tp_rank=self.rank, tp_size=self.tp_size,
                             agent_name=self._agent.name, agent_blob=self._agent.metadata(),
                             device_id=device, num_blocks=plan.num_blocks,
                             block_size=plan.block_size, layout=plan.layout, plan=plan,
                             backends=self._agent.backends, kv_packing=self.compat.kv_packing,
                             kernel_ratio=plan.kernel_ratio,
                             host_reads=shared_offer(self._canary, plan.memory)
                             if self._canary else None)

    def peer_connecting(self) -> None:
        """The listener served a handshake: progress fast while the peer connects."""
        self._fast_until = time.monotonic() + CONNECT_WINDOW_S
        self._wake.set()

    def close(self) -> None:
        """Stop the thread and release NIXL resources; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        if self._reads is not None and self._peers is not None:
            self._reads.close()
            self._peers.close()
        if self._pusher is not None:
            self._pusher.close()
        if self._lanes is not None:
            self._lanes.close()
        self._staging.close()
        self._agent.close()
        self._client.close()
        if self._own_reports:
            self._reports.close()

    # -- decode side --------------------------------------------------------------------
    def start_read(self, request_id: str, remote_params: Mapping[str, Any] | RemoteParams,
                   local_block_ids: Sequence[int], *, span_probe: bool = False,
                   lease_ends: float | None = None) -> None:
        """Queue a read of ``remote_params.remote_block_ids`` into ``local_block_ids``.

        Both lists count logical blocks (each side's ``spec.block_size``), whatever
        kernel block size either side's views have. ``span_probe``: a benchmark's probe, the
        same number of bytes as one READ of whole memory spans from the request's first
        block on each side, over whatever blocks follow (:mod:`kvxfer.plan.span_probe`).
        ``lease_ends`` (monotonic s): when the lease read would end anyway, until which an
        unanswered "done" report of the read is resent (None: the params' expiry).

        Malformed params raise ValueError here; everything that needs the peer
        (handshake, geometry, block-id ranges) is reported through ``poll()``.
        """
        remote = remote_params if isinstance(remote_params, RemoteParams) \
            else RemoteParams.parse(remote_params)
        self._require_plan()
        assert self._reads is not None
        ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
        now = time.monotonic()
        if lease_ends is None:
            lease_ends = now + (remote.lease_expires_at or 0.0) - time.time()
        self._reads.submit(Read(request_id, remote, ids, now, span_probe=span_probe,
                                lease_ends=lease_ends))

    def poll(self) -> PollResult:
        """Reads finished or failed since the last call (thread-safe)."""
        return self._results.take()

    def wait_for_results(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until some read finished or failed since the last
        :meth:`poll`; whether one did. For a caller with nothing better to do meanwhile:
        a thread that only polls in a loop takes CPU from the one copying."""
        return self._results.wait(timeout)

    def forget_peer(self, engine_id: str) -> None:
        """Drop a cached handshake or failure: the next read with that engine handshakes again."""
        if self._peers is not None:
            self._peers.forget(engine_id)

    # -- prefill side -------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: Sequence[int], readers: int | None = None,
             ttl: float = 60.0) -> None:
        """Lease ``block_ids`` until ``readers`` decode ranks said "done" or ``ttl`` seconds.

        With ``readers=None`` the count each reader announces in its notification is
        used (decode ranks know how many of them read from this prefill rank).
        """
        self._leases.hold(request_id, block_ids, readers, ttl)
        # Wake the thread now, not at the end of an idle wait: a READ that carries a "done"
        # notification completes only once this side's agent progresses (it takes the
        # notification), so up to IDLE_POLL_S of idle wait would add to every read.
        self._wake.set()

    def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
              max_age: float = math.inf) -> float:
        """Extend lease ``request_id`` for decode ``requester`` to ``ttl`` seconds from now,
        never past ``max_age`` seconds after :meth:`hold`, never shorter; the seconds it
        now has left; :class:`~kvxfer.wire.messages.RenewRefused` says why not. A claim
        (``claim``) is granted to the first engine that claims the lease (and again to
        it: a retried claim); a renewal only to its claimer. Thread-safe (the listener's
        thread calls it)."""
        return self._leases.renew(request_id, ttl, requester, claim=claim, max_age=max_age)

    def may_end(self, request_id: str, requester: str) -> bool:
        """Whether decode ``requester`` may release lease ``request_id``: nobody else
        claimed it (thread-safe)."""
        return self._leases.may_end(request_id, requester)

    def holds_lease(self, request_id: str) -> bool:
        """Whether lease ``request_id`` is held (thread-safe)."""
        return self._leases.holds(request_id)

    def lease_claimer(self, request_id: str) -> str | None:
        """The engine that claimed held lease ``request_id``, if any (thread-safe)."""
        return self._leases.claimer(request_id)

    def end_lease(self, request_id: str, reason: str = "abandoned", *,
                  claimers: tuple[str | None, ...] | None = None) -> bool:
        """End lease ``request_id`` now; ``poll_released()`` reports it with ``reason``.

        False when it is not held (ended already, or never existed), or (``claimers``
        given) when its claimer is none of them (None: unclaimed): nothing changes.
        Thread-safe; a "done" arriving later for it is ignored (counted late).
        """
        return self._leases.end(request_id, reason, claimers=claimers)

    def count_done(self, note: ReadDone, sender: str) -> bool:
        """Any thread: count a reader's "done" that came over the side channel (see
        :meth:`LeaseTable.count_done`)."""
        return self._leases.count_done(note, sender, report=True)

    def poll_released(self) -> list[Released]:
        """Leases that ended since the last call; their blocks may be freed now."""
        return self._leases.take_released()

    def start_push(self, lease_id: str, reservation: Reservation,
                   block_ids: Sequence[int], answers_at: tuple[str, int] = ("", 0)) -> None:
        """Lease this rank's logical ``block_ids`` (in token order) as ``lease_id`` and push
        them into a decode's ``reservation``: WRITEs of the layers handed with
        :meth:`push_layers`, the rest at :meth:`seal_push`, then a signed "done" to each
        decode rank; the push ends the lease "done", or "failed", and ``poll_released``
        reports it (:mod:`kvxfer.transfer.pushes.pusher` is the contract). ``answers_at``:
        this instance's side channel, named in its claim of the reservation. Returns at
        once; ValueError when ``lease_id`` holds a lease already."""
        self._require_pusher().start(lease_id, reservation,  # a copy: the caller may reuse it
                                     np.array(block_ids, dtype=np.int64).reshape(-1),
                                     answers_at)

    def push_layers(self, lease_id: str, layers: range) -> None:
        """The engine finished ``layers`` of lease ``lease_id``'s prompt: WRITE them now."""
        self._require_pusher().layers(lease_id, layers)

    def seal_push(self, lease_id: str, ok: bool = True) -> None:
        """Every layer of lease ``lease_id`` was handed (``ok``), or the request was given
        up: finish the push, or abort it and tell the decode."""
        self._require_pusher().seal(lease_id, ok)

    def take_counts(self) -> WorkerCounts:
        """Events since the last call, for metrics (thread-safe; see :class:`WorkerCounts`)."""
        return self._tally.take()

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    # -- the worker thread --------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            pushes = self._pusher.holding if self._pusher is not None else 0
            busy = (self._reads is not None and self._reads.busy) or \
                (self._pusher is not None and self._pusher.busy) or \
                time.monotonic() < self._fast_until or self._leases.awaited() > pushes
            self._wake.wait(BUSY_POLL_S if busy else IDLE_POLL_S)
            self._wake.clear()
            reads, pusher = self._reads, self._pusher  # None until register_kv_caches
            try:
                if reads is not None:
                    reads.step()
                if pusher is not None:
                    pusher.step()
            except Exception:  # the thread must survive anything; log loudly
                log.exception("rank %d transfer loop error", self.rank)
            try:
                self._leases.receive(self._agent.get_notifs())
                self._leases.expire()
            except Exception:  # the thread must survive anything; log loudly
                log.exception("rank %d transfer loop error", self.rank)

    def _require_pusher(self) -> Pusher:
        self._require_plan()
        assert self._pusher is not None
        return self._pusher

    def _require_plan(self) -> RegionPlan:
        if self._plan is None:
            raise RuntimeError(f"rank {self.rank}: call register_kv_caches() first")
        return self._plan
