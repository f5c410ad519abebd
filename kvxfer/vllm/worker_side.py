"""The worker-side half of ``KvxferConnector``: one TP rank's transfers (no vLLM import).

Lives in vLLM's worker process, next to the KV cache, and maps vLLM's steps onto the same
parts a kvxfer sidecar uses, built from the same config
(:class:`~kvxfer.transfer.ranks.Ranks` for this one rank: its worker, its side-channel
listener, the process's reports and heartbeats; the decode's
:class:`~kvxfer.transfer.lease_client.LeaseClient`; the prefill's
:class:`~kvxfer.transfer.leases.LeaseAnswers`). vLLM's model-runner thread calls, once per
step and in this order: :meth:`WorkerSide.apply` (the step's plan, before the forward:
loads checked and claimed, leases vLLM dropped ended), :meth:`WorkerSide.after_forward`
(leases of the blocks the forward wrote held) and :meth:`WorkerSide.poll` (what ended, as
vLLM wants it). Design: docs/design/vllm-connector.md
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.transfer.lease_client import LeaseEnded, Readiness
from kvxfer.transfer.leases import LeaseAnswers
from kvxfer.transfer.ranks import Answering, Ranks
from kvxfer.transfer.results import PollResult, ReadStats
from kvxfer.vllm.extra_config import SPAN_PROBE_KEY, VLLM_LANES, ConnectorSettings
from kvxfer.vllm.step_plan import Hold, Load, StepPlan
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.lease_book import HeldLease
from kvxfer.wire.params import RemoteParams

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
    span_probe: bool = False  # a benchmark's span probe (ConnectorSettings.span_probe)


class WorkerSide:
    """One rank's transfers in a vLLM worker (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, engine_id: str, compat: CompatInfo, *,
                 rank: int, tp_size: int, total_kv_heads: int) -> None:
        self.settings, self.engine_id, self.compat = settings, engine_id, compat
        config = settings.transfer
        # kv_both: this rank reads (decode) and serves its leases (prefill)
        self.ranks = Ranks(engine_id, compat, config, ranks=[rank], tp_size=tp_size,
                           total_kv_heads=total_kv_heads, reads=True, lanes_default=VLLM_LANES)
        self.worker = self.ranks.workers[0]
        try:  # every rank claims as the engine: a lease is read by one decode, all its ranks
            self.leases = self.ranks.lease_client()
        except BaseException:
            self.ranks.stop()
            self.ranks.close()
            raise
        self.answers = LeaseAnswers([self.worker], ttl=config.lease_ttl, max_age=config.max_age)
        self._loads: dict[str, _Load] = {}
        # failed loads whose READs may still land: reported once they settled
        self._quarantined: dict[str, tuple[Load, str]] = {}
        self._to_hold: list[Hold] = []
        self._lease_request: dict[str, str] = {}  # held lease id -> vLLM request id
        self._ended: set[str] = set()     # requests whose lease ended, vLLM not yet told
        self._finished: set[str] = set()  # requests vLLM finished whose lease still runs
        self._result = StepResult()
        self.block_size = 0  # set by register

    @property
    def port(self) -> int:
        port = self.ranks.port
        assert port is not None
        return port

    def register(self, caches: Mapping[str, torch.Tensor], spec: CacheSpec,
                 num_blocks: int) -> None:
        """Plan and register the rank's KV cache, then serve it to peers."""
        self.ranks.register(0, caches, spec, num_blocks)
        self.block_size = spec.block_size
        base = self.settings.transfer.side_channel_port  # rank r listens on base + r (0: any)
        self.ranks.serve(base + self.worker.rank if base else 0, [Answering(self.answers)])

    def close(self) -> None:
        """Stop serving and the worker, release the leases of loads not yet read, then
        send that for about a second."""
        self.ranks.stop()
        for item in self._loads.values():
            self.leases.release(item.remote, "the decode instance shut down before reading it")
        self._loads.clear()
        self.leases.close()
        self.ranks.close()

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
        self.answers.take_releases()
        deadline = time.monotonic() + self.settings.read_wait
        if any(not item.reading for item in self._loads.values()):
            self.leases.wait_for_answer(self.settings.read_wait)  # see ConnectorSettings.read_wait
        self.leases.take_answers()
        self._start_granted()
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
            self.leases.release(full, "the decode did not need it (prefix cache hit or aborted)")
            return
        try:
            lease = self.leases.check(full)
        except ValueError as exc:  # LeaseRefused, or no expiry; maybe another's: never release
            self._fail(load, f"lease {full.remote_request_id} of prefill "
                             f"{full.remote_engine_id} refused: {exc}")
            return
        span_probe = load.params.get(SPAN_PROBE_KEY) is True
        if span_probe and not self.settings.span_probe:
            self._fail(load, f"kv_transfer_params.{SPAN_PROBE_KEY} asks for a benchmark's "
                             f"span probe, which this decode does not allow "
                             f"(kv_connector_extra_config.span_probe)")
            self.leases.release(full, "the decode could not use the lease")
            return
        # the tokens this load covers, which the prefill's blocks (of its own size) hold
        end = (load.skip_blocks + len(load.local_block_ids)) * self.block_size
        if full.remote_num_tokens is not None:
            end = min(end, full.remote_num_tokens)
        try:
            remote = full.tokens(load.skip_blocks * self.block_size, end, self.block_size)
        except ValueError as exc:
            self._fail(load, f"prefill {full.remote_engine_id} at {full.address}: {exc}")
            self.leases.release(full, "the decode could not use the lease")
            return
        self._loads[load.request_id] = _Load(load, remote, lease, span_probe=span_probe)
        if not self.leases.claim(remote, lease):
            del self._loads[load.request_id]
            self._fail(load, "too many claims queued at this decode")

    def _start_granted(self) -> None:
        """Start the READs of loads whose claim was granted; fail those refused or
        unanswered (nothing read or released) and those granted too short a lease."""
        for request_id, item in list(self._loads.items()):
            lease, remote = item.lease, item.remote
            if item.reading or (not lease.claimed and lease.lost is None):
                continue  # reading, or its claim is on its way
            if lease.lost is not None:  # refused (maybe another's) or unanswered
                del self._loads[request_id]
                self._fail(item.load, f"lease {remote.remote_request_id} of prefill "
                                      f"{remote.remote_engine_id} at {remote.address} was not "
                                      f"read: {lease.lost}")
            elif self.leases.readiness(lease) is not Readiness.READ:  # no renewals here
                del self._loads[request_id]
                self._fail(item.load, f"lease {remote.remote_request_id} has "
                                      f"{lease.deadline - time.monotonic():.1f} s left, too "
                                      f"little for a read")
                self.leases.release(remote, "too little of the lease was left to read it")
            else:
                self._start_read(request_id, item)

    def _start_read(self, request_id: str, item: _Load) -> None:
        try:
            self.worker.start_read(request_id, item.remote, item.load.local_block_ids,
                                   span_probe=item.span_probe, lease_ends=item.lease.deadline)
            item.reading = True
        except (ValueError, RuntimeError) as exc:
            del self._loads[request_id]
            self._fail(item.load, f"the READ could not start: {exc}")
            self.leases.release(item.remote, "the decode could not start its READ")

    def _take_reads(self) -> None:
        polled = self.worker.poll()
        for request_id in polled.finished:
            item = self._loads.pop(request_id, None)
            if item is None:
                continue
            self._report(request_id, item, polled)
            try:
                self.leases.check_in_time(item.remote, item.lease)
            except LeaseEnded as exc:  # the blocks may have been reused
                self._fail(item.load, str(exc))
                continue
            self._result.recving.add(request_id)
            self._result.reads.append(polled.stats[request_id])
        for request_id, reason in polled.failed.items():
            item = self._loads.pop(request_id, None)
            if item is None:
                continue
            self._report(request_id, item, polled)
            if request_id in polled.quarantined:
                log.warning("KV load of request %s failed with READs in flight; reported "
                            "to vLLM once they ended: %s", request_id, reason)
                self._quarantined[request_id] = (item.load, reason)
            else:
                self._fail(item.load, reason)
        for request_id in polled.settled:
            held = self._quarantined.pop(request_id, None)
            if held is not None:
                self._fail(*held)

    def _report(self, request_id: str, item: _Load, polled: PollResult) -> None:
        """Release the lease of a failed read no prefill rank could be told of (the
        "done" reports of the others went out from the worker)."""
        failure = polled.failed.get(request_id)
        if request_id in polled.unnotified and failure is not None:
            # a failed load is recomputed or failed whole by vLLM, whatever the other ranks
            # read; a finished one is not released: this decode's other ranks (processes
            # of their own) may still be reading it, so it is left to its TTL
            self.leases.release_after_failed_read(item.remote, failure)

    def _fail(self, load: Load, reason: str) -> None:
        log.warning("KV load of request %s failed; vLLM's kv_load_failure_policy decides: %s",
                    load.request_id, reason)
        self._result.failures += 1
        if load.local_block_ids:
            self._result.recving.add(load.request_id)
            self._result.error_blocks.update(load.local_block_ids)

    # -- prefill ----------------------------------------------------------------------------
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
