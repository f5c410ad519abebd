"""``PullDecode``: a decode's role for requests whose prompt KV it READs from a prefill.

Requests of kind :class:`~kvxfer.sidecar.request_kinds.PullIn`. The leases themselves
(claims, renewals, releases, whether one may be read) are the shared
:class:`~kvxfer.transfer.lease_client.LeaseClient`'s; this class keeps the requests:
those waiting for their claim or for blocks (first come, first served), the READs in
flight on every rank, and how each ends in the engine (run, recomputed or failed by the
failure policy). Engine-loop thread, except :meth:`PullDecode.not_admitted`.

Invariant: a request's blocks are never freed or reused while any rank's READ may still
write into them (an abort waits for every rank; READs given up in flight keep their
blocks set aside until they settled). Design: docs/design/sidecar-roles.md#the-pull-decode
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.sidecar.request_kinds import PullIn, first_logprob
from kvxfer.sidecar.roles.role import AbortOutcome, Role, RoleEvents
from kvxfer.transfer.lease_client import LeaseEnded, Readiness
from kvxfer.wire.lease_book import HeldLease, LeaseExpired
from kvxfer.wire.messages import ReleaseOutcome

if TYPE_CHECKING:  # the engine and workers pull in torch and NIXL
    from kvxfer.engine import LLMEngine, SamplingParams
    from kvxfer.sidecar.request_kinds import Kind, Submission
    from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
    from kvxfer.transfer.ranks import Ranks
    from kvxfer.transfer.results import PollResult, ReadStats
    from kvxfer.transfer.transfer_config import TransferConfig
    from kvxfer.wire.params import RemoteParams

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


class PullDecode(Role):
    """A decode's requests whose KV is read from prefill leases (see the module
    docstring)."""

    kinds = (PullIn,)

    def __init__(self, engine: LLMEngine, ranks: Ranks, metrics: SidecarMetrics,
                 config: TransferConfig) -> None:
        self.engine, self.workers, self.metrics = engine, ranks.workers, metrics
        self.leases = ranks.lease_client()
        self.failure_policy = config.kv_load_failure_policy
        self._pending: deque[_Waiting] = deque()
        self._reads: dict[str, _Reading] = {}
        self._transfer_errors: dict[str, str] = {}
        self._aside: dict[str, _SetAside] = {}  # by request: blocks a READ may still write

    @property
    def quarantined_blocks(self) -> int:
        """Blocks set aside for READs given up in flight that may still land."""
        return sum(len(aside.blocks) for aside in self._aside.values())

    def gauges(self) -> dict[str, int]:
        return {"quarantined_blocks": self.quarantined_blocks}

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

    def admit(self, submission: Submission) -> None:
        """Park a decode request and read its prompt's KV, now or once blocks are free.

        First the lease is checked (:meth:`LeaseClient.check`): an expired, forged,
        altered or already used lease raises :class:`~kvxfer.wire.lease_book.LeaseRefused`
        (a ValueError) and nothing is read or released (it may be another request's);
        under policy ``recompute`` an expired one is served by computing the prompt here
        instead. Then the prefill is asked to grant this decode the lease (a claim, from
        the renewer's thread); the request waits until it is granted, and a refused claim
        comes back through :meth:`poll` as ``rejected``. Further samples start from this
        request's KV once it is read. ValueError (engine validation) at once when it is
        invalid (its lease released); admission failures come back through :meth:`poll`
        (``rejected``: invalid, ``failed``: anything else), one entry per member."""
        kind = submission.kind
        assert isinstance(kind, PullIn)
        request_id, prompt, params, remote = (submission.request_id, submission.prompt,
                                              submission.params, kind.remote)
        siblings = [(sample.request_id, sample.params) for sample in kind.samples]
        members = [(request_id, params), *siblings]
        try:
            lease = self.leases.check(remote)  # before any READ
        except LeaseExpired as exc:  # genuine, but over: the prompt itself may be served
            if self.failure_policy != "recompute":
                raise
            self._recompute_unread(members, prompt, remote, str(exc))
            return
        item = _Waiting(request_id, prompt, params, remote, lease, siblings)
        try:  # an invalid request is refused at once, before the prefill is asked
            for member_id, member_params in [(request_id, params), *item.siblings]:
                self.engine.check_request(member_id, prompt, member_params)
        except ValueError as exc:
            self._drop_unadmitted(item, exc, None)
            raise
        self._pending.append(item)
        self.leases.claim(remote, lease)  # the prefill's say; retried by poll if not queued

    def not_admitted(self, kind: Kind, reason: str, outcome: ReleaseOutcome) -> None:
        """Any thread: release the lease a request that will never be admitted names, if
        this decode may claim it (a refused request must not free a lease it merely
        names)."""
        assert isinstance(kind, PullIn)
        self.leases.release_named(kind.remote, reason, outcome)

    def poll(self, events: RoleEvents) -> None:
        """Collect READ results and lease answers, admit waiting requests, renew leases."""
        self._poll_reads()
        self.leases.take_answers()
        self._drop_unclaimed(events)
        self._admit(events)
        held = [(p.remote, p.lease) for p in self._pending]
        held += [(r.remote, r.lease) for r in self._reads.values()]
        self.leases.renew_due(held)

    # -- admission --------------------------------------------------------------------------
    def _admit(self, events: RoleEvents) -> None:
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

    def _drop_unclaimed(self, events: RoleEvents) -> None:
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
                                    first=first_logprob(remote.first_token))

    def _drop_unadmitted(self, item: _Waiting, exc: Exception,
                         events: RoleEvents | None) -> None:
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
                self.engine.add_awaiting_kv(request_id, item.prompt, params,
                                            remote_block_size=item.remote.remote_block_size,
                                            first=first_logprob(item.remote.first_token))
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
                worker.start_read(item.request_id, remote, local, lease_ends=item.lease.deadline)
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
                    self._unnotified(request_id, rank, read, result, f"rank {rank} read it, "
                                     f"but its connection to the prefill was dropped "
                                     f"meanwhile")
            for request_id, reason in result.failed.items():
                read = self._reads.get(request_id)
                if read is not None:
                    read.ranks_left.discard(rank)
                    read.failures[rank] = reason
                    if request_id in result.quarantined:
                        read.quarantined.add(rank)
                    self._unnotified(request_id, rank, read, result, reason)
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

    @staticmethod
    def _unnotified(request_id: str, rank: int, read: _Reading, result: PollResult,
                    why: str) -> None:
        """A prefill rank ``rank`` could not tell (no connection: its "done" reports went
        out from the worker otherwise) gets a release once every rank ended (``why``)."""
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

    def transfer_error(self, request_id: str) -> str | None:
        """The failure message if ``request_id`` ended because its KV read failed."""
        return self._transfer_errors.pop(request_id, None)

    # -- aborts and shutdown ----------------------------------------------------------------
    def abort(self, request_id: str) -> AbortOutcome | None:
        """Drop a waiting request, or defer the abort of one being read; NOT_MINE for a
        parked sibling of a READ (the engine aborts it), None when ``request_id`` is none
        of these. DROPPED for the first member of a waiting group drops the whole group
        (the caller forgets its siblings too); DEFERRED for it aborts the siblings still
        parked when the READ ends."""
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
        then stop the lease client (idempotent)."""
        for item in self._pending:
            self.leases.release(item.remote, "the decode instance shut down before reading it")
        for read in self._reads.values():  # the workers stopped: no READ goes on
            self.leases.release(read.remote, "the decode instance shut down while reading it")
        self._pending.clear()
        self._reads.clear()
        self.leases.close()
