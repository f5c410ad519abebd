"""``KVLoads``: a decode instance's requests whose prompt KV is read from a prefill.

Owned by the decode's :class:`~kvxfer.sidecar.connector.KVConnector`, which calls
every method from the sidecar's engine-loop thread, the thread that steps the
engine, so engine calls here never race a step. The leases themselves (claims,
renewals, releases, whether one may be read) are the shared
:class:`~kvxfer.transfer.lease_client.LeaseClient`'s; this class keeps only the
requests: those waiting for their claim or for blocks, the READs in flight, and how
each ends in the engine.

Who calls what:

* :meth:`add` with already validated :class:`~kvxfer.wire.params.RemoteParams`.
  It first checks the lease (:meth:`LeaseClient.check`: not expired, ticket valid
  with the key, never claimed here before) or refuses it, then claims it at the
  prefill (``RenewLease(claim=True)``, from the renewer thread); a later :meth:`poll`
  admits it once the claim was granted, or rejects it (400) when it was refused: the
  prefill grants a lease to one decode engine only. Under policy ``recompute`` a lease
  that cannot be read (expired, its claim refused) is not read but its request is served
  all the same, its prompt computed here; only params that are malformed, forged or
  already used here get a 400. When the engine has no free
  blocks for the prompt the request waits here, first come first served; while it
  waits or reads, :meth:`poll` renews its lease over the side channel before it runs
  out, and a READ starts only with enough of the lease left. Admitted:
  ``engine.add_request(..., remote_kv=True)`` parks it, then every rank starts its
  READ into ``engine.block_ids[:n]`` (unless the lease ended meanwhile: then nothing
  is read and the request fails as a failed read);
* with the engine's prefix cache, the parked request's first blocks may hold a cached
  prefix (``engine.num_cached_tokens``, a multiple of both block sizes): the READ then
  covers only the prefill blocks past it, into the blocks past it. When the cache holds
  every token the decode needs (all but the last; all of them when the prefill's first
  token came with the params), nothing is read: the lease is
  released over the side channel at once (the prefill counts it ``cached``) and the
  request runs (``kvxfer_kv_reads_skipped_total``);
* a request whose params bring the token the prefill sampled (``first_token``; ``n`` 1)
  had it answered when it was submitted; parked, recomputed or run from a full prefix
  hit, it starts with that token as its first output (:func:`first_logprob`), so it needs
  the KV of every prompt token, not all but the last (``engine.kv_tokens_needed``);
* :meth:`poll` collects every rank's results; when all ranks ended it calls
  ``engine.finish_kv_load``: ok, or on any failure recompute (policy ``recompute``) or
  fail the request (policy ``fail``; :meth:`take_transfer_error` then tells the loop
  it was a transfer failure). A READ that ended after its lease could counts as failed.
* ``n > 1`` samples of one prompt (``siblings`` of :meth:`add`) share one READ: the
  group is admitted only when blocks for all of it are free, every member is parked
  with blocks of its own, the READ fills the first one's blocks, and
  ``engine.start_siblings`` copies them into the others' when it succeeded (a failed
  read recomputes or fails every member alike). Aborting the first member before the
  READ ended aborts the whole group (the others cannot start without its KV); aborting
  another member drops only that one.
* Every rank's read that ended, read or failed, sends its "done" reports over the
  prefill's side channel (:meth:`LeaseClient.report_done`: acknowledged and resent, from
  the :class:`~kvxfer.transfer.side_channel.sender.SideChannelSender` thread, never from
  the loop), next to its NIXL notifications: the lease ends when every reader was counted
  either way, so a lost notification costs no TTL.
* A request that ends without the prefill being told by any reader sends the prefill a
  release over its side channel (best effort, from the same thread): refused at
  admission, aborted while waiting for blocks, a read that failed before a NIXL
  connection existed (handshake refused: another model, layout or TP) or whose
  connection was dropped meanwhile, and requests still waiting or reading at
  :meth:`close`.

Invariant (the reason deferred aborts exist): a request's blocks are never freed or
reused while any rank's READ may still be writing into them. An abort that arrives
while a read is in flight is recorded and carried out only after every rank reported
finished or failed. A rank whose failed read left READs in flight (given up while a cut
link was down: they may land once it is back) reports it *quarantined*: the request's
blocks past its cached prefix are set aside (``engine.set_aside_blocks``) before it is
recomputed into fresh blocks, failed or aborted, and freed only once every such rank
reported its READs *settled* (:attr:`KVLoads.quarantined_blocks` until then).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.sidecar.connector_events import AbortOutcome, ConnectorEvents
from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
from kvxfer.transfer.lease_client import LeaseClient, LeaseEnded, Readiness
from kvxfer.wire.lease_book import HeldLease, LeaseExpired
from kvxfer.wire.messages import ReleaseOutcome

if TYPE_CHECKING:  # the engine and workers pull in torch and NIXL
    from kvxfer.engine import LLMEngine, Logprob, SamplingParams
    from kvxfer.transfer.results import PollResult, ReadStats
    from kvxfer.transfer.worker import TransferWorker
    from kvxfer.wire.params import RemoteParams
    from kvxfer.wire.reservations import PushedParams

log = logging.getLogger(__name__)


@dataclass
class _Waiting:
    """A decode request (and its ``n > 1`` siblings) waiting for its claim or blocks."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    remote: RemoteParams
    lease: HeldLease
    siblings: list[tuple[str, SamplingParams]] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)

    @property
    def ids(self) -> list[str]:
        return [self.request_id, *(sid for sid, _ in self.siblings)]


