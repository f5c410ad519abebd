"""``TransferWorker``: one per TP rank; moves KV blocks with NIXL READs.

Contract (who calls what, when):

* Both sides, once at start-up: ``register_kv_caches(caches, spec, num_blocks)``
  plans regions and registers the cache memory with this rank's NIXL agent.
  ``metadata()`` then returns what the instance's handshake listener serves for
  this rank.
* Decode side, per request: ``start_read(request_id, remote_params,
  local_block_ids)`` queues a read and returns at once. The worker's own thread
  handshakes with the prefill engine if it has not yet (cached per remote
  engine), builds descriptors for this rank's share of heads, posts one READ per
  prefill rank it needs and, on success, each READ delivers a "done"
  notification to its prefill rank. ``poll()`` returns what finished or failed
  since the last call; a failed request carries a reason naming the peer. A
  failed read notifies the prefill ranks (``ok=False``) when a NIXL connection
  exists; when it does not (handshake failed, peer dead) or a notification could
  not be sent, the request is also listed in ``PollResult.unnotified``: the
  prefill still holds the lease, and the caller should release it over the side
  channel (``HandshakeClient.release``).
* Prefill side, per request: ``hold(request_id, block_ids, readers, ttl)``
  leases the blocks until every expected decode reader has notified "done", the
  caller ends it (``end_lease``, e.g. on a side-channel release) or the lease
  expires (``request_id`` is the lease id the decode echoes back: keep it unique
  per lease, so a late "done" can never end a newer lease); ``poll_released()``
  returns the leases that ended and why ("done", "abandoned", "expired").
  Prefill never frees blocks on its own: the caller frees them when released.
* Both sides, now and then: ``take_counts()`` returns the events since the last
  call that only metrics care about (:class:`WorkerCounts`): failed handshakes,
  "done" notifications not sent or not verified, and late ones (for a lease that
  had ended: the last ``ENDED_REMEMBERED`` ended leases are remembered for that).
* The instance calls ``peer_connecting()`` when its listener served a
  handshake, so that the agent is progressed quickly while the peer wires up
  its connection (a READ can stall if the target never progresses then).

All NIXL calls happen on the worker's thread, so the agent needs no locking.
The one exception is read lanes (``read_lanes > 1``, host memory only): with
NIXL's cma transport a READ copies inside the posting call, on one core, and
each descriptor costs a few microseconds, so one thread cannot move many small
descriptors at memory speed. A lane is an extra agent with the same memory
registered, connected to the same peers; a large request's descriptor lists are
split across the worker's agent and the lanes, each copied by its own thread
while the worker thread waits for all of them (so every agent is still used by
one thread at a time). "Done" is then sent only after every part has landed.
Where byte copies cannot place a prefill rank's heads, that rank is read through
staging (:mod:`kvxfer.plan.staging`, :mod:`kvxfer.transfer.converted.staging_pool`): its parts land
in registered host buffers, a converter thread places them into this rank's views, and
"done" follows once every part landed; such a read waits behind earlier ones for
staging space. Where the prefill rank is a process on this host and offers it, such a
rank is host-read instead (:mod:`kvxfer.transfer.converted.host_reads`): its bytes are copied
straight into their places on the worker thread, no staging, and "done" follows the copy. In-process
sibling ranks share such reads through the ProcessShares handed to each of them (``shares``;
a worker given none shares nothing). Each READ names both sides' memory kinds, as the
handshake sent them.
Everything a peer sends (metadata, block ids, notifications) is validated before
use; a bad value fails that request only. With ``hmac_key`` every "done"
notification is signed, and one that does not verify is ignored (logged, counted), so
nobody without the key can end a lease; leases are also claimed and ``renew``ed
from the listener's thread when a decode asks (one claimer per lease, at most
``max_age`` seconds in all).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvxfer.plan.descriptors import (
    PeerReadPlan,
    RankDescriptors,
    SideGeometry,
    build_requests_descriptors,
)
from kvxfer.plan.layout import CacheSpec, KVCacheLayout
from kvxfer.plan.regions import MemoryRegion, RegionPlan, distinct_views, plan_regions
from kvxfer.plan.staging import StagedRead, layer_groups, plan_reads
from kvxfer.plan.topology import notify_plan, read_plan
from kvxfer.transfer.converted.host_reads import (
    Canary,
    HostRead,
    HostReadError,
    check_offer,
    plan_host_read,
)
from kvxfer.transfer.converted.mapped_reads import MappedRead, map_prefill, shared_regions
from kvxfer.transfer.converted.process_shares import ProcessShares
from kvxfer.transfer.converted.shared_staging import StagedMeeting, Target
from kvxfer.transfer.converted.staging_pool import Placement, StagedJob, StagedPiece, StagingPool
from kvxfer.transfer.handshake import HandshakeClient, HandshakeError, failure_reason
from kvxfer.transfer.nixl_agent import DEFAULT_BACKENDS, NixlAgent
from kvxfer.transfer.threads import run_all
from kvxfer.wire.params import RemoteParams
from kvxfer.wire.protocol import (
    AgentMetadata,
    BadSignature,
    CompatInfo,
    ProtocolError,
    ReadDone,
    decode_notif,
    encode_notif,
)

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05       # idle: progress/expire 20 times a second (~0.1% of a core)
BUSY_POLL_S = 0.0005     # reads in flight or leases waiting for "done"
CONNECT_WINDOW_S = 3.0   # fast progress after serving a handshake
DEAD_PEER_S = 5.0         # after a failed handshake or READ, fail fast this long
LANE_MIN_DESCRIPTORS = 64  # smaller requests: one thread (lanes cost a thread hand-off)
LANE_POLL_S = 0.0002       # a lane waiting for a READ the transport did not finish at once
ENDED_REMEMBERED = 4096    # ended leases kept to tell a late "done" from a stray one


def memory_kind(memory: Sequence[MemoryRegion], whose: str) -> bool:
    """Whether ``memory`` is GPU memory (True) or host memory; a READ's descriptors on
    one side are all of one kind, so a cache mixing both is refused."""
    kinds = {m.is_cuda for m in memory}
    if len(kinds) != 1:
        raise TransferError(f"{whose} registers both host and GPU memory; one cache must be "
                            f"one kind" if kinds else f"{whose} registers no memory")
    return kinds.pop()


class TransferError(RuntimeError):
    """A read failed; the message names the peer and the reason."""


@dataclass(frozen=True)
class ReadStats:
    """What one finished read moved, for metrics and the demo."""

    num_bytes: int
    descriptors: int
    seconds: float
    lanes: int = 1  # agents (threads) that copied it; see read lanes in the module doc
    # prefill ranks read on this host (kvxfer.transfer.converted.host_reads) instead of staging
    host_ranks: int = 0
    # in-process decode ranks that shared its converted reads, host or staged (1: alone)
    members: int = 0
    mapped_ranks: int = 0  # of host_ranks, those read from their mapped cache (mapped_reads)
    staged_ranks: int = 0  # prefill ranks read through staging (kvxfer.plan.staging)


@dataclass
class PollResult:
    """Reads that ended since the last :meth:`TransferWorker.poll`.

    ``unnotified`` holds the requests, failed or finished, whose prefill ranks
    were not all told by a NIXL notification.
    """

    finished: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stats: dict[str, ReadStats] = field(default_factory=dict)
    unnotified: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished or self.failed)


@dataclass
class WorkerCounts:
    """Events since the last :meth:`TransferWorker.take_counts`, by reason (the labels of
    the sidecar's metrics, :mod:`kvxfer.sidecar.metrics`), one per handshake or notification."""

    # decode: a handshake (after its retries) or the NIXL connection after it failed:
    # handshake.failure_reason's words, "mismatch" for a peer this rank cannot read, "connect"
    handshake_failures: Counter[str] = field(default_factory=Counter)
    # "unsent" (decode: NIXL refused to send it), "bad_signature" or "malformed" (prefill:
    # ignored, it did not verify or decode)
    notifications_failed: Counter[str] = field(default_factory=Counter)
    # prefill: a verified "done" for a lease not held, by how that lease had ended
    # ("done", "abandoned", "expired"), "unknown" when not remembered (or never held)
    notifications_late: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Released:
    request_id: str
    # "done" (every reader notified), "abandoned" (end_lease: the decode will not read)
    # or "expired" (the lease ran out)
    reason: str


@dataclass
class _Peer:
    """A handshaken prefill engine as seen by this decode rank."""

    engine_id: str
    address: str
    tp_size: int
    agents: dict[int, str]
    plans: list[PeerReadPlan | StagedRead]
    expected_readers: dict[int, int]
    remote_cuda: dict[int, bool] = field(default_factory=dict)  # each rank's memory kind
    # ranks host-read or read from their mapped cache, not staged
    host: dict[int, HostRead | MappedRead] = field(default_factory=dict)
    shared: set[int] = field(default_factory=set)  # staged ranks read with sibling ranks

    def staged(self) -> list[StagedRead]:
        """The converted reads that go through staging (not host-read)."""
        return [p for p in self.plans if isinstance(p, StagedRead)
                and p.remote_rank not in self.host]


@dataclass(frozen=True)
class _Handshake:
    """A peer's checked metadata and precomputed read plans, before NIXL connects."""

    metas: dict[int, AgentMetadata]
    plans: list[PeerReadPlan | StagedRead]
    notify: dict[int, int]
    host: dict[int, HostRead | MappedRead]


@dataclass
class _Read:
    request_id: str
    remote: RemoteParams
    local_block_ids: np.ndarray
    started: float
    transfers: list[Any] = field(default_factory=list)
    num_bytes: int = 0
    descriptors: int = 0
    lanes: int = 1
    unnotified: bool = False  # read, but some "done" could not be sent
    posted: float | None = None  # when its READs were posted (after any staging wait)
    staged: StagedJob = field(default_factory=StagedJob)  # a converted read's parts
    host: list[tuple[HostRead | MappedRead, np.ndarray, np.ndarray]] = \
        field(default_factory=list)
    mapped_ranks: int = 0  # of host_ranks, those read from the prefill's mapped cache
    host_ranks: set[int] = field(default_factory=set)  # host-read (told after the copy)
    members: int = 0  # in-process ranks that shared its converted reads (siblings)
    # a staged read shared with sibling ranks: this rank's pieces (its shares, kept while
    # it waits for staging) and the meetings, each settled once every member's share ended
    pieces: list[StagedPiece] | None = None
    meetings: list[StagedMeeting] = field(default_factory=list)
    shares_ended: bool = False
    staged_ranks: int = 0  # prefill ranks read through staging


@dataclass
class _Lease:
    block_ids: tuple[int, ...]
    readers: int | None
    expires: float
    done_by: set[tuple[str, int]] = field(default_factory=set)
    held_at: float = field(default_factory=time.monotonic)  # the maximum age counts from here
    claimer: str | None = None  # the decode engine that claimed it (see renew)


class TransferWorker:
    """See the module docstring for the contract."""

    def __init__(self, engine_id: str, rank: int, tp_size: int, compat: CompatInfo, *,
                 total_kv_heads: int, handshake_timeout: float = 5.0,
                 handshake_retries: int = 2, read_timeout: float = 30.0,
                 hmac_key: bytes | None = None, read_lanes: int = 1,
                 nixl_backends: Sequence[str] = DEFAULT_BACKENDS,
                 host_reads: bool = True, shares: ProcessShares | None = None) -> None:
        if read_lanes < 1:
            raise ValueError(f"read_lanes must be at least 1, got {read_lanes}")
        self.engine_id, self.rank, self.tp_size = engine_id, rank, tp_size
        self.compat = compat
        self.total_kv_heads = total_kv_heads
        self.handshake_timeout, self.handshake_retries = handshake_timeout, handshake_retries
        self.read_timeout = read_timeout
        self._key = hmac_key  # signs and verifies "done" notifications
        # what this rank shares with its in-process siblings (given none: nothing)
        self._shares = shares if shares is not None else ProcessShares()
        self._client = HandshakeClient(engine_id, compat, hmac_key=hmac_key)
        self._agent = NixlAgent(f"{engine_id}-rank{rank}", nixl_backends)
        self.read_lanes = read_lanes
        # offer (prefill) and use (decode) host reads of converted reads on one host
        self.host_reads = host_reads
        self._canary: Canary | None = None
        self._lanes: list[NixlAgent] = []   # extra agents; see the module docstring
        self._lane_pool: ThreadPoolExecutor | None = None
        self._plan: RegionPlan | None = None
        self._geometry: SideGeometry | None = None
        # where converted reads land: the views by logical layer, as layer groups
        self._view_groups: list[tuple[int, torch.Tensor]] = []
        self._local_cuda = False  # the memory kind of the registered cache
        self._staging = StagingPool(self._agent, f"r{rank}")  # converted reads land here
        self._staging_wait: list[tuple[_Read, _Peer]] = []  # converted reads short of staging
        self._peers: dict[str, _Peer] = {}
        self._jobs: queue.Queue[_Read] = queue.Queue()
        self._inflight: list[_Read] = []
        self._results = PollResult()
        self._results_ready = threading.Event()  # set when a read finished or failed
        self._leases: dict[str, _Lease] = {}
        self._handshaking: dict[str, list[_Read]] = {}
        self._handshakes: queue.Queue[tuple[RemoteParams, _Handshake | str]] = queue.Queue()
        self._dead: dict[str, tuple[float, str]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2,
                                        thread_name_prefix=f"kvxfer-handshake-r{rank}")
        self._wake = threading.Event()
        self._forget: set[str] = set()
        self._released: list[Released] = []
        self._ended: dict[str, str] = {}  # lease id -> reason, the last ENDED_REMEMBERED
        self._counts = WorkerCounts()
        self._lock = threading.Lock()
        self._fast_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-{engine_id}-r{rank}",
                                        daemon=True)
        self._thread.start()

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
        self._local_cuda = memory_kind(plan.memory, f"rank {self.rank}'s KV cache")
        self._agent.register(plan.memory)
        if self.read_lanes > 1 and not any(m.is_cuda for m in plan.memory):
            for lane in range(1, self.read_lanes):
                agent = NixlAgent(f"{self._agent.name}-lane{lane}", self._agent.backends)
                self._lanes.append(agent)
                agent.register(plan.memory)
            self._lane_pool = ThreadPoolExecutor(max_workers=len(self._lanes),
                                                 thread_name_prefix=f"kvxfer-lane-r{self.rank}")
        self._plan, self._geometry = plan, SideGeometry.from_plan(plan, self.compat.kv_packing)
        if self.host_reads and not self._local_cuda:
            self._canary = Canary()
        self._view_groups = layer_groups([view for _, view in distinct_views(caches)])
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
                             host_reads=self._canary.offer(shared_regions(plan.memory))
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
        for engine_id in list(self._peers):
            self._shares.leave(self.engine_id, engine_id, self.rank)
        for job in [*self._inflight, *(job for job, _ in self._staging_wait)]:
            for meeting in job.meetings:  # siblings stop waiting and writing here
                meeting.end_share(self.rank, f"decode rank {self.rank} is closing")
                meeting.close(self.rank)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._lane_pool is not None:
            self._lane_pool.shutdown(wait=True)
        self._staging.close()
        for agent in self._lanes:
            agent.close()
        self._agent.close()
        self._client.close()

    # -- decode side --------------------------------------------------------------------
    def start_read(self, request_id: str, remote_params: Mapping[str, Any] | RemoteParams,
                   local_block_ids: Sequence[int]) -> None:
        """Queue a read of ``remote_params.remote_block_ids`` into ``local_block_ids``.

        Both lists count logical blocks (each side's ``spec.block_size``), whatever
        kernel block size either side's views have.

        Malformed params raise ValueError here; everything that needs the peer
        (handshake, geometry, block-id ranges) is reported through ``poll()``.
        """
        remote = remote_params if isinstance(remote_params, RemoteParams) \
            else RemoteParams.parse(remote_params)
        self._require_plan()
        ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
        self._jobs.put(_Read(request_id, remote, ids, time.monotonic()))
        self._wake.set()

    def poll(self) -> PollResult:
        """Reads finished or failed since the last call (thread-safe)."""
        with self._lock:
            out, self._results = self._results, PollResult()
            self._results_ready.clear()
        return out

    def wait_for_results(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until some read finished or failed since the last
        :meth:`poll`; whether one did. For a caller with nothing better to do meanwhile:
        a thread that only polls in a loop takes CPU from the one copying."""
        return self._results_ready.wait(timeout)

    def forget_peer(self, engine_id: str) -> None:
        """Drop a cached handshake or failure: the next read with that engine handshakes again."""
        with self._lock:
            self._forget.add(engine_id)

    # -- prefill side -------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: Sequence[int], readers: int | None = None,
             ttl: float = 60.0) -> None:
        """Lease ``block_ids`` until ``readers`` decode ranks said "done" or ``ttl`` seconds.

        With ``readers=None`` the count each reader announces in its notification is
        used (decode ranks know how many of them read from this prefill rank).
        """
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        if readers is not None and readers <= 0:
            raise ValueError(f"readers must be positive, got {readers}")
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            self._leases[request_id] = _Lease(tuple(block_ids), readers, time.monotonic() + ttl)
        # Wake the thread now, not at the end of an idle wait: a READ that carries a "done"
        # notification completes only once this side's agent progresses (it takes the
        # notification), so up to IDLE_POLL_S of idle wait would add to every read.
        self._wake.set()

    def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
              max_age: float = math.inf) -> float | str:
        """Extend lease ``request_id`` for decode ``requester`` to ``ttl`` seconds from now,
        never past ``max_age`` seconds after :meth:`hold`, never shorter; the seconds it
        now has left, or why not (a str). A claim (``claim``) is granted to the first
        engine that claims the lease (and again to it: a retried claim); a renewal only
        to its claimer. Thread-safe (the listener's thread calls it)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return "the prefill no longer holds it (it ended, or was never handed out)"
            if claim and lease.claimer is None:
                lease.claimer = requester
            if lease.claimer != requester:
                return ("another decode claimed it first: a lease is read by one decode"
                        if lease.claimer is not None else "it was renewed before it was claimed")
            now = time.monotonic()
            end = lease.held_at + max_age
            if now >= end:
                return f"it reached the maximum lease age of {max_age:g} s"
            lease.expires = max(lease.expires, min(now + ttl, end))
            return lease.expires - now

    def may_end(self, request_id: str, requester: str) -> bool:
        """Whether decode ``requester`` may release lease ``request_id``: nobody else
        claimed it (thread-safe)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is None or lease.claimer in (None, requester)

    def holds_lease(self, request_id: str) -> bool:
        """Whether lease ``request_id`` is held (thread-safe)."""
        with self._lock:
            return request_id in self._leases

    def end_lease(self, request_id: str, reason: str = "abandoned") -> bool:
        """End lease ``request_id`` now; ``poll_released()`` reports it with ``reason``.

        False when it is not held (ended already, or never existed): nothing
        changes. Thread-safe; a "done" arriving later for it is ignored (counted late).
        """
        with self._lock:
            if request_id not in self._leases:
                return False
            self._end(request_id, reason)
        return True

    def poll_released(self) -> list[Released]:
        """Leases that ended since the last call; their blocks may be freed now."""
        with self._lock:
            out, self._released = self._released, []
        return out

    def take_counts(self) -> WorkerCounts:
        """Events since the last call, for metrics (thread-safe; see :class:`WorkerCounts`)."""
        with self._lock:
            out, self._counts = self._counts, WorkerCounts()
        return out

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    # -- the worker thread --------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = bool(self._inflight) or time.monotonic() < self._fast_until
            with self._lock:
                busy = busy or bool(self._leases)
            self._wake.wait(BUSY_POLL_S if busy else IDLE_POLL_S)
            self._wake.clear()
            with self._lock:
                forget, self._forget = self._forget, set()
            try:
                for engine_id in forget:
                    self._drop_peer(engine_id)
                    self._dead.pop(engine_id, None)
                self._finish_handshakes()
                if self._staging_wait:
                    self._retry_staged()
                while True:
                    try:
                        self._begin(self._jobs.get_nowait())
                    except queue.Empty:
                        break
                self._check_inflight()
                self._handle_notifs()
                self._expire_leases()
            except Exception:  # the thread must survive anything; log loudly
                log.exception("rank %d transfer loop error", self.rank)

    def _begin(self, job: _Read) -> None:
        """Route a new read: post it, park it behind a running handshake, or start one."""
        engine = job.remote.remote_engine_id
        peer = self._peers.get(engine)
        if peer is not None:
            self._post(job, peer)
            return
        dead = self._dead.get(engine)
        if dead is not None and time.monotonic() < dead[0]:
            self._fail(job, f"prefill {engine} at {job.remote.address}: {dead[1]} "
                            f"(failed moments ago; not retried yet)", notify=False)
            return
        waiting = self._handshaking.get(engine)
        if waiting is not None:
            waiting.append(job)
            return
        self._handshaking[engine] = [job]
        self._pool.submit(self._handshake, job.remote)

    def _handshake(self, remote: RemoteParams) -> None:
        """Pool thread: fetch and check the peer's metadata; no NIXL calls here."""
        reason = ""
        try:
            result: _Handshake | str = self._fetch_peer(remote)
        except HandshakeError as exc:
            result, reason = str(exc), failure_reason(exc)
        except (TransferError, ValueError) as exc:  # answered, but not a peer we can read
            result, reason = str(exc), "mismatch"
        except Exception as exc:  # unexpected: still answer the waiting reads
            log.exception("handshake with %s failed unexpectedly", remote.address)
            result, reason = f"{type(exc).__name__}: {exc}", "error"
        if reason:
            with self._lock:
                self._counts.handshake_failures[reason] += 1
        self._handshakes.put((remote, result))
        self._wake.set()

    def _finish_handshakes(self) -> None:
        """Worker thread: connect NIXL to handshaken peers, then post their parked reads."""
        while True:
            try:
                remote, result = self._handshakes.get_nowait()
            except queue.Empty:
                return
            jobs = self._handshaking.pop(remote.remote_engine_id, [])
            if isinstance(result, _Handshake):
                try:
                    peer = self._connect(remote, result)
                except TransferError as exc:
                    result = str(exc)
                    with self._lock:
                        self._counts.handshake_failures["connect"] += 1
            if isinstance(result, str):
                self._dead[remote.remote_engine_id] = (time.monotonic() + DEAD_PEER_S, result)
                for job in jobs:
                    self._fail(job, f"prefill {remote.remote_engine_id} at {remote.address}: "
                                    f"{result}", notify=False)
                continue
            for job in jobs:
                self._post(job, peer)

    def _post(self, job: _Read, peer: _Peer, *, retried: bool = False) -> None:
        """Build this request's descriptors and post one READ per prefill rank. A
        converted read queues behind those already waiting for staging (first come, first
        served), unless it is one of them (``retried``)."""
        if self._staging_wait and not retried and peer.staged():
            self._staging_wait.append((job, peer))
            return
        try:
            if peer.tp_size != job.remote.tp_size:
                raise TransferError(f"engine reports TP {peer.tp_size} but kv_transfer_params "
                                    f"say tp_size={job.remote.tp_size}")
            # the ids were counted at this size: a cache of another one would be misread
            for plan in peer.plans[:1]:
                said, cache = job.remote.remote_block_size, plan.remote.block_size
                if (said or plan.local.block_size) != cache:
                    raise TransferError(
                        f"its cache has {cache}-token blocks but kv_transfer_params "
                        + (f"say remote_block_size={said}" if said else
                           f"do not say remote_block_size, so the ids were counted at this "
                           f"decode's {plan.local.block_size}"))
            descs = self._descriptors(job, peer)
        except Exception as exc:  # bad params or plans, or NIXL refusing a staging buffer
            self._fail(job, f"prefill {peer.engine_id} at {peer.address}: {exc}", notify=True)
            return
        if descs is None:  # a converted read waits for staging space (see _retry_staged)
            self._staging_wait.append((job, peer))
            return
        job.posted = time.monotonic()  # the READ timeout counts from here
        if not self._host_copy(job, peer):
            return
        if self._lanes and not job.staged.parts and \
                sum(len(d) for d in descs) >= LANE_MIN_DESCRIPTORS:
            self._read_in_lanes(job, peer, descs)
            return
        if not self._post_parts(job, peer):
            return
        for rank_descs in descs:
            note = ReadDone(request_id=job.remote.remote_request_id,
                            reader_engine_id=self.engine_id, reader_rank=self.rank,
                            expected_readers=peer.expected_readers[rank_descs.remote_rank],
                            ok=True)
            try:
                transfer = self._agent.read(
                    peer.agents[rank_descs.remote_rank], rank_descs.local, rank_descs.remote,
                    encode_notif(note, self._key), local_is_cuda=self._local_cuda,
                    remote_is_cuda=peer.remote_cuda[rank_descs.remote_rank])
            except Exception as exc:
                self._fail(job, f"prefill {peer.engine_id} rank {rank_descs.remote_rank} at "
                                f"{peer.address}: READ could not be posted: {exc}", notify=True)
                self._forget_dead(peer, str(exc))
                return
            job.transfers.append(transfer)
            job.num_bytes += rank_descs.num_bytes
            job.descriptors += len(rank_descs)
        self._inflight.append(job)

    def _descriptors(self, job: _Read, peer: _Peer) -> list[RankDescriptors] | None:
        """The request's direct descriptors toward every planned prefill rank, its
        converted reads cut into ``job.staged``; None when a converted read cannot get
        its staging buffers yet (nothing is taken then)."""
        direct = [p for p in peer.plans if isinstance(p, PeerReadPlan)]
        descs = build_requests_descriptors(direct, job.local_block_ids,
                                           job.remote.remote_block_ids) if direct else []
        converted = [(plan, *plan.ids(job.local_block_ids, job.remote.remote_block_ids))
                     for plan in peer.plans if isinstance(plan, StagedRead)]
        job.host = [(peer.host[plan.remote_rank], local, remote)
                    for plan, local, remote in converted if plan.remote_rank in peer.host]
        staged = [read for read in converted if read[0].remote_rank not in peer.host]
        job.staged_ranks = len(staged)
        if not staged:
            return descs
        if job.pieces is None:  # once: a read that waits for staging keeps its shares
            job.pieces = [piece for read in staged for piece in self._pieces(job, peer, *read)]
        taken = self._staging.take(job.pieces)
        if taken is None:
            return None
        job.staged = taken  # from here on _fail gives the buffers back
        return descs

    def _pieces(self, job: _Read, peer: _Peer, plan: StagedRead, local: np.ndarray,
                remote: np.ndarray) -> list[StagedPiece]:
        """What this rank READs of one staged prefill rank and where it places it: all of
        it into its own views, or, shared with its in-process siblings
        (:mod:`kvxfer.transfer.converted.shared_staging`), its share into every member's views."""
        alone = [StagedPiece(plan, local, remote, (Placement(plan, self._view_groups),))]
        if plan.remote_rank not in peer.shared:
            return alone
        meeting = self._shares.staging.join(self.engine_id, peer.engine_id,
                                      job.remote.remote_request_id,
                                      Target(self.rank, plan, self._view_groups, self._wake),
                                      local, remote)
        if meeting is None:
            return alone
        job.meetings.append(meeting)
        job.members = max(job.members, len(meeting.targets))
        placements = tuple(Placement(t.plan, t.groups, None if t.rank == self.rank else
                                     functools.partial(meeting.writing, t.rank))
                           for t in meeting.targets.values())
        lshare, rshare = meeting.shares[self.rank]
        return [StagedPiece(plan, local[lshare], remote[rshare], placements)] \
            if rshare.stop > rshare.start else []

    def _host_copy(self, job: _Read, peer: _Peer) -> bool:
        """Copy the request's host-read ranks (each copy ends within the call); False
        when one failed (the job failed)."""
        threads = 1 + len(self._lanes)
        for runs, local_ids, remote_ids in job.host:
            try:
                if isinstance(runs, HostRead):  # with its in-process siblings, where they come
                    num_bytes, _, members = self._shares.copies.copy(
                        self.engine_id, peer.engine_id, job.remote.remote_request_id,
                        self.rank, runs, local_ids, remote_ids, self._lane_pool, threads)
                    copies = len(local_ids) * runs.runs_per_block
                else:
                    num_bytes, copies = runs.copy(local_ids, remote_ids, self._lane_pool,
                                                  threads)
                    members = 1
                    job.mapped_ranks += 1
            except Exception as exc:  # HostReadError, or a bug: this request only
                self._fail(job, f"prefill {peer.engine_id} rank {runs.remote_rank} at "
                                f"{peer.address}: host read failed: {exc}", notify=True)
                if isinstance(exc, HostReadError) and exc.gone:
                    self._forget_dead(peer, str(exc))
                return False
            job.host_ranks.add(runs.remote_rank)
            job.members = max(job.members, members)
            job.lanes = max(job.lanes, threads)
            job.num_bytes += num_bytes
            job.descriptors += copies
        return True

    def _post_parts(self, job: _Read, peer: _Peer) -> bool:
        """Post a converted read's parts one after the other, each placed as soon as it
        landed (a READ over cma copies inside the post: the next one then copies while
        the converter places this one). False when a post failed (the job failed)."""
        for part in job.staged.parts:
            try:
                part.transfer = self._agent.read(  # into host staging
                    peer.agents[part.plan.remote_rank], part.descs.local, part.descs.remote,
                    local_is_cuda=False, remote_is_cuda=peer.remote_cuda[part.plan.remote_rank])
            except Exception as exc:
                self._fail(job, f"prefill {peer.engine_id} rank {part.plan.remote_rank} at "
                                f"{peer.address}: READ could not be posted: {exc}", notify=True)
                self._forget_dead(peer, str(exc))
                return False
            job.transfers.append(part.transfer)
            job.num_bytes += part.descs.num_bytes
            job.descriptors += len(part.descs)
            self._staging.place_landed(job.staged)
        return True

    def _retry_staged(self) -> None:
        """Post converted reads that waited for staging, oldest first; fail those that
        waited past the read timeout."""
        waiting, self._staging_wait = self._staging_wait, []
        now = time.monotonic()
        for job, peer in waiting:
            if now - job.started > self.read_timeout:
                self._fail(job, f"prefill {peer.engine_id} at {peer.address}: no staging space "
                                f"for the converted read within {self.read_timeout:.0f} s",
                           notify=True)
            elif self._peers.get(peer.engine_id) is not peer:
                self._fail(job, f"prefill {peer.engine_id} at {peer.address}: the connection "
                                f"ended while the read waited for staging space", notify=False)
            else:
                self._post(job, peer, retried=True)

    def _read_in_lanes(self, job: _Read, peer: _Peer, descs: Sequence[Any]) -> None:
        """Copy this request with every agent at once; return when all parts ended.

        Each prefill rank's list is cut into one contiguous part per agent; part
        ``i`` of all lists goes to agent ``i``. The worker thread copies its own
        share, the lane threads theirs. Only after every part landed are the "done"
        notifications sent, so a prefill never frees blocks still being read.
        """
        agents = [self._agent, *self._lanes]
        parts: list[list[tuple[str, Any, Any, bool]]] = [[] for _ in agents]
        for rank_descs in descs:
            name = peer.agents[rank_descs.remote_rank]
            bounds = np.linspace(0, len(rank_descs), len(agents) + 1).astype(int)
            for lane, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                if hi > lo:
                    parts[lane].append((name, rank_descs.local[lo:hi], rank_descs.remote[lo:hi],
                                        peer.remote_cuda[rank_descs.remote_rank]))
            job.num_bytes += rank_descs.num_bytes
            job.descriptors += len(rank_descs)
        assert self._lane_pool is not None
        job.lanes = sum(1 for part in parts if part)
        try:
            run_all([functools.partial(self._copy_parts, agent, part)
                     for agent, part in zip(agents, parts, strict=True)], self._lane_pool)
        except Exception as exc:
            self._fail(job, f"prefill {peer.engine_id} at {peer.address}: READ failed: "
                            f"{exc}", notify=True)
            self._forget_dead(peer, str(exc))
            return
        if not self._notify(job, [d.remote_rank for d in descs], ok=True):
            log.warning("request %s was read, but not every prefill rank could be told",
                        job.request_id)
            job.unnotified = True
        self._inflight.append(job)  # no transfers left: finished on the next check

    def _copy_parts(self, agent: NixlAgent, parts: Sequence[tuple[str, Any, Any, bool]]
                    ) -> None:
        """Lane (or worker) thread: READ each part with ``agent`` and wait until it landed."""
        deadline = time.monotonic() + self.read_timeout
        for remote, local, remote_descs, remote_cuda in parts:
            transfer = agent.read(remote, local, remote_descs, local_is_cuda=self._local_cuda,
                                  remote_is_cuda=remote_cuda)
            try:
                while transfer.state() != "DONE":
                    if time.monotonic() > deadline:
                        raise TransferError(f"READ still in progress after "
                                            f"{self.read_timeout:.0f} s")
                    time.sleep(LANE_POLL_S)
            finally:
                transfer.release()

    def _notify(self, job: _Read, ranks: Sequence[int], ok: bool) -> bool:
        """Send "done" to prefill ranks this rank did not READ from (or all, on failure).

        True when every notification was handed to NIXL."""
        peer = self._peers.get(job.remote.remote_engine_id)
        if peer is None:
            self._count_unsent(len(ranks))
            return False
        sent = True
        for rank in ranks:
            note = ReadDone(job.remote.remote_request_id, self.engine_id, self.rank,
                            peer.expected_readers[rank], ok=ok)
            try:
                self._agent.send_notif(peer.agents[rank], encode_notif(note, self._key))
            except Exception as exc:
                sent = False
                self._count_unsent(1)
                log.info("could not notify prefill %s rank %d: %s", peer.engine_id, rank, exc)
        return sent

    def _count_unsent(self, notifications: int) -> None:
        with self._lock:
            self._counts.notifications_failed["unsent"] += notifications

    def _check_inflight(self) -> None:
        now = time.monotonic()
        for job in list(self._inflight):
            states = []
            for transfer in job.transfers:
                try:
                    states.append(transfer.state())
                except Exception as exc:
                    states.append(f"ERR: {exc}")
            placed = self._staging.place_landed(job.staged)
            if all(s == "DONE" for s in states) and placed is not False:
                if placed is True and not job.shares_ended:  # this rank's parts are placed
                    job.shares_ended = True
                    # every READ landed: its staging goes back now, not after the siblings
                    self._staging.settle(job.staged, job.remote.remote_engine_id)
                    for meeting in job.meetings:
                        meeting.end_share(self.rank)
                if placed is True and not all(m.settled for m in job.meetings):
                    if now - (job.posted or job.started) > self.read_timeout:
                        self._inflight.remove(job)
                        self._fail(job, f"prefill {job.remote.remote_engine_id}: a sibling "
                                        f"decode rank's share of the read did not end within "
                                        f"{self.read_timeout:.0f} s", notify=True)
                    continue  # a sibling's share is still read or placed
                self._inflight.remove(job)
                self._finish(job, placed, now)
            elif all(s == "DONE" for s in states) and \
                    now - (job.posted or job.started) > self.read_timeout:
                # every byte landed, the placing copy is slow: not the prefill's fault
                self._inflight.remove(job)
                self._fail(job, f"placing the read from prefill {job.remote.remote_engine_id} "
                                f"took longer than {self.read_timeout:.0f} s", notify=True)
            elif any(s.startswith("ERR") for s in states) or \
                    now - (job.posted or job.started) > self.read_timeout:
                reason = next((s for s in states if s.startswith("ERR")),
                              f"READ still in progress after {self.read_timeout:.0f} s")
                self._inflight.remove(job)
                self._fail(job, f"prefill {job.remote.remote_engine_id} at "
                                f"{job.remote.address}: {reason}", notify=True)
                peer = self._peers.get(job.remote.remote_engine_id)
                if peer is not None:
                    self._forget_dead(peer, reason)

    def _finish(self, job: _Read, placed: bool | str, now: float) -> None:
        """A read whose READs all landed and whose parts were placed (``placed`` True), or
        whose placing failed (why): report it, and tell the prefill ranks not told yet."""
        self._release_transfers(job)
        engine = job.remote.remote_engine_id
        failed = next((m.error for m in job.meetings if m.error is not None), None)
        if placed is not True or failed is not None:
            self._fail(job, f"placing the read from prefill {engine} failed: {placed}"
                       if placed is not True else f"prefill {engine}: a sibling decode rank's "
                       f"share of the read failed: {failed}", notify=True)
            return
        self._staging.settle(job.staged, engine)
        peer = self._peers.get(engine)
        if peer is not None:  # ranks nobody reads still hold the blocks, and ranks read
            # through staging or host reads were not told with a READ: release them
            read = {p.remote_rank for p in peer.plans if isinstance(p, PeerReadPlan)}
            if not self._notify(job, [r for r in peer.agents if r not in read], ok=True):
                job.unnotified = True
        elif job.host or job.staged_ranks:  # nobody to tell: the connector releases over
            # the side channel
            job.unnotified = True
        with self._lock:
            self._results.finished.append(job.request_id)
            if job.unnotified:
                self._results.unnotified.add(job.request_id)
            self._results.stats[job.request_id] = ReadStats(
                job.num_bytes, job.descriptors, now - job.started, job.lanes,
                len(job.host_ranks), job.members, job.mapped_ranks, job.staged_ranks)
        self._results_ready.set()

    def _release_transfers(self, job: _Read) -> None:
        for transfer in job.transfers:
            try:
                transfer.release()
            except Exception as exc:
                log.warning("releasing a transfer of %s failed: %s", job.request_id, exc)
        job.transfers.clear()

    def _fail(self, job: _Read, reason: str, notify: bool) -> None:
        """Fail one request; tell the prefill ranks we will not read so they free early.

        Without a connection to them (``notify=False``: the handshake failed or the
        peer is considered dead) the request is reported ``unnotified``."""
        self._release_transfers(job)
        self._staging.settle(job.staged, job.remote.remote_engine_id)
        for meeting in job.meetings:  # siblings fail too, and place nothing more here
            meeting.end_share(self.rank, reason)
            meeting.close(self.rank)
        log.warning("read for request %s failed: %s", job.request_id, reason)
        peer = self._peers.get(job.remote.remote_engine_id)
        told = notify and peer is not None and self._notify(job, list(peer.agents), ok=False)
        with self._lock:
            self._results.failed[job.request_id] = reason
            if not told:
                self._results.unnotified.add(job.request_id)
        self._results_ready.set()

    def _fetch_peer(self, remote: RemoteParams) -> _Handshake:
        """Handshake with ``remote``'s engine and plan the reads (pool thread, no NIXL)."""
        local = self._require_geometry()
        slices = read_plan(self.rank, self.tp_size, remote.tp_size, self.total_kv_heads)
        notify = notify_plan(self.rank, self.tp_size, remote.tp_size, self.total_kv_heads)
        ranks = tuple(sorted(notify))
        answer = self._client.fetch(remote.remote_host, remote.remote_port, ranks,
                                    timeout=self.handshake_timeout,
                                    retries=self.handshake_retries)
        if answer.engine_id != remote.remote_engine_id:
            raise TransferError(f"the side channel belongs to engine {answer.engine_id!r}, not "
                                f"{remote.remote_engine_id!r}")
        if answer.tp_size != remote.tp_size:
            raise TransferError(f"engine reports TP {answer.tp_size} but kv_transfer_params say "
                                f"tp_size={remote.tp_size}")
        metas = {m.tp_rank: m for m in answer.ranks}
        missing = set(ranks) - set(metas)
        if missing:
            raise TransferError(f"handshake answer lacks ranks {sorted(missing)}")
        for rank, meta in metas.items():
            if not set(meta.backends) & set(self._agent.backends):
                raise TransferError(
                    f"prefill rank {rank} runs NIXL backends {', '.join(meta.backends)} and "
                    f"this decode {', '.join(self._agent.backends)}: no backend in common; "
                    f"start both with a shared --nixl-backends")
        geometries = {rank: SideGeometry.from_plan(meta.plan, meta.kv_packing)
                      for rank, meta in metas.items()}
        # a host cache converts reads cut at every block (staging and mapped caches are
        # host memory)
        plans = plan_reads(local, geometries, slices, local_tp=self.tp_size,
                           remote_tp=remote.tp_size, convert_cut=not self._local_cuda)
        staged = [p for p in plans if isinstance(p, StagedRead)]
        if staged and any(m.is_cuda for m in self._require_plan().memory):
            raise TransferError(f"decode layout {local.layout} and prefill layout "
                                f"{staged[0].remote.layout} need a converted read, which only "
                                f"host (CPU) caches support so far")
        host = self._plan_host_reads(staged, metas) if staged and self.host_reads else {}
        for plan in staged:
            if plan.remote_rank in host:
                continue
            log.info("rank %d reads prefill %s rank %d through staging (%s -> %s): %d bytes "
                     "per block", self.rank, remote.remote_engine_id, plan.remote_rank,
                     plan.remote.layout, local.layout, plan.bytes_per_block)
        return _Handshake(metas, plans, notify, host)

    def _plan_host_reads(self, staged: Sequence[StagedRead], metas: Mapping[int, AgentMetadata]
                         ) -> dict[int, HostRead | MappedRead]:
        """The converted reads that can be read on this host, by rank: from the prefill's
        mapped cache (:mod:`kvxfer.transfer.converted.mapped_reads`) where it offers one, else host
        reads (:mod:`kvxfer.transfer.converted.host_reads`)."""
        host: dict[int, HostRead | MappedRead] = {}
        for plan in staged:
            offer = metas[plan.remote_rank].host_reads
            why = "its cache is not host memory" if any(
                m.is_cuda for m in metas[plan.remote_rank].plan.memory) else check_offer(offer)
            if why or offer is None:
                log.info("rank %d: prefill rank %d is not read on this host: %s", self.rank,
                         plan.remote_rank, why)
                continue
            try:
                mapped = map_prefill(plan, self._view_groups, offer, self._shares.mappings)
            except Exception as exc:  # HostReadError, or anything else: read it otherwise
                log.info("rank %d: prefill rank %d's cache is not mapped: %s: %s", self.rank,
                         plan.remote_rank, type(exc).__name__, exc)
                mapped = None
            if mapped is not None:
                host[plan.remote_rank] = mapped
                log.info("rank %d reads prefill rank %d (%s -> %s) from its mapped cache, "
                         "%d bytes per block", self.rank, plan.remote_rank, plan.remote.layout,
                         plan.local.layout, plan.placed_per_block)
                continue
            runs = plan_host_read(plan, self._view_groups, offer)
            if runs is None:
                log.info("rank %d: prefill rank %d is not host-read: its runs are too short "
                         "to pay, or the block sizes differ", self.rank, plan.remote_rank)
                continue
            host[plan.remote_rank] = runs
            log.info("rank %d host-reads prefill rank %d (%s -> %s): %d runs, %d bytes per "
                     "block", self.rank, plan.remote_rank, plan.remote.layout,
                     plan.local.layout, runs.runs_per_block, runs.bytes_per_block)
        return host

    def _connect(self, remote: RemoteParams, shake: _Handshake) -> _Peer:
        """Worker thread: load the peer's agents and warm each connection."""
        # the kind each rank's READs name for its side (sent in the handshake's plan)
        kinds = {rank: memory_kind(shake.metas[rank].plan.memory, f"prefill rank {rank}")
                 for rank in shake.notify}
        agents: dict[int, str] = {}
        rank = -1
        try:
            for rank in sorted(shake.notify):
                meta = shake.metas[rank]
                agents[rank] = self._agent.add_remote(meta.agent_blob)
                self._agent.connect(agents[rank], probe=meta.plan.memory[0])
                for lane in self._lanes:
                    lane.add_remote(meta.agent_blob)
                    lane.connect(agents[rank], probe=meta.plan.memory[0])
        except Exception as exc:
            for name in agents.values():
                self._quietly_remove(name)
            raise TransferError(f"NIXL could not connect to rank {rank}: {exc}") from exc
        peer = _Peer(remote.remote_engine_id, remote.address, remote.tp_size, agents,
                     shake.plans, shake.notify, kinds, shake.host)
        self._peers[peer.engine_id] = peer
        self._dead.pop(peer.engine_id, None)
        # in-process siblings share host reads, and the staged reads of pages that hold
        # every head
        peer.shared = {plan.remote_rank for plan in peer.staged()
                       if not plan.remote.heads_contiguous}
        self._shares.join(self.engine_id, peer.engine_id, self.rank,
                          [r for r, runs in peer.host.items() if isinstance(runs, HostRead)],
                          sorted(peer.shared))
        log.info("rank %d connected to %s at %s (ranks %s)", self.rank, peer.engine_id,
                 peer.address, sorted(agents))
        return peer

    def _forget_dead(self, peer: _Peer, reason: str) -> None:
        """A READ failed: drop the peer and fail fast for a moment before re-handshaking."""
        self._drop_peer(peer.engine_id)
        self._dead[peer.engine_id] = (time.monotonic() + DEAD_PEER_S, reason)

    def _quietly_remove(self, name: str) -> None:
        for agent in (self._agent, *self._lanes):
            try:
                agent.remove_remote(name)
            except Exception as exc:
                log.info("removing remote agent %s from %s failed: %s", name, agent.name, exc)

    def _drop_peer(self, engine_id: str) -> None:
        peer = self._peers.pop(engine_id, None)
        self._shares.leave(self.engine_id, engine_id, self.rank)
        if peer is not None:
            for name in peer.agents.values():
                self._quietly_remove(name)
        self._staging.drop_held(engine_id)

    def _handle_notifs(self) -> None:
        for sender, messages in self._agent.get_notifs().items():
            for raw in messages:
                try:
                    note = decode_notif(raw, peer=f"agent {sender!r}", hmac_key=self._key)
                except ProtocolError as exc:  # a forged "done" must not end a lease
                    log.warning("ignoring a notification: %s", exc)
                    why = "bad_signature" if isinstance(exc, BadSignature) else "malformed"
                    with self._lock:
                        self._counts.notifications_failed[why] += 1
                    continue
                with self._lock:
                    lease = self._leases.get(note.request_id)
                    if lease is None:  # a late reader of an ended lease, or a stray note
                        ended = self._ended.get(note.request_id, "unknown")
                        self._counts.notifications_late[ended] += 1
                        log.info("ignoring a done for lease %s from %s, which is not held "
                                 "(ended: %s)", note.request_id, sender, ended)
                    else:
                        self._count_done(note.request_id, lease, note)

    def _count_done(self, request_id: str, lease: _Lease, note: ReadDone) -> None:
        """Record one reader's "done" (caller holds the lock)."""
        lease.done_by.add((note.reader_engine_id, note.reader_rank))
        needed = lease.readers if lease.readers is not None else note.expected_readers
        if not note.ok:
            log.info("decode %s rank %d gave up on request %s", note.reader_engine_id,
                     note.reader_rank, request_id)
        if len(lease.done_by) >= needed:
            self._end(request_id, "done")

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            for request_id, lease in list(self._leases.items()):
                if now >= lease.expires:
                    self._end(request_id, "expired")
                    log.warning("lease of request %s expired with %d reader(s) done", request_id,
                                len(lease.done_by))

    def _end(self, request_id: str, reason: str) -> None:
        """End held lease ``request_id`` (caller holds the lock); remember why, so that a
        "done" arriving later counts as late, not as a stray one."""
        del self._leases[request_id]
        self._released.append(Released(request_id, reason))
        self._ended[request_id] = reason
        if len(self._ended) > ENDED_REMEMBERED:
            del self._ended[next(iter(self._ended))]  # the oldest (dicts keep insertion order)

    def _require_plan(self) -> RegionPlan:
        if self._plan is None:
            raise RuntimeError(f"rank {self.rank}: call register_kv_caches() first")
        return self._plan

    def _require_geometry(self) -> SideGeometry:
        self._require_plan()
        assert self._geometry is not None
        return self._geometry
