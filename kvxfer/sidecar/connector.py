"""``KVConnector``: the glue between one instance's engine and its transfer workers.

One connector per sidecar. It owns one :class:`~kvxfer.transfer.worker.TransferWorker`
per TP rank (all sharing the instance's ``engine_id``, new on every start) with
``engine.kv_caches[rank]`` registered, and, on a prefill instance, the
handshake listener that serves every rank's metadata to decode instances.

Threading: every method except :attr:`engine_id` / :attr:`side_channel_port`
and :meth:`release_remote` is called from the sidecar's engine-loop thread
only, the same thread that steps the engine, so engine calls and lease state
changes here never race a step. Other threads only queue work for it: the
listener's thread queues side-channel releases, :meth:`release_remote` queues
a release for the sender thread.

Prefill role (who calls what):

* the loop calls :meth:`hold` when a ``hold_blocks`` request finished: every
  rank leases the request's blocks (readers announced by the decode side,
  ``ttl`` = ``lease_ttl`` seconds) and the answer's ``kv_transfer_params`` are
  returned;
* a decode claims a lease before reading it and renews it while it waits
  (``RenewLease``): the listener's thread grants the claim to the first decode
  engine only, renews only for it, never past ``lease_max_age`` after :meth:`hold`;
* a decode that will not read a lease says so over the side channel (a
  ``ReleaseLease``; ignored from another engine than the claimer); the listener's
  thread queues it, and the next :meth:`poll`
  ends that lease on every rank (``worker.end_lease``). An id that is not a
  held lease (ended already, or never handed out) changes nothing;
* :meth:`poll` collects released leases; once *every* rank released a request
  ("done" by all its readers, "abandoned" by a release, or "expired"),
  ``engine.release`` frees its blocks and ``kvxfer_kv_leases_released_total``
  counts it once, by reason (expired > abandoned > done when ranks differ).

Decode role:

* the loop calls :meth:`add_remote` with already validated
  :class:`~kvxfer.wire.params.RemoteParams`. It first checks the lease
  (:class:`~kvxfer.wire.lease_book.LeaseBook`: not expired, ticket valid with the key,
  never claimed here before) or refuses it, then claims it at the prefill
  (``RenewLease(claim=True)``, from the renewer thread); a later :meth:`poll`
  admits it once the claim was granted, or rejects it (400) when it was refused:
  the prefill grants a lease to one decode engine only. When the engine has no
  free blocks for the prompt the request waits here, first come first served;
  while it waits or reads, :meth:`poll` renews its lease over the side channel
  before it runs out, and a READ starts only with enough of the lease left.
  Admitted: ``engine.add_request(..., remote_kv=True)`` parks it, then every
  rank starts its READ into ``engine.block_ids[:n]`` (unless the lease ended
  meanwhile: then nothing is read and the request fails as a failed read);
* with the engine's prefix cache, the parked request's first blocks may hold a
  cached prefix (``engine.num_cached_tokens``, a multiple of both block sizes): the
  READ then covers only the prefill blocks past it, into the blocks past it. When
  the cache holds every token the decode needs (all but the last), nothing is read:
  the lease is released over the side channel at once (the prefill counts it
  ``abandoned``) and the request runs (``kvxfer_kv_reads_skipped_total``);
* :meth:`poll` collects every rank's results; when all ranks ended it calls
  ``engine.finish_kv_load``: ok, or on any failure recompute (policy
  ``recompute``) or fail the request (policy ``fail``; :meth:`take_transfer_error`
  then tells the loop it was a transfer failure).
* ``n > 1`` samples of one prompt (``siblings`` of :meth:`add_remote`) share one
  READ: the group is admitted only when blocks for all of it are free, every
  member is parked with blocks of its own, the READ fills the first one's blocks,
  and ``engine.start_siblings`` copies them into the others' when it succeeded
  (a failed read recomputes or fails every member alike). Aborting the first
  member before the READ ended aborts the whole group (the others cannot start
  without its KV); aborting another member drops only that one.
* A request that ends without the prefill having been told by NIXL sends the
  prefill a release over its side channel (best effort, from the
  :class:`~kvxfer.transfer.handshake.ReleaseSender` thread, never from the loop):
  refused at admission, aborted while waiting for blocks, a read that failed
  before a NIXL connection existed (handshake refused: another model, layout or
  TP) or whose failure notification could not be sent, and requests still
  waiting or reading at :meth:`close`. After a successful read, or a failed one
  whose ``ok=False`` notifications went out, nothing more is sent: the
  notifications end the lease. The HTTP layer calls :meth:`release_remote` for
  a request refused before it reached the loop.

Invariant (the reason deferred aborts exist): a request's blocks are never
freed or reused while any rank's READ may still be writing into them. An abort
that arrives while a read is in flight is recorded and carried out only after
every rank reported finished or failed.
"""

