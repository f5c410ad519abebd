"""The worker-side half of ``KvxferConnector``: one TP rank's transfers (no vLLM import).

Lives in vLLM's worker process, next to the KV cache. It owns the rank's
:class:`~kvxfer.transfer.worker.TransferWorker` (regions, descriptors, READs, leases,
notifications), the :class:`~kvxfer.transfer.handshake.HandshakeListener` that serves the
rank's metadata and lease claims, renewals and releases, and a
:class:`~kvxfer.transfer.handshake.ReleaseSender` for the decode's claims and releases.
Nothing of the transfer is done here: this class only maps vLLM's steps onto
those parts.

Who calls what (vLLM's model-runner thread, once per step, in this order):

* :meth:`apply` with the step's :class:`~kvxfer.vllm.plan.StepPlan`, before the
  forward: decode loads are checked (params, lease, ticket: a bad one fails at
  once) and claimed at their prefill; leases vLLM dropped end now.
* :meth:`after_forward`: the prefill holds the leases whose blocks the forward
  just wrote.
* :meth:`poll`: a granted claim starts its READ; finished and failed READs, and
  prefill leases that ended (every reader said "done", a release, expiry), come
  back as vLLM wants them: request ids done loading or sending, and the block ids
  of failed loads (vLLM then recomputes or fails them, by its
  ``kv_load_failure_policy``). A lease is reported only once vLLM said the
  request finished (``finished_req_ids``), as vLLM requires.

The listener's thread only calls thread-safe :class:`TransferWorker` methods and
queues releases for :meth:`poll`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.transfer.handshake import HandshakeClient, HandshakeListener, ReleaseSender
from kvxfer.transfer.results import ReadStats
from kvxfer.transfer.worker import TransferWorker
from kvxfer.vllm.plan import Hold, Load, StepPlan
from kvxfer.vllm.settings import ConnectorSettings
from kvxfer.wire.lease_book import HeldLease, LeaseBook, LeaseRefused
from kvxfer.wire.params import RemoteParams
from kvxfer.wire.protocol import CompatInfo, RenewAck

if TYPE_CHECKING:
    import torch

    from kvxfer.plan.layout import CacheSpec

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What :meth:`WorkerSide.poll` hands back to vLLM for one step."""

    sending: set[str] = field(default_factory=set)   # prefill: blocks may be freed
    recving: set[str] = field(default_factory=set)   # decode: load ended (ok or not)
    error_blocks: set[int] = field(default_factory=set)  # decode: blocks of failed loads
    reads: list[ReadStats] = field(default_factory=list)
    failures: int = 0


