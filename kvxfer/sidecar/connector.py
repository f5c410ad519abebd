"""``KVConnector``: the glue between one instance's engine and its transfer workers.

One connector per sidecar. It owns one :class:`~kvxfer.transfer.worker.TransferWorker`
per TP rank (all sharing the instance's ``engine_id``, new on every start) with
``engine.kv_caches[rank]`` registered, and, on a prefill instance, the
handshake listener that serves every rank's metadata to decode instances.

Threading: every method except :attr:`engine_id` / :attr:`side_channel_port`
and :meth:`release_remote` is called from the sidecar's engine-loop thread
only, the same thread that steps the engine, so engine calls and lease state
changes here never race a step. Other threads only queue work for it: the
listener's thread queues side-channel releases
(:class:`~kvxfer.transfer.leases.LeaseAnswers`), :meth:`release_remote`
queues a release for the sender thread.

Prefill role (who calls what):

* the loop calls :meth:`hold` when a ``hold_blocks`` request finished: every
  rank leases the request's blocks (readers announced by the decode side,
  ``ttl`` = ``lease_ttl`` seconds) and the answer's ``kv_transfer_params`` are
  returned;
* a decode claims a lease before reading it and renews it while it waits
  (``RenewLease``): the listener's thread grants the claim to the first decode
  engine only, renews only for it, never past ``lease_max_age`` after :meth:`hold`
  (:meth:`LeaseAnswers.on_renew`);
* a decode that will not read a lease says so over the side channel (a
  ``ReleaseLease``; ignored from another engine than the claimer); the listener's
  thread queues it, and the next :meth:`poll`
  ends that lease on every rank (``worker.end_lease``). An id that is not a
  held lease (ended already, or never handed out) changes nothing;
* :meth:`poll` collects released leases; once *every* rank released a request
  ("done" by all its readers, "abandoned" by a release, or "expired"),
  ``engine.release`` frees its blocks and ``kvxfer_kv_leases_released_total``
  counts it once, by reason (expired > abandoned > done when ranks differ).

Decode role: :meth:`add_remote`, :meth:`abort`, :meth:`take_transfer_error` and the
decode half of :meth:`poll` are :class:`~kvxfer.sidecar.kv_loads.KVLoads`' (its
module docstring is the contract: claims, admission, reads, their resolution, the
releases a decode sends), over the shared
:class:`~kvxfer.transfer.lease_client.LeaseClient`. The HTTP layer calls
:meth:`release_remote` for a request refused before it reached the loop. While a rank
reads from a prefill, :attr:`heartbeats` asks that prefill's side channel whether it
answers (``kv_heartbeat_timeout``; 0: never): a READ in flight from one silent for that
long fails like a READ past its timeout (:mod:`kvxfer.transfer.liveness`).
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvxfer.sidecar.claimers import Claimers
from kvxfer.sidecar.connector_events import AbortOutcome, ConnectorEvents
from kvxfer.sidecar.kv_loads import KVLoads
from kvxfer.sidecar.kv_pushes import KVPushes
from kvxfer.sidecar.prefill_pushes import PrefillPushes
from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.lease_book import LeaseBook
from kvxfer.wire.messages import ReleaseOutcome
from kvxfer.wire.reservations import RESERVATION_ID_KEY, Reservation
from kvxfer.wire.tickets import TICKET_KEY, LeaseClaims, sign_ticket, verify_ticket

if TYPE_CHECKING:  # the engine and workers pull in torch and NIXL
    from kvxfer.engine import LLMEngine, Logprob, SamplingParams
    from kvxfer.transfer.leases import LeaseAnswers
    from kvxfer.transfer.liveness import Liveness
    from kvxfer.transfer.side_channel.heartbeats import Heartbeats
    from kvxfer.transfer.side_channel.listener import SideChannelListener
    from kvxfer.transfer.side_channel.sender import SideChannelSender
    from kvxfer.transfer.worker import TransferWorker
    from kvxfer.wire.params import RemoteParams

__all__ = ["FAILURE_POLICIES", "ROLES", "AbortOutcome", "ConnectorEvents", "KVConnector",
           "compat_info", "dtype_name", "new_engine_id"]

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
TRANSFER_MODES = ("pull", "push")  # push: a decode also takes reservations (kv_pushes)
FAILURE_POLICIES = ("recompute", "fail")
# decode: a READ in flight from a prefill whose side channel answered no heartbeat for this
# long fails (kvxfer.transfer.liveness): within 1.25 x this after the prefill fell silent
DEFAULT_HEARTBEAT_TIMEOUT_S = 2.0
PARAMS_HOLDER = "params-holder"  # who releases through release_handed_out (no decode engine)


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``: the canonical name :class:`CompatInfo` carries."""
    return str(dtype).removeprefix("torch.")