@dataclass
class _Reading:
    """A decode request whose READs are in flight on some ranks."""

    remote: RemoteParams
    lease: HeldLease  # renewed until the read resolves
    ranks_left: set[int]
    siblings: list[str] = field(default_factory=list)  # parked, started from this read
    failures: dict[int, str] = field(default_factory=dict)
    stats: list[ReadStats] = field(default_factory=list)
    aborted: bool = False
    # ranks whose prefill was never told and cannot be (no connection), and why
    unnotified: dict[int, str] = field(default_factory=dict)
    quarantined: set[int] = field(default_factory=set)  # ranks whose READs may still land


@dataclass
class _SetAside:
    """A failed read's blocks, kept until the READs of ``ranks`` settled."""

    blocks: list[int]
    ranks: set[int]


def first_logprob(remote: RemoteParams | PushedParams | None) -> Logprob | None:
    """The first token ``remote``'s prefill sampled (``first_token``), as the engine takes
    it; None when the params bring none (vLLM's prefills, ``n > 1``): then the decode
    samples it from the last prompt token, which it computes again."""
    from kvxfer.engine import Logprob

    first = None if remote is None else remote.first_token
    if first is None:
        return None
    return Logprob(first.id, first.logprob, tuple(first.top))


class KVLoads:
    """A decode's remote-KV requests over ``workers`` (see the module docstring)."""

    def __init__(self, engine: LLMEngine, workers: list[TransferWorker],
                 metrics: SidecarMetrics, leases: LeaseClient, *,
                 failure_policy: str) -> None:
        self.engine, self.workers, self.metrics = engine, workers, metrics
        self.leases, self.failure_policy = leases, failure_policy
        self._pending: deque[_Waiting] = deque()
        self._reads: dict[str, _Reading] = {}
        self._transfer_errors: dict[str, str] = {}
        self._aside: dict[str, _SetAside] = {}  # by request: blocks a READ may still write

    @property
    def quarantined_blocks(self) -> int:
        """Blocks set aside for READs given up in flight that may still land."""
        return sum(len(aside.blocks) for aside in self._aside.values())

    @property
    def busy(self) -> bool:
        """READs in flight."""
        return bool(self._reads)

    @property
    def claiming(self) -> bool:
        """Claims on their way to a prefill."""
        return any(not p.lease.claimed for p in self._pending)

    @property
    def waiting(self) -> bool:
        """Requests waiting for their claim or for blocks."""
        return bool(self._pending)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            remote: RemoteParams, siblings: list[tuple[str, SamplingParams]] | None) -> None:
        """See :meth:`KVConnector.add_remote`."""
        members = [(request_id, params), *(siblings or [])]
        try:
            lease = self.leases.check(remote)  # before any READ
        except LeaseExpired as exc:  # genuine, but over: the prompt itself may be served
            if self.failure_policy != "recompute":
                raise
            self._recompute_unread(members, prompt, remote, str(exc))
            return
        item = _Waiting(request_id, prompt, params, remote, lease, list(siblings or []))
        try:  # an invalid request is refused at once, before the prefill is asked
            for member_id, member_params in [(request_id, params), *item.siblings]:
                self.engine.check_request(member_id, prompt, member_params)
        except ValueError as exc:
            self._drop_unadmitted(item, exc, None)
            raise
        self._pending.append(item)
        self.leases.claim(remote, lease)  # the prefill's say; retried by poll if not queued

    def poll(self, events: ConnectorEvents) -> None:
        """Collect READ results and lease answers, admit waiting requests, renew leases."""
        self._poll_reads()
        self.leases.take_answers()
        self._drop_unclaimed(events)
        self._admit(events)
        held = [(p.remote, p.lease) for p in self._pending]
        held += [(r.remote, r.lease) for r in self._reads.values()]
        self.leases.renew_due(held)

    # -- admission --------------------------------------------------------------------------
    def _admit(self, events: ConnectorEvents) -> None:
        """Admit waiting decode requests in arrival order while their blocks fit."""
        from kvxfer.engine import NoFreeBlocks

        while self._pending:
            item = self._pending[0]
            if self.leases.readiness(item.lease) is Readiness.WAIT:
                return  # claim or renewal on its way (strict FCFS); ENDED fails it unread
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

    def _drop_unclaimed(self, events: ConnectorEvents) -> None:
        """Waiting requests whose claim the prefill refused: nothing read, nothing released
        (the lease may be another decode's); recomputed (policy ``recompute``) or a 400
        for every member."""
        for item in [p for p in self._pending if p.lease.refused]:
            why = item.lease.lost
            self._pending.remove(item)
            message = (f"lease {item.remote.remote_request_id} of prefill "
                       f"{item.remote.remote_engine_id} was not read: the prefill refused "
                       f"this decode's claim: {why}")
            if self.failure_policy == "recompute":
                try:
                    self._recompute_unread([(item.request_id, item.params), *item.siblings],
                                           item.prompt, item.remote, message)
                    continue
                except ValueError as exc:
                    message = str(exc)
            log.warning("request %s: %s", item.request_id, message)
            events.rejected.update(dict.fromkeys(item.ids, message))

    def _recompute_unread(self, members: list[tuple[str, SamplingParams]], prompt: list[int],
                          remote: RemoteParams, why: str) -> None:
        """Serve a request whose lease cannot be read by computing its prompt here, as a
        single instance would (policy ``recompute``), from the first token ``remote``
        gave it, if any; ValueError when the engine refuses it (nothing queued then)."""
        for member_id, member_params in members:
            self.engine.check_request(member_id, prompt, member_params)
        log.warning("request %s: recomputing its prompt: %s", members[0][0], why)
        self.metrics.recomputes.inc()
        for member_id, member_params in members:
            self.engine.add_request(member_id, prompt, member_params,
                                    first=first_logprob(remote))

    def _drop_unadmitted(self, item: _Waiting, exc: Exception,
                         events: ConnectorEvents | None) -> None:
        """The engine would not park ``item``: release its lease, report every member
        (a ValueError is the request's fault, anything else ours), and never leave it at
        the head of the queue, where it would block everyone behind it."""
        if isinstance(exc, ValueError):
            self.leases.release(item.remote, f"the decode refused the request: {exc}")
            if events is not None:
                events.rejected.update(dict.fromkeys(item.ids, str(exc)))
            return
        log.error("admitting decode request %s failed", item.request_id, exc_info=exc)
        self.leases.release(item.remote, f"the decode could not admit the request: "
                                         f"{type(exc).__name__}")
        if events is not None:
            events.failed.update(dict.fromkeys(
                item.ids, f"admitting the request failed: {type(exc).__name__}: {exc}"))

    def _park(self, item: _Waiting) -> None:
        """Park every member of ``item`` in the engine, all or none."""
        parked: list[str] = []
        try:
            for request_id, params in [(item.request_id, item.params), *item.siblings]:
                self.engine.add_request(request_id, item.prompt, params, remote_kv=True,
                                        remote_block_size=item.remote.remote_block_size,
                                        first=first_logprob(item.remote))
                parked.append(request_id)
        except Exception:
            for request_id in parked:  # frees their blocks; nobody reads them yet
                self.engine.abort(request_id)
            raise

    # -- reads ------------------------------------------------------------------------------
    def _start_read(self, item: _Waiting) -> None:
        self.metrics.read_wait.observe(time.monotonic() - item.arrived)
        cached = self.engine.num_cached_tokens(item.request_id)
        if cached and cached >= self.engine.kv_tokens_needed(item.request_id):
            self._skip_read(item)
            return
        local, remote = self._blocks_to_read(item, cached)
        read = _Reading(remote, item.lease, set(range(len(self.workers))),
                        [sid for sid, _ in item.siblings])
        self._reads[item.request_id] = read
        try:
            self.leases.check_unread(item.remote, item.lease)
        except LeaseEnded as exc:  # its blocks may hold another prompt's KV now: never read
            read.failures.update(dict.fromkeys(range(len(self.workers)), str(exc)))
            read.ranks_left.clear()
            self._resolve(item.request_id)
            return
        for rank, worker in enumerate(self.workers):
            try:
                worker.start_read(item.request_id, remote, local)
            except (ValueError, RuntimeError) as exc:
                read.ranks_left.discard(rank)
                read.failures[rank] = f"rank {rank} could not start its READ: {exc}"
                read.unnotified[rank] = read.failures[rank]
        if not read.ranks_left:
            self._resolve(item.request_id)

    def _blocks_to_read(self, item: _Waiting, cached: int) -> tuple[list[int], RemoteParams]:
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

    def _skip_read(self, item: _Waiting) -> None:
        """The prefix cache holds the KV of every token the decode needs: read nothing,
        free the prefill's lease now, run the request (and its siblings)."""
        log.debug("request %s: the prefix cache holds its prompt; lease %s not read",
                  item.request_id, item.remote.remote_request_id)
        self.leases.release(item.remote, "the decode's prefix cache holds the prompt's KV",
                            ReleaseOutcome.CACHED)
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
                    self._report(request_id, rank, read, result, f"rank {rank} read it, but "
                                 f"its connection to the prefill was dropped meanwhile")
            for request_id, reason in result.failed.items():
                read = self._reads.get(request_id)
                if read is not None:
                    read.ranks_left.discard(rank)
                    read.failures[rank] = reason
                    if request_id in result.quarantined:
                        read.quarantined.add(rank)
                    self._report(request_id, rank, read, result, reason)
            for request_id in result.settled:
                self._settled(request_id, rank)
        for request_id in [rid for rid, read in self._reads.items() if not read.ranks_left]:
            self._resolve(request_id)

    def _settled(self, request_id: str, rank: int) -> None:
        """Rank ``rank``'s stale READs of ``request_id`` ended: free its set-aside blocks
        once no rank's may land any more."""
        aside = self._aside.get(request_id)
        if aside is not None:
            aside.ranks.discard(rank)
            if not aside.ranks:
                del self._aside[request_id]
                self.engine.free_blocks(aside.blocks)
                log.info("the READs of request %s given up in flight ended: its %d "
                         "quarantined blocks are free", request_id, len(aside.blocks))
            return
        read = self._reads.get(request_id)
        if read is not None:  # settled before every rank ended: nothing to set aside
            read.quarantined.discard(rank)

    def _report(self, request_id: str, rank: int, read: _Reading, result: PollResult,
                why: str) -> None:
        """Send rank ``rank``'s "done" reports of an ended read; a prefill nobody could
        tell gets a release once every rank ended (``why``)."""
        self.leases.report_done(read.remote, result.reports.get(request_id, ()),
                                read.lease)
        if request_id in result.unnotified:
            read.unnotified[rank] = why

    # -- resolution -------------------------------------------------------------------------
    def _resolve(self, request_id: str) -> None:
        """Every rank ended its READ: hand the request back to the engine."""
        read = self._reads.pop(request_id)
        self._check_lease_outlived(read)
        if read.unnotified:  # some prefill rank waits for a reader that cannot tell it
            why = "; ".join(read.unnotified[rank] for rank in sorted(read.unnotified))
            self.leases.release_after_failed_read(read.remote, why)
        if read.quarantined:
            self._aside[request_id] = _SetAside(self.engine.set_aside_blocks(request_id),
                                                set(read.quarantined))
        if read.stats:
            self.metrics.transfer_bytes.inc(sum(s.num_bytes for s in read.stats))
            self.metrics.transfer_descriptors.inc(sum(s.descriptors for s in read.stats))
        if read.aborted:
            self.metrics.transfers.labels("aborted").inc()
            for member in [request_id, *read.siblings]:
                self.engine.abort(member)
        elif not read.failures:
            self._finish_ok(request_id, read)
        else:
            self._finish_failed(request_id, read)

    def _check_lease_outlived(self, read: _Reading) -> None:
        """A READ that ended after its lease could (the prefill may have reused the blocks
        while it ran) counts as failed on every rank, whatever NIXL said."""
        if read.failures:
            return
        try:
            self.leases.check_in_time(read.remote, read.lease)
        except LeaseEnded as exc:
            read.failures[0] = str(exc)
            read.stats.clear()

    def _finish_ok(self, request_id: str, read: _Reading) -> None:
        self.metrics.transfers.labels("ok").inc()
        self.metrics.transfer_seconds.observe(max(s.seconds for s in read.stats))
        self.metrics.transfer_size.observe(sum(s.num_bytes for s in read.stats))
        self.metrics.transfer_size_descriptors.observe(sum(s.descriptors for s in read.stats))
        self.engine.finish_kv_load(request_id, ok=True)
        if read.siblings:
            self.engine.start_siblings(request_id, read.siblings)
            self.metrics.sibling_copies.inc(len(read.siblings))

    def _finish_failed(self, request_id: str, read: _Reading) -> None:
        """Recompute every member (policy ``recompute``) or fail it (policy ``fail``)."""
        self.metrics.transfers.labels("failed").inc()
        self.metrics.transfer_failures.inc()
        group = [request_id, *read.siblings]
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

    def take_transfer_error(self, request_id: str) -> str | None:
        """The failure message if ``request_id`` ended because its KV read failed."""
        return self._transfer_errors.pop(request_id, None)

    # -- aborts and shutdown ----------------------------------------------------------------
    def abort(self, request_id: str) -> AbortOutcome | None:
        """Drop a waiting request, or defer the abort of one being read (see
        :meth:`KVConnector.abort`); NOT_MINE for a parked sibling of a READ (the engine
        aborts it), None when ``request_id`` is none of these."""
        for item in self._pending:
            if item.request_id == request_id:
                self._pending.remove(item)
                self.leases.release(item.remote, "the request was aborted before its KV read "
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
        return None

    def close(self) -> None:
        """After the workers stopped: release the leases of requests that will never read,
        then stop the lease client (sending for at most about a second; idempotent)."""
        for item in self._pending:
            self.leases.release(item.remote, "the decode instance shut down before reading it")
        for read in self._reads.values():  # the workers stopped: no READ goes on
            self.leases.release(read.remote, "the decode instance shut down while reading it")
        self._pending.clear()
        self._reads.clear()
        self.leases.close()