from __future__ import annotations

import enum
import logging
import queue
import secrets
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvxfer.sidecar.metrics import SidecarMetrics
from kvxfer.wire.lease_book import HeldLease, LeaseBook
from kvxfer.wire.protocol import CompatInfo, RenewAck
from kvxfer.wire.tickets import TICKET_KEY, LeaseClaims, sign_ticket

if TYPE_CHECKING:  # the engine and workers pull in torch and NIXL
    from kvxfer.engine import LLMEngine, SamplingParams
    from kvxfer.transfer.handshake import HandshakeListener, ReleaseSender
    from kvxfer.transfer.results import ReadStats
    from kvxfer.transfer.worker import TransferWorker
    from kvxfer.wire.params import RemoteParams

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
FAILURE_POLICIES = ("recompute", "fail")


class AbortOutcome(enum.Enum):
    """What :meth:`KVConnector.abort` did with a request."""

    DROPPED = "dropped"    # it was waiting for blocks and never reached the engine
    DEFERRED = "deferred"  # a READ is in flight; the engine aborts it when all ranks end
    LEASED = "leased"      # prefill: its blocks are leased to readers; the lease ends it
    NOT_MINE = "not_mine"  # the connector does not own it: the caller aborts the engine request


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
class ConnectorEvents:
    """What one :meth:`KVConnector.poll` changed, for the engine loop."""

    released: list[str] = field(default_factory=list)  # prefill: leases ended, blocks freed
    rejected: dict[str, str] = field(default_factory=dict)  # decode: refused at admission
    failed: dict[str, str] = field(default_factory=dict)  # decode: admission raised (a bug)