def compat_info(engine: LLMEngine) -> CompatInfo:
    """What a peer must share with ``engine`` to exchange KV caches with it."""
    config = engine.config
    # an MLA cache's "head" is its latent (compressed KV, then the RoPE key)
    return CompatInfo(model=engine.model_id, dtype=dtype_name(engine.dtype),
                      cache_dtype=dtype_name(engine.dtype),
                      head_size=engine.cache_spec(0).head_size,
                      total_kv_heads=config.num_key_value_heads,
                      num_layers=config.num_hidden_layers, kv_packing=engine.kv_packing,
                      kv_lora_rank=config.kv_lora_rank)


@dataclass
class _Leased:
    """A prefill request whose blocks some ranks still lease."""

    request_id: str
    ranks_left: set[int]
    reasons: set[str] = field(default_factory=set)


class KVConnector:
    """See the module docstring for the contract."""

    def __init__(self, engine: LLMEngine, role: str, metrics: SidecarMetrics, *,
                 engine_id: str | None = None, side_channel_host: str = "127.0.0.1",
                 side_channel_port: int = 0, advertise_host: str | None = None,
                 lease_ttl: float = 120.0, lease_max_age: float | None = None,
                 failure_policy: str = "recompute", read_lanes: int = 2,
                 nixl_backends: tuple[str, ...] = ("UCX",),
                 kv_read_timeout: float = 10.0, hmac_key: bytes | None = None,
                 host_reads: bool = True,
                 kv_heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 kv_transfer_mode: str = "pull") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if kv_transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"the KV transfer mode must be one of {', '.join(TRANSFER_MODES)}, "
                             f"got {kv_transfer_mode!r}")
        if failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv load failure policy must be one of "
                             f"{', '.join(FAILURE_POLICIES)}, got {failure_policy!r}")
        if not lease_ttl > 0:
            raise ValueError(f"lease TTL must be a positive number of seconds, got {lease_ttl}")
        lease_max_age = 4 * lease_ttl if lease_max_age is None else lease_max_age
        if not kv_heartbeat_timeout >= 0:
            raise ValueError(f"the heartbeat timeout must be 0 (off) or a positive number of "
                             f"seconds, got {kv_heartbeat_timeout}")
        if not lease_max_age >= lease_ttl:
            raise ValueError(f"the maximum lease age ({lease_max_age} s) must be at least the "
                             f"lease TTL ({lease_ttl} s)")
        self.engine, self.role, self.metrics = engine, role, metrics
        self.engine_id = engine_id or new_engine_id(role)
        self.side_channel_host = side_channel_host  # where the listener binds
        # what decodes are told (remote_host, lease tickets): reachable, never a wildcard
        self.advertise_host = advertise_host or side_channel_host
        self.lease_ttl, self.failure_policy = lease_ttl, failure_policy
        self.lease_max_age = lease_max_age  # prefill: no renewal past this; decode: no ticket
        self._key = hmac_key  # signs the side channel, notifications and lease tickets
        self.kv_read_timeout = kv_read_timeout
        self.kv_heartbeat_timeout = kv_heartbeat_timeout  # decode; 0: no heartbeats
        self.heartbeats: Heartbeats | None = None  # decode: asks peers read from if there
        self.nixl_backends = nixl_backends
        # converted reads on one host (kvxfer.transfer.converted.host_reads)
        self.host_reads = host_reads
        # Copy threads for the whole instance, shared by its in-process TP ranks (which
        # already read at once); only decode ranks read, a prefill's lanes would idle.
        self.read_lanes = max(1, read_lanes // engine.tp) if role == "decode" else 1
        self.workers: list[TransferWorker] = []
        self.listener: SideChannelListener | None = None
        self.answers: LeaseAnswers | None = None  # prefill: the listener's lease answers
        self.loads: KVLoads | None = None  # decode: requests whose KV is read
        self.pushes: KVPushes | None = None  # decode, push mode: reservations written into
        self.pushing = PrefillPushes(self.workers, hmac_key)  # prefill: prompts pushed into them
        self._leases: dict[str, _Leased] = {}  # by lease id
        self._lease_of: dict[str, str] = {}  # request id -> lease id
        if role == "both":
            return  # a plain instance: nobody reads from it and it reads from nobody
        try:
            self._start_workers()
            engine.layer_hook = self.pushing.on_layer if role == "prefill" else None
            if role == "prefill" or kv_transfer_mode == "push":  # prefills handshake a push's
                self._start_listener(side_channel_port)      # decode
            if role == "decode":
                self._start_loads(kv_transfer_mode)
        except BaseException:
            self.close()
            raise

    def _start_workers(self) -> None:
        from kvxfer.transfer.converted.process_shares import ProcessShares
        from kvxfer.transfer.worker import TransferWorker

        compat = compat_info(self.engine)
        liveness = self._start_heartbeats(compat)
        shares = ProcessShares()  # the ranks run in this process: they share their reads
        for rank in range(self.engine.tp):
            worker = TransferWorker(self.engine_id, rank, self.engine.tp, compat,
                                    total_kv_heads=self.engine.config.num_key_value_heads,
                                    read_lanes=self.read_lanes, hmac_key=self._key,
                                    nixl_backends=self.nixl_backends,
                                    host_reads=self.host_reads, shares=shares,
                                    liveness=liveness, **self._read_deadlines())
            self.workers.append(worker)
            worker.register_kv_caches(self.engine.kv_caches[rank], self.engine.cache_spec(rank),
                                      self.engine.num_blocks, self.engine.layout)

    def _start_heartbeats(self, compat: CompatInfo) -> Liveness | None:
        """Decode: the liveness of the prefills read from, which its ranks share, and the
        thread that sends their heartbeats (None: another role, or heartbeats off)."""
        from kvxfer.transfer.liveness import Liveness
        from kvxfer.transfer.side_channel.heartbeats import Heartbeats

        if self.role != "decode" or not self.kv_heartbeat_timeout:
            return None
        liveness = Liveness(self.kv_heartbeat_timeout)
        self.heartbeats = Heartbeats(liveness, self.engine_id, compat, self._key)
        return liveness

    def _read_deadlines(self) -> dict[str, Any]:
        """A decode's bounds, from ``kv_read_timeout``: the handshake's two attempts take
        at most that long together (a frozen prefill costs no more), a READ as long."""
        return {"handshake_timeout": self.kv_read_timeout / 2, "handshake_retries": 1,
                "read_timeout": self.kv_read_timeout}

    def _start_listener(self, port: int) -> None:
        from kvxfer.transfer.leases import LeaseAnswers, ReservationAnswers
        from kvxfer.transfer.side_channel.listener import SideChannelListener

        def connecting(_requester: str) -> None:
            for worker in self.workers:
                worker.peer_connecting()

        # a prefill's listener answers for its leases; a push-mode decode's for the
        # reservations: their claims, and the writers' "done" reports (a lost notification's)
        leases = LeaseAnswers(self.workers, ttl=self.lease_ttl, max_age=self.lease_max_age) \
            if self.role == "prefill" else ReservationAnswers(self.workers, self.lease_ttl)
        answers: dict[str, Any] = {"on_renew": leases.on_renew, "on_done": leases.on_done}
        if self.role == "prefill":
            self.answers, answers["on_release"] = leases, leases.on_release
        else:
            answers["on_claimer"] = lambda *seen: self.pushes and self.pushes.claimers.heard(*seen)
        self.listener = SideChannelListener(
            self.side_channel_host, port, engine_id=self.engine_id,
            compat=compat_info(self.engine),
            metadata=lambda: [w.metadata() for w in self.workers], hmac_key=self._key,
            on_request=connecting, **answers).start()
        self.pushing.answers_at = (self.advertise_host, self.listener.port)

    def _start_loads(self, mode: str) -> None:
        from kvxfer.transfer.lease_client import LeaseClient
        from kvxfer.transfer.side_channel.client import SideChannelClient
        from kvxfer.transfer.side_channel.sender import SideChannelSender

        compat = compat_info(self.engine)
        def sender() -> SideChannelSender:  # its thread alone uses its client: connections kept
            return SideChannelSender(SideChannelClient(self.engine_id, compat, self._key,
                                                 keep_connections=True))

        releaser = sender()
        try:  # its own thread: a renewal must not wait behind releases to a dead prefill
            renewer = sender()
        except BaseException:
            releaser.close()
            raise
        leases = LeaseClient(LeaseBook(self._key, max_age=self.lease_max_age), releaser,
                             renewer, read_timeout=self.kv_read_timeout)
        self.loads = KVLoads(self.engine, self.workers, self.metrics, leases,
                             failure_policy=self.failure_policy)
        if mode == "push" and self.listener is not None:
            claimers = Claimers(SideChannelClient(self.engine_id, compat, self._key))
            self.pushes = KVPushes(self.engine, self.workers, self.metrics, claimers,
                                   engine_id=self.engine_id, host=self.advertise_host,
                                   port=self.listener.port, key=self._key, ttl=self.lease_ttl,
                                   failure_policy=self.failure_policy)

    @property
    def side_channel_port(self) -> int | None:
        """The handshake listener's port (prefill role), else None."""
        return None if self.listener is None else self.listener.port

    @property
    def releaser(self) -> SideChannelSender | None:
        """Decode: the sender of side-channel releases (None in other roles, or closed)."""
        return None if self.loads is None else self.loads.leases.releaser

    @property
    def busy(self) -> bool:
        """READs or pushes in flight: the loop should poll every millisecond or so."""
        return (self.loads is not None and self.loads.busy) or \
            (self.pushes is not None and self.pushes.busy)

    @property
    def claiming(self) -> bool:
        """Claims on their way to a prefill: poll about as often as when :attr:`busy`,
        so that a claim costs one side-channel round trip, not a poll interval."""
        return self.loads is not None and self.loads.claiming

    @property
    def waiting(self) -> bool:
        """Leases held or requests waiting for blocks: poll now and then."""
        return bool(self._leases) or (self.loads is not None and self.loads.waiting)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def is_leased(self, request_id: str) -> bool:
        return request_id in self._lease_of

    def close(self) -> None:
        """Stop the listener, then the workers, then release the leases of decode
        requests that will never read, sending for at most about a second
        (idempotent). Call after the loop stopped."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for worker in self.workers:
            worker.close()
        if self.heartbeats is not None:
            self.heartbeats.close()
            self.heartbeats = None
        for part in (self.loads, self.pushes):
            if part is not None:
                part.close()

    # -- prefill ----------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: list[int], num_prompt_tokens: int,
             first: Logprob | None = None, push: Reservation | None = None) -> dict[str, Any]:
        """Lease a finished ``hold_blocks`` request's blocks on every rank.

        Returns the ``kv_transfer_params`` of the answer. ``remote_block_ids``
        are the prompt's blocks (``ceil(num_prompt_tokens / block_size)``);
        ``first_token`` is ``first``, the token the request sampled
        (:class:`~kvxfer.wire.params.FirstToken`), for a decode to continue from. The
        lease id (``remote_request_id``) is 128 random bits: unique, so a late or
        repeated "done" for an ended lease can never release a new one, and
        unguessable, so nobody can name a lease they were not handed. With a key,
        ``lease_ticket`` signs what the params say (:mod:`kvxfer.wire.tickets`). With
        ``push`` (a decode's reservation), the blocks are WRITten into it instead: the
        pushes lease them and end the lease; the params name the reservation.
        """
        if push is not None:
            lease_id = self.pushing.seal(request_id, block_ids)
            self._add_lease(lease_id, _Leased(request_id, set(range(len(self.workers)))))
            return {"do_remote_decode": False, "do_remote_prefill": True,
                    RESERVATION_ID_KEY: push.reservation_id, **_first_token(first)}
        lease_id = secrets.token_urlsafe(16)
        expires_at = time.time() + self.lease_ttl  # before hold: never later than enforced
        holding: set[int] = set()
        try:
            for rank, worker in enumerate(self.workers):
                worker.hold(lease_id, block_ids, readers=None, ttl=self.lease_ttl)
                holding.add(rank)
        except Exception:
            # Ranks that hold a lease free it at expiry; without any, free now.
            if holding:
                self._add_lease(lease_id, _Leased(request_id, holding))
            else:
                self.engine.release(request_id)
            raise
        self._add_lease(lease_id, _Leased(request_id, holding))
        prompt_blocks = -(-num_prompt_tokens // self.engine.block_size)
        port = self.side_channel_port
        assert port is not None
        claims = LeaseClaims(self.engine_id, self.advertise_host, port, lease_id,
                             tuple(block_ids[:prompt_blocks]), num_prompt_tokens, self.engine.tp,
                             expires_at)
        params = {"do_remote_decode": False, "do_remote_prefill": True,
                  "remote_engine_id": self.engine_id, "remote_host": self.advertise_host,
                  "remote_port": port, "remote_block_ids": list(claims.block_ids),
                  "remote_request_id": lease_id, "remote_num_tokens": num_prompt_tokens,
                  "remote_block_size": self.engine.block_size,
                  "tp_size": self.engine.tp, "lease_expires_at": claims.expires_at}
        if self._key is not None:
            params[TICKET_KEY] = sign_ticket(self._key, claims)
        return {**params, **_first_token(first)}

    def _add_lease(self, lease_id: str, lease: _Leased) -> None:
        self._leases[lease_id] = lease
        self._lease_of[lease.request_id] = lease_id

    def _poll_leases(self, events: ConnectorEvents) -> None:
        """End the leases decodes released; free the blocks of those every rank ended."""
        if self.answers is not None:
            self.answers.take_releases()  # reported by poll_released below, as any end
        for rank, worker in enumerate(self.workers):
            for item in worker.poll_released():
                lease = self._leases.get(item.request_id)  # a worker's id is the lease id
                if lease is None and (self.pushing.ended_unheld(item.request_id) or (
                        self.pushes is not None and self.pushes.released(rank, item))):
                    continue
                if lease is None:
                    log.warning("rank %d released unknown lease %s", rank, item.request_id)
                    continue
                lease.ranks_left.discard(rank)
                lease.reasons.add(item.reason)
                if not lease.ranks_left:
                    del self._leases[item.request_id]
                    del self._lease_of[lease.request_id]
                    self.engine.release(lease.request_id)
                    reason = _lease_end_reason(lease.reasons)
                    self.metrics.leases_released.labels(reason).inc()
                    events.released.append(lease.request_id)

    # -- decode -----------------------------------------------------------------------------
    def add_remote(self, request_id: str, prompt: list[int], params: SamplingParams,
                   remote: RemoteParams,
                   siblings: list[tuple[str, SamplingParams]] | None = None) -> None:
        """Park a decode request and read its prompt's KV, now or once blocks are free.

        First the lease is checked (:meth:`LeaseClient.check`): an expired, forged,
        altered or already used lease raises :class:`~kvxfer.wire.lease_book.LeaseRefused` (a
        ValueError) and nothing is read or released (it may be another request's); under
        policy ``recompute`` an expired one (or one whose claim is refused) is served by
        computing the prompt here instead.

        Then the prefill is asked to grant this decode the lease (a claim, sent from
        the renewer thread); the request waits until it is granted, and a refused
        claim comes back through :meth:`poll` as ``rejected`` (nothing read or
        released: the lease may be another decode's).

        ``siblings``: (request id, params) of further samples of the same prompt,
        started from this request's KV once it is read (see :mod:`kvxfer.sidecar.kv_loads`).
        Raises ValueError (engine validation) at once when it is invalid (its lease
        released); admission failures come back through :meth:`poll` (``rejected``:
        invalid, ``failed``: anything else), one entry per member.
        """
        if self.loads is None:
            raise RuntimeError(f"a {self.role} instance does not read remote KV")
        self.loads.add(request_id, prompt, params, remote, siblings)

    def take_transfer_error(self, request_id: str) -> str | None:
        """The failure message if ``request_id`` ended because its KV read failed."""
        pushed = None if self.pushes is None else self.pushes.take_transfer_error(request_id)
        return pushed or (None if self.loads is None else
                          self.loads.take_transfer_error(request_id))

    # -- both roles -------------------------------------------------------------------------
    def abort(self, request_id: str) -> AbortOutcome:
        """The client left: drop, defer or leave the request (see :class:`AbortOutcome`).

        DROPPED for the first member of a waiting group drops the whole group: the
        caller forgets its siblings too. DEFERRED for it aborts the siblings still
        parked when the READ ends."""
        outcome = None if self.loads is None else self.loads.abort(request_id)
        if outcome is None and self.pushes is not None:
            outcome = self.pushes.abort(request_id)
        if outcome is not None:
            return outcome
        if self.end_unanswered(request_id):
            return AbortOutcome.LEASED
        return AbortOutcome.NOT_MINE

    def end_unanswered(self, request_id: str) -> bool:
        """Prefill, the loop's thread: the client of ``request_id`` left before its
        answer (the lease's params) reached it, so nobody can read the lease: end it now
        on every rank (``abandoned``) instead of at its TTL. Whether it held one."""
        lease_id = self._lease_of.get(request_id)
        if lease_id is None:
            return False
        log.info("request %s: its client left before it got the params of lease %s; "
                 "freeing its blocks", request_id, lease_id)
        for worker in self.workers:
            worker.end_lease(lease_id, "abandoned")
        return True

    def release_remote(self, remote: RemoteParams, reason: str,
                       outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        """Any thread: tell the prefill that ``remote``'s lease will not be read (queued
        for the sender thread; False when not queued). For a decode request that ends
        before reaching the engine loop, e.g. refused by the HTTP layer. Only a lease
        this decode may claim is released (ticket valid, not expired, not used
        before): a refused request must not free a lease it merely names."""
        loads = self.loads
        if loads is None:
            return False
        return loads.leases.release_named(remote, reason, outcome)

    def release_handed_out(self, remote: RemoteParams, reason: str) -> bool:
        """Any thread: end a lease this prefill handed out, unclaimed by any decode, for a
        caller that shows its params (the proxy, when no decode will read them); queued
        for the engine loop, as a decode's release. ValueError for another prefill's
        params or, with a key, params this prefill did not sign; whether it was held
        and unclaimed."""
        if self.answers is None:
            raise RuntimeError(f"a {self.role} instance hands out no leases")
        if remote.remote_engine_id != self.engine_id:
            raise ValueError(f"the params name prefill {remote.remote_engine_id}, this is "
                             f"{self.engine_id}")
        if self._key is not None:
            verify_ticket(self._key, remote.claims(), remote.lease_ticket)
        # a lease a decode claimed is that decode's to end early: refused (logged) then
        return self.answers.on_release(remote.remote_request_id, PARAMS_HOLDER, reason)

    def poll(self) -> ConnectorEvents:
        """Collect READ results and released leases; admit waiting decode requests."""
        events = ConnectorEvents()
        if not self.workers:
            return events
        self._poll_leases(events)
        if self.loads is not None:
            self.loads.poll(events)
        if self.pushes is not None:
            self.pushes.poll()
        self._count_worker_events()
        self.metrics.leases_held.set(len(self._leases))
        return events

    def _count_worker_events(self) -> None:
        """Add what the workers counted since the last poll to the metrics."""
        m = self.metrics
        for worker in self.workers:
            counts = worker.take_counts()
            for metric, counted in ((m.handshake_failures, counts.handshake_failures),
                                    (m.notifications_failed, counts.notifications_failed),
                                    (m.notifications_late, counts.notifications_late)):
                for reason, count in counted.items():
                    metric.labels(reason).inc(count)
            for (peer, path), moved in counts.paths.items():
                m.count_path(peer, path, moved.num_bytes, moved.seconds, moved.ceiling)


def _first_token(first: Logprob | None) -> dict[str, Any]:
    """The ``first_token`` param of a prefill's answer (none without a first token)."""
    if first is None:
        return {}
    return {"first_token": {"id": first.token_id, "logprob": first.logprob,
                            "top": [list(pair) for pair in first.top]}}


def _lease_end_reason(reasons: set[str]) -> str:
    """One label for a lease whose ranks ended it for ``reasons``: a rank that expired
    means a reader was lost, a release means nobody read; "done" only when all read."""
    for reason in ("expired", "abandoned", "failed", "cached", "answered"):
        if reason in reasons:
            return reason
    return "done"


def new_engine_id(role: str) -> str:
    """A fresh engine id: the role and 12 random hex digits (new on every start)."""
    return f"{role}-{uuid.uuid4().hex[:12]}"