@dataclass
class _Load:
    load: Load
    remote: RemoteParams  # the blocks to read (a local prefix hit skips the first ones)
    lease: HeldLease
    reading: bool = False


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, engine_id: str, compat: CompatInfo, *,
                 rank: int, tp_size: int, total_kv_heads: int,
                 key: bytes | None = None) -> None:
        self.settings, self.engine_id, self.compat = settings, engine_id, compat
        self._key = key
        self.worker = TransferWorker(engine_id, rank, tp_size, compat,
                                     total_kv_heads=total_kv_heads,
                                     handshake_timeout=settings.handshake_timeout,
                                     read_timeout=settings.kv_read_timeout, hmac_key=key,
                                     read_lanes=settings.read_lanes,
                                     host_reads=settings.host_reads)
        self.listener: HandshakeListener | None = None
        self.sender = ReleaseSender(HandshakeClient(f"{engine_id}-r{rank}", compat,
                                                    hmac_key=key))
        self.book = LeaseBook(key, max_age=settings.max_age)
        self._loads: dict[str, _Load] = {}
        self._claims: queue.SimpleQueue[tuple[str, RenewAck | None, float, str]] = \
            queue.SimpleQueue()
        self._claim_ready = threading.Event()  # a claim's answer is queued
        self._releases: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._to_hold: list[Hold] = []
        self._lease_request: dict[str, str] = {}  # held lease id -> vLLM request id
        self._ended: set[str] = set()     # requests whose lease ended, vLLM not yet told
        self._finished: set[str] = set()  # requests vLLM finished whose lease still runs
        self._result = StepResult()
        self.block_size = 0  # set by register

    @property
    def port(self) -> int:
        assert self.listener is not None
        return self.listener.port

    def register(self, caches: Mapping[str, torch.Tensor], spec: CacheSpec,
                 num_blocks: int) -> None:
        """Plan and register the rank's KV cache, then serve it to peers."""
        self.worker.register_kv_caches(caches, spec, num_blocks)
        self.block_size = spec.block_size
        self.listener = HandshakeListener(
            self.settings.side_channel_host, self.settings.side_channel_port,
            engine_id=self.engine_id, compat=self.compat,
            metadata=lambda: [self.worker.metadata()], hmac_key=self._key,
            on_request=lambda _peer: self.worker.peer_connecting(),
            on_release=self._on_release, on_renew=self._on_renew).start()

    def close(self) -> None:
        """Stop serving, release the leases of loads not yet read, stop the workers."""
        if self.listener is not None:
            self.listener.close()
        for item in self._loads.values():
            self._release(item.remote, "the decode instance shut down before reading it")
        self._loads.clear()
        self.worker.close()
        self.sender.close()

    # -- one step ---------------------------------------------------------------------------
    def apply(self, plan: StepPlan) -> None:
        for lease_id in plan.drop_leases:
            self._lease_request.pop(lease_id, None)
            self.worker.end_lease(lease_id, "abandoned")
        self._to_hold.extend(plan.holds)
        for load in plan.loads:
            self._begin(load)

    def after_forward(self) -> None:
        holds, self._to_hold = self._to_hold, []
        for hold in holds:
            ttl = max(hold.expires_at - time.time(), 0.001)
            try:
                self.worker.hold(hold.lease_id, hold.block_ids, readers=None, ttl=ttl)
            except ValueError as exc:  # never expected; the decode's claim is then refused
                log.error("request %s: lease %s not held: %s", hold.request_id, hold.lease_id,
                          exc)
                self._ended.add(hold.request_id)  # vLLM frees its blocks once it finished
                continue
            self._lease_request[hold.lease_id] = hold.request_id

    def poll(self, finished_req_ids: Iterable[str]) -> StepResult:
        self._take_releases()
        deadline = time.monotonic() + self.settings.read_wait
        if any(not item.reading for item in self._loads.values()):
            self._claim_ready.wait(self.settings.read_wait)  # see ConnectorSettings.read_wait
        self._take_claims()
        if any(item.reading for item in self._loads.values()):
            self.worker.wait_for_results(max(0.0, deadline - time.monotonic()))
        self._take_reads()
        self._take_leases(set(finished_req_ids))
        result, self._result = self._result, StepResult()
        return result

    # -- decode -----------------------------------------------------------------------------
    def _begin(self, load: Load) -> None:
        """Check a load's params and lease, then claim it (nothing is read before)."""
        try:
            full = RemoteParams.parse(load.params)
        except ValueError as exc:
            self._fail(load, f"kv_transfer_params from the prefill are not kvxfer's: {exc}")
            return
        if not load.local_block_ids:  # nothing to read: the prefill may free it now
            self._release(full, "the decode did not need it (prefix cache hit or aborted)")
            return
        try:
            lease = self.book.claim(full.claims(), full.lease_ticket)
        except (LeaseRefused, ValueError) as exc:  # maybe another request's: never release
            self._fail(load, f"lease {full.remote_request_id} of prefill "
                             f"{full.remote_engine_id} refused: {exc}")
            return
        # the tokens this load covers, which the prefill's blocks (of its own size) hold
        end = (load.skip_blocks + len(load.local_block_ids)) * self.block_size
        if full.remote_num_tokens is not None:
            end = min(end, full.remote_num_tokens)
        try:
            remote = full.tokens(load.skip_blocks * self.block_size, end, self.block_size)
        except ValueError as exc:
            self._fail(load, f"prefill {full.remote_engine_id} at {full.address}: {exc}")
            self._release(full, "the decode could not use the lease")
            return
        self._loads[load.request_id] = _Load(load, remote, lease)

        def claimed(ack: RenewAck | None, sent_at: float, why: str) -> None:
            self._claims.put((load.request_id, ack, sent_at, why))
            self._claim_ready.set()

        lease.renewing = True
        if not self.sender.submit_renew(full.remote_host, full.remote_port,
                                        full.remote_request_id, claimed, claim=True):
            del self._loads[load.request_id]
            self._fail(load, "too many claims queued at this decode")

    def _take_claims(self) -> None:
        self._claim_ready.clear()
        while True:
            try:
                request_id, ack, sent_at, why = self._claims.get_nowait()
            except queue.Empty:
                return
            item = self._loads.get(request_id)
            if item is None:
                continue
            remote = item.remote
            if ack is None or not ack.found:  # refused (maybe another's) or unanswered
                del self._loads[request_id]
                self._fail(item.load, f"lease {remote.remote_request_id} of prefill "
                                      f"{remote.remote_engine_id} at {remote.address} was not "
                                      f"read: the prefill did not grant this decode's claim: "
                                      f"{why}")
                continue
            item.lease.renewed(sent_at, ack.expires_in, claim=True)
            if not item.lease.readable_for(time.monotonic(), self.settings.kv_read_timeout):
                del self._loads[request_id]
                self._fail(item.load, f"lease {remote.remote_request_id} has "
                                      f"{ack.expires_in:.1f} s left, too little for a read")
                self._release(remote, "too little of the lease was left to read it")
                continue
            try:
                self.worker.start_read(request_id, remote, item.load.local_block_ids)
                item.reading = True
            except (ValueError, RuntimeError) as exc:
                del self._loads[request_id]
                self._fail(item.load, f"the READ could not start: {exc}")
                self._release(remote, "the decode could not start its READ")

    def _take_reads(self) -> None:
        polled = self.worker.poll()
        for request_id in polled.finished:
            item = self._loads.pop(request_id, None)
            if item is None:
                continue
            if time.monotonic() >= item.lease.deadline:  # the blocks may have been reused
                self._fail(item.load, f"lease {item.remote.remote_request_id} ended before "
                                      f"its READ did: its KV is not used")
                continue
            self._result.recving.add(request_id)
            self._result.reads.append(polled.stats[request_id])
            if request_id in polled.unnotified:
                self._release(item.remote, "the decode read the KV but could not notify "
                                           "every prefill rank")
        for request_id, reason in polled.failed.items():
            item = self._loads.pop(request_id, None)
            if item is None:
                continue
            self._fail(item.load, reason)
            if request_id in polled.unnotified:
                self._release(item.remote, f"the decode's KV read failed: {reason}")

    def _fail(self, load: Load, reason: str) -> None:
        log.warning("KV load of request %s failed; vLLM's kv_load_failure_policy decides: %s",
                    load.request_id, reason)
        self._result.failures += 1
        if load.local_block_ids:
            self._result.recving.add(load.request_id)
            self._result.error_blocks.update(load.local_block_ids)

    def _release(self, remote: RemoteParams, reason: str) -> None:
        self.sender.submit(remote.remote_host, remote.remote_port, remote.remote_request_id,
                           reason)

    # -- prefill ----------------------------------------------------------------------------
    def _on_release(self, lease_id: str, requester: str, reason: str) -> bool:
        """Listener thread: queue a decode's release (only its claimer's, or unclaimed)."""
        if not self.worker.may_end(lease_id, requester):
            log.warning("decode %s released lease %s, which another decode claimed: ignored",
                        requester, lease_id)
            return False
        self._releases.put(lease_id)
        log.info("decode %s will not read lease %s: %s", requester, lease_id, reason)
        return self.worker.holds_lease(lease_id)

    def _on_renew(self, lease_id: str, requester: str, claim: bool) -> float | str:
        """Listener thread: claim or renew a held lease (``TransferWorker.renew``)."""
        return self.worker.renew(lease_id, self.settings.lease_ttl, requester, claim=claim,
                                 max_age=self.settings.max_age)

    def _take_releases(self) -> None:
        while True:
            try:
                lease_id = self._releases.get_nowait()
            except queue.Empty:
                return
            self.worker.end_lease(lease_id, "abandoned")

    def _take_leases(self, finished: set[str]) -> None:
        for item in self.worker.poll_released():
            request_id = self._lease_request.pop(item.request_id, None)
            if request_id is not None:
                if item.reason != "done":
                    log.info("lease %s of request %s ended: %s", item.request_id, request_id,
                             item.reason)
                self._ended.add(request_id)
        self._finished |= finished
        done = self._ended & self._finished
        self._ended -= done
        self._finished -= done
        self._finished &= set(self._lease_request.values())  # only those still leased
        self._result.sending |= done