@dataclass
class _Pending:
    """A decode request (and its ``n > 1`` siblings) waiting for free blocks."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    remote: RemoteParams
    lease: HeldLease
    siblings: list[tuple[str, SamplingParams]] = field(default_factory=list)

    @property
    def ids(self) -> list[str]:
        return [self.request_id, *(sid for sid, _ in self.siblings)]


@dataclass
class _Read:
    """A decode request whose READs are in flight on some ranks."""

    remote: RemoteParams
    ranks_left: set[int]
    siblings: list[str] = field(default_factory=list)  # parked, started from this read
    failures: dict[int, str] = field(default_factory=dict)
    stats: list[ReadStats] = field(default_factory=list)
    aborted: bool = False
    unnotified: set[int] = field(default_factory=set)  # failed ranks the prefill never heard of
    done_unsent: set[int] = field(default_factory=set)  # read ranks whose "done" was not sent
    lease: HeldLease | None = None  # renewed until the read resolves


@dataclass
class _Lease:
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
                 host_reads: bool = True) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv load failure policy must be one of "
                             f"{', '.join(FAILURE_POLICIES)}, got {failure_policy!r}")
        if not lease_ttl > 0:
            raise ValueError(f"lease TTL must be a positive number of seconds, got {lease_ttl}")
        lease_max_age = 4 * lease_ttl if lease_max_age is None else lease_max_age
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
        self.leases = LeaseBook(hmac_key, max_age=lease_max_age)  # decode: leases to read
        self.renewer: ReleaseSender | None = None  # decode: renews leases of waiting requests
        # decode: (request id, ack or None, monotonic time sent, why not) from the renewer
        self._renewals: queue.SimpleQueue[tuple[str, RenewAck | None, float, str]] = \
            queue.SimpleQueue()
        self.kv_read_timeout = kv_read_timeout
        self.nixl_backends = nixl_backends
        # converted reads on one host (kvxfer.transfer.converted.host_reads)
        self.host_reads = host_reads
        # Copy threads for the whole instance, shared by its in-process TP ranks (which
        # already read at once); only decode ranks read, a prefill's lanes would idle.
        self.read_lanes = max(1, read_lanes // engine.tp) if role == "decode" else 1
        self.workers: list[TransferWorker] = []
        self.listener: HandshakeListener | None = None
        self.releaser: ReleaseSender | None = None  # decode: sends side-channel releases
        # prefill: (lease id, requester, reason) from the listener's thread
        self._releases: queue.SimpleQueue[tuple[str, str, str]] = queue.SimpleQueue()
        self._pending: deque[_Pending] = deque()
        self._reads: dict[str, _Read] = {}
        self._leases: dict[str, _Lease] = {}  # by lease id
        self._lease_of: dict[str, str] = {}  # request id -> lease id
        self._transfer_errors: dict[str, str] = {}
        if role == "both":
            return  # a plain instance: nobody reads from it and it reads from nobody
        try:
            self._start_workers()
            if role == "prefill":
                self._start_listener(side_channel_port)
            else:
                self._start_releaser()
        except BaseException:
            self.close()
            raise

    def _start_workers(self) -> None:
        from kvxfer.transfer.converted.process_shares import ProcessShares
        from kvxfer.transfer.worker import TransferWorker

        compat = compat_info(self.engine)
        shares = ProcessShares()  # the ranks run in this process: they share their reads
        for rank in range(self.engine.tp):
            worker = TransferWorker(self.engine_id, rank, self.engine.tp, compat,
                                    total_kv_heads=self.engine.config.num_key_value_heads,
                                    read_lanes=self.read_lanes, hmac_key=self._key,
                                    nixl_backends=self.nixl_backends,
                                    host_reads=self.host_reads, shares=shares,
                                    **self._read_deadlines())
            self.workers.append(worker)
            worker.register_kv_caches(self.engine.kv_caches[rank], self.engine.cache_spec(rank),
                                      self.engine.num_blocks, self.engine.layout)

    def _read_deadlines(self) -> dict[str, Any]:
        """A decode's bounds, from ``kv_read_timeout``: the handshake's two attempts take
        at most that long together (a frozen prefill costs no more), a READ as long."""
        return {"handshake_timeout": self.kv_read_timeout / 2, "handshake_retries": 1,
                "read_timeout": self.kv_read_timeout}

    def _start_listener(self, port: int) -> None:
        from kvxfer.transfer.handshake import HandshakeListener

        def connecting(_requester: str) -> None:
            for worker in self.workers:
                worker.peer_connecting()

        self.listener = HandshakeListener(
            self.side_channel_host, port, engine_id=self.engine_id,
            compat=compat_info(self.engine),
            metadata=lambda: [w.metadata() for w in self.workers], hmac_key=self._key,
            on_request=connecting, on_release=self._on_release,
            on_renew=self._on_renew).start()

    def _start_releaser(self) -> None:
        from kvxfer.transfer.handshake import HandshakeClient, ReleaseSender

        compat = compat_info(self.engine)
        self.releaser = ReleaseSender(HandshakeClient(self.engine_id, compat, self._key))
        # its own thread: a renewal must not wait behind releases to a dead prefill
        self.renewer = ReleaseSender(HandshakeClient(self.engine_id, compat, self._key))

    @property
    def side_channel_port(self) -> int | None:
        """The handshake listener's port (prefill role), else None."""
        return None if self.listener is None else self.listener.port

    @property
    def busy(self) -> bool:
        """READs in flight: the loop should poll every millisecond or so."""
        return bool(self._reads)

    @property
    def claiming(self) -> bool:
        """Claims on their way to a prefill: poll about as often as when :attr:`busy`,
        so that a claim costs one side-channel round trip, not a poll interval."""
        return any(not p.lease.claimed for p in self._pending)

    @property
    def waiting(self) -> bool:
        """Leases held or requests waiting for blocks: poll now and then."""
        return bool(self._leases or self._pending)

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
        if self.releaser is not None:
            for item in self._pending:
                self._release(item.remote, "the decode instance shut down before reading it")
            for read in self._reads.values():  # the workers stopped: no READ goes on
                self._release(read.remote, "the decode instance shut down while reading it")
            self._pending.clear()
            self._reads.clear()
            self.releaser.close()
            self.releaser = None
        if self.renewer is not None:
            self.renewer.close()
            self.renewer = None

    # -- prefill ----------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: list[int],
             num_prompt_tokens: int) -> dict[str, Any]:
        """Lease a finished ``hold_blocks`` request's blocks on every rank.

        Returns the ``kv_transfer_params`` of the answer. ``remote_block_ids``
        are the prompt's blocks (``ceil(num_prompt_tokens / block_size)``). The
        lease id (``remote_request_id``) is 128 random bits: unique, so a late or
        repeated "done" for an ended lease can never release a new one, and
        unguessable, so nobody can name a lease they were not handed. With a key,
        ``lease_ticket`` signs what the params say (:mod:`kvxfer.wire.tickets`).
        """
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
                self._add_lease(lease_id, _Lease(request_id, holding))
            else:
                self.engine.release(request_id)
            raise
        self._add_lease(lease_id, _Lease(request_id, holding))
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
        return params

    def _add_lease(self, lease_id: str, lease: _Lease) -> None:
        self._leases[lease_id] = lease
        self._lease_of[lease.request_id] = lease_id

    def _on_release(self, lease_id: str, requester: str, reason: str) -> bool:
        """Listener thread: queue a side-channel release for :meth:`poll`; whether the
        lease is held right now (the ack's ``found``; reading worker state is safe)."""
        if not all(worker.may_end(lease_id, requester) for worker in self.workers):
            log.warning("decode %s released lease %s, which another decode claimed: ignored",
                        requester, lease_id)
            return False
        self._releases.put((lease_id, requester, reason))
        return any(worker.holds_lease(lease_id) for worker in self.workers)

    def _on_renew(self, lease_id: str, requester: str, claim: bool) -> float | str:
        """Listener thread: claim (``claim``) or extend a held lease by ``lease_ttl`` on
        every rank (worker leases are thread-safe; see ``TransferWorker.renew``): the
        seconds it has left, or why any rank refused (ended, another claimer, too old)."""
        answers = [worker.renew(lease_id, self.lease_ttl, requester, claim=claim,
                                max_age=self.lease_max_age) for worker in self.workers]
        refused = [a for a in answers if isinstance(a, str)]
        if refused:
            return refused[0]
        log.debug("decode %s %s lease %s", requester, "claimed" if claim else "renewed",
                  lease_id)
        return min(a for a in answers if not isinstance(a, str))

    def _take_releases(self) -> None:
        """End the leases decode instances released, on every rank still holding them;
        ``_poll_leases`` then frees the blocks as for any other release."""
        while True:
            try:
                lease_id, requester, reason = self._releases.get_nowait()
            except queue.Empty:
                return
            lease = self._leases.get(lease_id)
            if lease is None:
                log.info("decode %s released lease %s, which is not held (ended already or "
                         "never handed out): ignored", requester, lease_id)
                continue
            log.info("decode %s will not read lease %s (%s): freeing its blocks", requester,
                     lease_id, reason)
            for rank in sorted(lease.ranks_left):
                self.workers[rank].end_lease(lease_id, "abandoned")

    def _poll_leases(self, events: ConnectorEvents) -> None:
        for rank, worker in enumerate(self.workers):
            for item in worker.poll_released():
                lease = self._leases.get(item.request_id)  # a worker's id is the lease id
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

        First the lease is claimed (:meth:`LeaseBook.claim`): an expired, forged,
        altered or already used lease raises :class:`~kvxfer.wire.lease_book.LeaseRefused` (a
        ValueError) and nothing is read or released (it may be another request's).

        Then the prefill is asked to grant this decode the lease (a claim, sent from
        the renewer thread); the request waits until it is granted, and a refused
        claim comes back through :meth:`poll` as ``rejected`` (nothing read or
        released: the lease may be another decode's).

        ``siblings``: (request id, params) of further samples of the same prompt,
        started from this request's KV once it is read (see the module docstring).
        Raises ValueError (engine validation) at once when it is invalid (its lease
        released); admission failures come back through :meth:`poll` (``rejected``:
        invalid, ``failed``: anything else), one entry per member.
        """
        lease = self.leases.claim(remote.claims(), remote.lease_ticket)  # before any READ
        item = _Pending(request_id, prompt, params, remote, lease, list(siblings or []))
        try:  # an invalid request is refused at once, before the prefill is asked
            for member_id, member_params in [(request_id, params), *item.siblings]:
                self.engine.check_request(member_id, prompt, member_params)
        except ValueError as exc:
            self._drop_unadmitted(item, exc, None)
            raise
        self._pending.append(item)
        self._send_renewal(request_id, remote, lease, claim=True)  # the prefill's say

    def _admit(self, events: ConnectorEvents) -> None:
        """Admit waiting decode requests in arrival order while their blocks fit."""
        from kvxfer.engine import NoFreeBlocks

        while self._pending:
            item = self._pending[0]
            if not self._may_start(item.lease):
                return  # claim or renewal on its way (strict FCFS)
            blocks = -(-len(item.prompt) // self.engine.block_size) * len(item.ids)
            if item.siblings and blocks > self.engine.num_free_blocks:
                return  # the whole group at once, or it waits (strict FCFS)
            try:
                self._park(item)
            except NoFreeBlocks:
                return  # strict FCFS: later requests wait behind the head
            except Exception as exc:  # refused (ValueError) or a bug: this request only
                self._pending.popleft()
                self._drop_unadmitted(item, exc, events)
                continue
            self._pending.popleft()
            self._start_read(item)

    def _may_start(self, lease: HeldLease) -> bool:
        """Whether a request may be parked and read now: claimed with enough of the lease
        left for its READ, or ended (lost, past its deadline: ``_start_read`` fails it
        unread). Otherwise it waits for its claim or renewal."""
        now = time.monotonic()
        if not lease.claimed:  # unanswered: failed unread by policy, as a failed read
            return lease.lost is not None
        return (lease.readable_for(now, self.kv_read_timeout) or lease.lost is not None
                or now >= lease.deadline)

    def _drop_unclaimed(self, events: ConnectorEvents) -> None:
        """Refuse waiting requests whose claim the prefill refused: nothing read, nothing
        released (the lease may be another decode's), a 400 for every member."""
        for item in [p for p in self._pending if p.lease.refused]:
            why = item.lease.lost
            self._pending.remove(item)
            message = (f"lease {item.remote.remote_request_id} of prefill "
                       f"{item.remote.remote_engine_id} was not read: the prefill refused "
                       f"this decode's claim: {why}")
            log.warning("request %s: %s", item.request_id, message)
            events.rejected.update(dict.fromkeys(item.ids, message))

    def _drop_unadmitted(self, item: _Pending, exc: Exception,
                         events: ConnectorEvents | None) -> None:
        """The engine would not park ``item``: release its lease, report every member
        (a ValueError is the request's fault, anything else ours), and never leave it at
        the head of the queue, where it would block everyone behind it."""
        if isinstance(exc, ValueError):
            self._release(item.remote, f"the decode refused the request: {exc}")
            if events is not None:
                events.rejected.update(dict.fromkeys(item.ids, str(exc)))
            return
        log.error("admitting decode request %s failed", item.request_id, exc_info=exc)
        self._release(item.remote, f"the decode could not admit the request: "
                                   f"{type(exc).__name__}")
        if events is not None:
            events.failed.update(dict.fromkeys(
                item.ids, f"admitting the request failed: {type(exc).__name__}: {exc}"))

    def _park(self, item: _Pending) -> None:
        """Park every member of ``item`` in the engine, all or none."""
        parked: list[str] = []
        try:
            for request_id, params in [(item.request_id, item.params), *item.siblings]:
                self.engine.add_request(request_id, item.prompt, params, remote_kv=True,
                                        remote_block_size=item.remote.remote_block_size)
                parked.append(request_id)
        except Exception:
            for request_id in parked:  # frees their blocks; nobody reads them yet
                self.engine.abort(request_id)
            raise

    def _start_read(self, item: _Pending) -> None:
        cached = self.engine.num_cached_tokens(item.request_id)
        if cached and cached >= len(item.prompt) - 1:
            self._skip_read(item)
            return
        local, remote = self._blocks_to_read(item, cached)
        read = _Read(remote, set(range(len(self.workers))),
                     [sid for sid, _ in item.siblings], lease=item.lease)
        self._reads[item.request_id] = read
        ended = item.lease.why_unusable(time.monotonic())
        if ended is not None:  # its blocks may hold another prompt's KV now: never read
            for rank in range(len(self.workers)):
                read.failures[rank] = (f"lease {item.remote.remote_request_id} of prefill "
                                       f"{item.remote.remote_engine_id} was not read: {ended}")
            read.ranks_left.clear()
            self._resolve(item.request_id)
            return
        for rank, worker in enumerate(self.workers):
            try:
                worker.start_read(item.request_id, remote, local)
            except (ValueError, RuntimeError) as exc:
                read.ranks_left.discard(rank)
                read.failures[rank] = f"rank {rank} could not start its READ: {exc}"
                read.unnotified.add(rank)
        if not read.ranks_left:
            self._resolve(item.request_id)

    def _blocks_to_read(self, item: _Pending, cached: int) -> tuple[list[int], RemoteParams]:
        """The prompt's local blocks past the ``cached`` prefix and the params naming the
        prefill's blocks past it (its block size may differ: descriptors pair them)."""
        local_size = self.engine.block_size
        local = self.engine.block_ids(item.request_id)[cached // local_size:
                                                       -(-len(item.prompt) // local_size)]
        if not cached:
            return local, item.remote
        remote = item.remote
        size = remote.remote_block_size or local_size
        return local, remote.tokens(cached, len(remote.remote_block_ids) * size, local_size)

    def _skip_read(self, item: _Pending) -> None:
        """The prefix cache holds the KV of every token the decode needs: read nothing,
        free the prefill's lease now, run the request (and its siblings)."""
        log.debug("request %s: the prefix cache holds its prompt; lease %s not read",
                  item.request_id, item.remote.remote_request_id)
        self._release(item.remote, "the decode's prefix cache holds the prompt's KV")
        self.metrics.reads_skipped.inc()
        self.engine.finish_kv_load(item.request_id, ok=True)
        if item.siblings:
            siblings = [sid for sid, _ in item.siblings]
            self.engine.start_siblings(item.request_id, siblings)
            self.metrics.sibling_copies.inc(len(siblings))

    def _poll_reads(self) -> None:
        for rank, worker in enumerate(self.workers):
            result = worker.poll()
            for request_id in result.finished:
                read = self._reads.get(request_id)
                if read is not None:
                    read.ranks_left.discard(rank)
                    read.stats.append(result.stats[request_id])
                    if request_id in result.unnotified:
                        read.done_unsent.add(rank)
            for request_id, reason in result.failed.items():
                read = self._reads.get(request_id)
                if read is not None:
                    read.ranks_left.discard(rank)
                    read.failures[rank] = reason
                    if request_id in result.unnotified:
                        read.unnotified.add(rank)
        for request_id in [rid for rid, read in self._reads.items() if not read.ranks_left]:
            self._resolve(request_id)

    def _resolve(self, request_id: str) -> None:
        """Every rank ended its READ: hand the request back to the engine."""
        read = self._reads.pop(request_id)
        self._check_lease_outlived(read)
        if read.unnotified:  # some prefill rank still waits for a reader that gave up
            why = "; ".join(read.failures[rank] for rank in sorted(read.unnotified))
            self._release(read.remote, f"the decode's KV read failed: {why}")
        elif read.done_unsent:
            self._release_unsent_done(read)
        if read.stats:
            self.metrics.transfer_bytes.inc(sum(s.num_bytes for s in read.stats))
            self.metrics.transfer_descriptors.inc(sum(s.descriptors for s in read.stats))
        group = [request_id, *read.siblings]
        if read.aborted:
            self.metrics.transfers.labels("aborted").inc()
            for member in group:
                self.engine.abort(member)
            return
        if not read.failures:
            self.metrics.transfers.labels("ok").inc()
            self.metrics.transfer_seconds.observe(max(s.seconds for s in read.stats))
            self.metrics.transfer_size.observe(sum(s.num_bytes for s in read.stats))
            self.metrics.transfer_size_descriptors.observe(sum(s.descriptors for s in read.stats))
            self.engine.finish_kv_load(request_id, ok=True)
            if read.siblings:
                self.engine.start_siblings(request_id, read.siblings)
                self.metrics.sibling_copies.inc(len(read.siblings))
            return
        self.metrics.transfers.labels("failed").inc()
        self.metrics.transfer_failures.inc()
        reason = "; ".join(read.failures[rank] for rank in sorted(read.failures))
        if self.failure_policy == "recompute":
            log.warning("KV read for request %s failed, recomputing its prompt: %s", request_id,
                        reason)
            self.metrics.recomputes.inc()
            for member in group:
                self.engine.finish_kv_load(member, ok=False, recompute=True)
            return
        log.warning("KV read for request %s failed (policy fail): %s", request_id, reason)
        message = f"KV transfer from prefill engine {read.remote.remote_engine_id} failed: {reason}"
        for member in group:
            self._transfer_errors[member] = message
            self.engine.finish_kv_load(member, ok=False, recompute=False, reason=message)

    @staticmethod
    def _check_lease_outlived(read: _Read) -> None:
        """A READ that ended after its lease could (the prefill may have reused the blocks
        while it ran) counts as failed on every rank, whatever NIXL said."""
        lease, now = read.lease, time.monotonic()
        if lease is None or read.failures or now < lease.deadline:
            return  # a refused renewal alone proves nothing: our own "done" may end it first
        read.failures[0] = (f"lease {read.remote.remote_request_id} was read, but its KV is "
                            f"not used: the lease ended {now - lease.deadline:.3f} s before "
                            f"the read did")
        read.stats.clear()

    def _release_unsent_done(self, read: _Read) -> None:
        """The KV was read but some prefill rank was not told "done": count it and release
        the lease over the side channel, so those ranks free the blocks before the TTL."""
        self.metrics.done_unsent.inc()
        log.warning("the KV of lease %s was read, but ranks %s could not send their \"done\"; "
                    "releasing it over the side channel", read.remote.remote_request_id,
                    sorted(read.done_unsent))
        self._release(read.remote, "the decode read the KV but could not notify every "
                                   "prefill rank")

    def take_transfer_error(self, request_id: str) -> str | None:
        """The failure message if ``request_id`` ended because its KV read failed."""
        return self._transfer_errors.pop(request_id, None)

    # -- both roles -------------------------------------------------------------------------
    def abort(self, request_id: str) -> AbortOutcome:
        """The client left: drop, defer or leave the request (see :class:`AbortOutcome`).

        DROPPED for the first member of a waiting group drops the whole group: the
        caller forgets its siblings too. DEFERRED for it aborts the siblings still
        parked when the READ ends."""
        for item in self._pending:
            if item.request_id == request_id:
                self._pending.remove(item)
                self._release(item.remote, "the request was aborted before its KV read "
                                           "started")
                return AbortOutcome.DROPPED
            for sibling in item.siblings:
                if sibling[0] == request_id:
                    item.siblings.remove(sibling)
                    return AbortOutcome.DROPPED
        read = self._reads.get(request_id)
        if read is not None:
            read.aborted = True
            return AbortOutcome.DEFERRED
        for read in self._reads.values():
            if request_id in read.siblings:  # parked: the engine aborts it and frees its blocks
                read.siblings.remove(request_id)
                return AbortOutcome.NOT_MINE
        if request_id in self._lease_of:
            return AbortOutcome.LEASED
        return AbortOutcome.NOT_MINE

    def release_remote(self, remote: RemoteParams, reason: str) -> bool:
        """Any thread: tell the prefill that ``remote``'s lease will not be read (queued
        for the sender thread; False when not queued). For a decode request that ends
        before reaching the engine loop, e.g. refused by the HTTP layer. Only a lease
        this decode may claim is released (ticket valid, not expired, not used
        before): a refused request must not free a lease it merely names."""
        try:
            self.leases.claim(remote.claims(), remote.lease_ticket)
        except ValueError as exc:  # LeaseRefused, or no expiry
            log.info("not releasing lease %s named by a refused request: %s",
                     remote.remote_request_id, exc)
            return False
        return self._release(remote, reason)

    def _renew_waiting(self) -> None:
        """Claim the leases of new requests, and renew those of requests waiting for blocks
        or reading before they expire (a failed claim is retried until the deadline)."""
        now = time.monotonic()
        held = [(p.request_id, p.remote, p.lease) for p in self._pending]
        held += [(rid, r.remote, r.lease) for rid, r in self._reads.items() if r.lease]
        for request_id, remote, lease in held:
            if lease.needs_claim() or lease.needs_renewal(now):
                self._send_renewal(request_id, remote, lease, claim=not lease.claimed)

    def _send_renewal(self, request_id: str, remote: RemoteParams, lease: HeldLease, *,
                      claim: bool) -> None:
        """Queue a claim or renewal of ``lease`` on the renewer thread (never the loop's)."""
        renewer = self.renewer
        if renewer is None or lease.renewing:
            return
        lease.renewing = True

        def done(ack: RenewAck | None, sent_at: float, why: str) -> None:
            self._renewals.put((request_id, ack, sent_at, why))

        if not renewer.submit_renew(remote.remote_host, remote.remote_port,
                                    remote.remote_request_id, done, claim=claim):
            lease.renewing = False

    def _take_renewals(self) -> None:
        """Apply claim and renewal answers to the requests they were sent for."""
        while True:
            try:
                request_id, ack, sent_at, why = self._renewals.get_nowait()
            except queue.Empty:
                return
            lease = self._held_lease(request_id)
            if lease is None:
                continue  # ended meanwhile
            if ack is not None and ack.found:
                lease.renewed(sent_at, ack.expires_in, claim=not lease.claimed)
                continue
            lease.renewing = False  # a failed renewal is retried until the deadline
            if ack is not None:  # the prefill refused: never read it
                lease.lost = f"the prefill no longer holds it for this decode ({why})"
                lease.refused = not lease.claimed
            elif not lease.claimed:  # not retried: a dead or frozen prefill costs ~1 s
                lease.lost = f"the prefill did not answer this decode's claim: {why}"

    def _held_lease(self, request_id: str) -> HeldLease | None:
        item = next((p for p in self._pending if p.request_id == request_id), None)
        if item is not None:
            return item.lease
        read = self._reads.get(request_id)
        return None if read is None else read.lease

    def _release(self, remote: RemoteParams, reason: str) -> bool:
        releaser = self.releaser  # read once: close() may clear it from another thread
        if releaser is None:
            return False
        return releaser.submit(remote.remote_host, remote.remote_port,
                               remote.remote_request_id, reason)

    def poll(self) -> ConnectorEvents:
        """Collect READ results and released leases; admit waiting decode requests."""
        events = ConnectorEvents()
        if not self.workers:
            return events
        self._take_releases()
        self._poll_leases(events)
        self._poll_reads()
        self._take_renewals()
        self._drop_unclaimed(events)
        self._admit(events)
        self._renew_waiting()
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


def _lease_end_reason(reasons: set[str]) -> str:
    """One label for a lease whose ranks ended it for ``reasons``: a rank that expired
    means a reader was lost, a release means nobody read; "done" only when all read."""
    for reason in ("expired", "abandoned"):
        if reason in reasons:
            return reason
    return "done"


def new_engine_id(role: str) -> str:
    """A fresh engine id: the role and 12 random hex digits (new on every start)."""
    return f"{role}-{uuid.uuid4().hex[:12]}"
