"""``EngineLoop``: the one thread that owns a sidecar's engine and its roles.

HTTP handlers (asyncio) never touch the engine: they :meth:`EngineLoop.submit`
requests and :meth:`EngineLoop.abort` them, both of which queue a command and
wake the thread. The thread, in a loop:

0. (on the caller's thread, in :meth:`EngineLoop.submit`) answers the first token of
   a decode request that brought the one its prefill sampled;
1. runs queued commands (a request to the role that admits its kind, aborts);
2. polls the roles (:class:`~kvxfer.sidecar.roles.composition.Roles`: READ results,
   released leases, decode admissions);
3. steps the engine when it has work and hands each output to its request's
   :class:`Sink` (``loop.call_soon_threadsafe`` into an asyncio queue);
4. publishes a snapshot (free blocks, leases, in-flight requests) that
   ``/health`` and ``/metrics`` read without taking the engine lock, adds
   the engine's new prefix cache lookups to the metrics, and hands the prefix
   cache's events to the KV event stream when there is one;
5. sleeps on an Event when nothing was computed: ~1 ms while READs are in
   flight, a few ms while the engine waits for blocks, 10 ms while leases are
   held, up to a second when idle (a command wakes it at once).

Request ids: :meth:`reserve_ids` hands out ids unique among the requests this
loop tracks (queued, running, parked, leased); an id is reusable once its
request is gone (finished and not leased, or aborted). Lease ids given to
decode instances are unique per engine (random, see
:class:`~kvxfer.sidecar.roles.prefill.PrefillSide`), so a request id can be reused as
soon as its lease ended.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvxfer.sidecar.request_kinds import PullIn, PushIn, Submission, first_logprob
from kvxfer.sidecar.roles.role import AbortOutcome, Role, RoleEvents
from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
from kvxfer.wire.messages import ReleaseOutcome

if TYPE_CHECKING:
    from kvxfer.engine import LLMEngine, RequestOutput
    from kvxfer.sidecar.kv_event_publisher import KVEventPublisher
    from kvxfer.sidecar.request_kinds import Kind
    from kvxfer.sidecar.roles.composition import Roles

T = TypeVar("T")
R = TypeVar("R", bound=Role)
log = logging.getLogger(__name__)

READ_POLL_S = 0.001      # READs in flight
BLOCKED_POLL_S = 0.002   # the engine has work but nothing could be scheduled
LEASE_POLL_S = 0.01      # leases held / decode requests waiting for blocks
IDLE_WAIT_S = 1.0        # nothing to do: a command wakes the thread earlier
MAX_ID_SUFFIX = 10_000   # "id-1" ... "id-9999": far above any real collision count


class EngineStopped(RuntimeError):
    """The engine loop is not running (shut down, or stopped by an internal error)."""


@dataclass(frozen=True)
class Failure:
    """A request that ended without an answer; ``status`` is the HTTP status to send."""

    status: int
    message: str
    kind: str  # OpenAI error type, e.g. "invalid_request_error", "kv_transfer_error"


@dataclass(frozen=True)
class Event:
    """One step's news for one choice of an HTTP request.

    Exactly one of ``output`` and ``failure`` is set. ``kv_transfer_params`` is set
    on the final output of a prefill request whose blocks are now leased.
    """

    index: int
    output: RequestOutput | None = None
    failure: Failure | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def final(self) -> bool:
        return self.failure is not None or (self.output is not None and self.output.finished)


class Sink:
    """Delivers events from the engine thread into one HTTP request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.closed = False  # the handler is gone: drop further events

    def push(self, event: Event) -> None:
        if self.closed:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop closed (shutdown)
            self.closed = True


@dataclass
class _Tracked:
    sink: Sink
    index: int
    kind: Kind  # a further sample's is its request's (its transfer is that one's)
    siblings: tuple[str, ...] = ()  # ids forgotten along with this one


class EngineLoop:
    """See the module docstring. Start with :meth:`start`, stop with :meth:`stop`."""

    def __init__(self, engine: LLMEngine, roles: Roles, metrics: SidecarMetrics,
                 kv_events: KVEventPublisher | None = None) -> None:
        self.engine, self.roles, self.metrics = engine, roles, metrics
        self.kv_events = kv_events
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._ids_lock = threading.Lock()
        self._ids: set[str] = set()
        self._snapshot: dict[str, int] = {}
        self._prefix_counted = (0, 0)  # prefix cache (queries, hits) already in the metrics
        self._submit_lock = threading.Lock()
        self._closed = False  # set by the thread as it ends: submit() refuses from then on
        self.error: str | None = None  # set when the thread died of an internal error
        self._thread = threading.Thread(target=self._run, name="kvxfer-engine-loop",
                                        daemon=True)
        self._publish()

    # -- any thread -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step (idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine loop did not stop within %.0f s", timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def snapshot(self) -> dict[str, int]:
        """Block, lease and request counts as of the end of the last iteration."""
        return dict(self._snapshot)

    def reserve_ids(self, base: str, count: int) -> list[str]:
        """``count`` request ids derived from ``base``, none in use on this instance.

        One prompt: ``base`` itself, else ``base-1``, ``base-2``...; several prompts:
        ``base-0``, ``base-1``... each made unique the same way.
        """
        wanted = [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
        with self._ids_lock:
            out = [self._unique(name) for name in wanted]
            self._ids.update(out)
        return out

    def _unique(self, name: str) -> str:
        if name not in self._ids:
            return name
        for n in range(1, MAX_ID_SUFFIX):
            candidate = f"{name}-{n}"
            if candidate not in self._ids:
                return candidate
        raise ValueError(f"request id {name!r} is in use {MAX_ID_SUFFIX} times over")

    def release_ids(self, ids: Iterable[str]) -> None:
        """Return reserved ids that were never submitted."""
        with self._ids_lock:
            self._ids.difference_update(ids)

    def submit(self, submissions: list[Submission], sink: Sink) -> None:
        """Queue requests (ids from :meth:`reserve_ids`); events arrive through ``sink``.

        A decode submission that brings the prefill's first token has it answered here,
        on the caller's thread, before the loop even sees the request
        (:meth:`_answer_first_token`)."""
        with self._submit_lock:  # so that no submission slips in after the final drain
            if self._closed or not self.running:
                raise EngineStopped(self.error or "the engine loop is not running")
            queued = [sub for sub in submissions if not self._answer_first_token(sub, sink)]
            if queued:
                self._command("submit", (queued, sink))

    def _answer_first_token(self, sub: Submission, sink: Sink) -> bool:
        """Send the first output of a decode submission given its first token, at once:
        the client has its first token as soon as the prefill sampled it, not after the
        claim, the READ and a step. True when that output ends the request (end-of-text,
        a stop string, ``max_tokens`` 1): nothing is read then, the lease is released."""
        if not isinstance(sub.kind, PullIn | PushIn):
            return False
        first = first_logprob(sub.kind.first_token)
        if first is None:
            return False
        output = self.engine.first_output(sub.request_id, sub.prompt, sub.params, first)
        self._count(output)
        sink.push(Event(sub.index, output))
        if not output.finished:
            return False
        self.roles.not_admitted(sub.kind, f"the prefill's first token ended the request "
                                          f"({output.finish_reason})", ReleaseOutcome.ANSWERED)
        self._release_id(sub.request_id)
        return True

    def abort(self, request_ids: Iterable[str]) -> None:
        """The client left: abort these requests (a READ in flight finishes first)."""
        self._command("abort", list(request_ids))

    def on_role(self, kind: type[R], call: Callable[[R], T], missing: str) -> Future[T]:
        """``call`` on this instance's role of type ``kind`` (e.g. a push decode's
        reservations: reserve, release), run on the loop's thread; the future has its
        result, or fails with its exception, a ValueError saying ``missing`` (no such
        role here) or EngineStopped."""
        future: Future[T] = Future()
        with self._submit_lock:
            if self._closed or not self.running:
                raise EngineStopped(self.error or "the engine loop is not running")
            self._command("role", (kind, call, missing, future))
        return future

    def _command(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._run_commands()
                self._role_events(self.roles.poll())
                stepped = False
                if self.engine.has_work():
                    outputs = self.engine.step()
                    stepped = bool(outputs)
                    self._dispatch(outputs)
                self._publish()
                if not stepped:
                    self._wake.wait(self._pause())
        except Exception as exc:  # a bug or a broken engine: fail everyone, stay down
            log.exception("engine loop stopped by an internal error")
            self.error = f"engine loop stopped: {type(exc).__name__}: {exc}"
            self._close(Failure(500, self.error, "internal_error"))
            return
        self._close(Failure(503, "the sidecar is shutting down", "service_unavailable"))

    def _close(self, failure: Failure) -> None:
        """Refuse new submissions, then answer everyone still waiting with ``failure``."""
        self._stop.set()
        with self._submit_lock:
            self._closed = True
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                submissions, sink = payload
                for sub in submissions:
                    self._track(sub, sink)
                    self._release_unadmitted(sub)
            elif kind == "role":
                payload[3].set_exception(EngineStopped(failure.message))
        self._fail_all(failure)

    def _release_unadmitted(self, sub: Submission) -> None:
        """A submission that never reached its role: what it names (a lease that would
        wait for its TTL) is let go now (the roles still send at this point)."""
        self.roles.not_admitted(sub.kind, "the decode instance shut down before admitting "
                                          "the request", ReleaseOutcome.ABANDONED)

    def _pause(self) -> float:
        if self.roles.busy or self.roles.claiming:
            return READ_POLL_S
        if self.engine.has_work():
            return BLOCKED_POLL_S
        if self.roles.waiting:
            return LEASE_POLL_S
        return IDLE_WAIT_S

    def _run_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                submissions, sink = payload
                for submission in submissions:
                    self._add(submission, sink)
            elif kind == "role":
                self._on_role(*payload)
            else:
                for request_id in payload:
                    self._abort(request_id)

    def _on_role(self, kind: type[Role], call: Callable[[Any], Any], missing: str,
                 future: Future[Any]) -> None:
        try:
            role = self.roles.find(kind)
            if role is None:
                raise ValueError(missing)
            future.set_result(call(role))
        except Exception as exc:  # answered to the caller, whatever it was
            future.set_exception(exc)

    def _track(self, sub: Submission, sink: Sink) -> None:
        samples = sub.samples
        self._tracked[sub.request_id] = _Tracked(sink, sub.index, sub.kind,
                                                 tuple(s.request_id for s in samples))
        for sample in samples:
            self._tracked[sample.request_id] = _Tracked(sink, sample.index, sub.kind)

    def _add(self, sub: Submission, sink: Sink) -> None:
        self._track(sub, sink)
        group = sub.ids
        try:
            self.roles.admit(sub)
        except ValueError as exc:
            for request_id in group:
                self._end(request_id, Failure(400, str(exc), "invalid_request_error"))
        except Exception as exc:  # one request's bug must not stop the loop
            log.exception("adding request %s failed", sub.request_id)
            for request_id in group:
                self._end(request_id, Failure(500, f"adding the request failed: "
                                                   f"{type(exc).__name__}: {exc}",
                                              "internal_error"))

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None:  # finished, but its client left before the answer reached it
            self.roles.abort(request_id)
            return
        tracked.sink.closed = True
        outcome = self.roles.abort(request_id)
        if outcome is AbortOutcome.DROPPED:
            for sibling in tracked.siblings:  # a waiting group is dropped whole
                self._forget(sibling)
        elif outcome is AbortOutcome.NOT_MINE:
            outcome = AbortOutcome.DEFERRED if self.engine.abort(request_id) \
                else AbortOutcome.DROPPED
        if outcome is AbortOutcome.DROPPED:
            self._forget(request_id)
        # DEFERRED (or aborted in the engine): its "abort" output ends it; LEASED: its lease
        # ended, and its release frees the blocks

    def _role_events(self, events: RoleEvents) -> None:
        if events.released:
            with self._ids_lock:
                self._ids.difference_update(events.released)
        for request_id, message in events.rejected.items():
            self._end(request_id, Failure(400, message, "invalid_request_error"))
        for request_id, message in events.failed.items():
            self._end(request_id, Failure(500, message, "internal_error"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                log.warning("output for untracked request %s dropped", output.request_id)
                continue
            self._count(output)
            if not output.finished:
                tracked.sink.push(Event(tracked.index, output))
                continue
            self._finish(output, tracked)

    def _count(self, output: RequestOutput) -> None:
        if output.new_token_ids and len(output.token_ids) == len(output.new_token_ids):
            self.metrics.prompt_tokens.inc(output.num_prompt_tokens)
        self.metrics.generation_tokens.inc(len(output.new_token_ids))

    def _finish(self, output: RequestOutput, tracked: _Tracked) -> None:
        """A request ended in the engine: its role says what its answer carries (a
        prefill's lease params), or why it failed when its transfer did."""
        request_id = output.request_id
        del self._tracked[request_id]
        params = None
        try:
            params = self.roles.finished(output, tracked.kind)
        except Exception as exc:
            log.exception("leasing the blocks of request %s failed", request_id)
            if not self.roles.in_use(request_id):
                self._release_id(request_id)
            tracked.sink.push(Event(tracked.index, failure=Failure(
                500, f"leasing the KV blocks of request {request_id} failed: {exc}",
                "internal_error")))
            return
        if output.finish_reason == "error":
            transfer = self.roles.transfer_error(request_id, tracked.kind)
            failure = Failure(502, transfer, "kv_transfer_error") if transfer is not None \
                else Failure(500, output.error or "the request failed", "internal_error")
            self._release_id(request_id)
            tracked.sink.push(Event(tracked.index, failure=failure))
            return
        if params is None:
            self._release_id(request_id)
        tracked.sink.push(Event(tracked.index, output, kv_transfer_params=params))

    def _end(self, request_id: str, failure: Failure) -> None:
        """A request that never reached the engine: tell its handler, forget it."""
        tracked = self._tracked.pop(request_id, None)
        self._release_id(request_id)
        if tracked is not None:
            tracked.sink.push(Event(tracked.index, failure=failure))

    def _forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self._release_id(request_id)

    def _release_id(self, request_id: str) -> None:
        with self._ids_lock:
            self._ids.discard(request_id)

    def _fail_all(self, failure: Failure) -> None:
        for request_id in list(self._tracked):
            self._end(request_id, failure)

    def _publish(self) -> None:
        free, used = self.engine.num_free_blocks, self.engine.num_used_blocks
        gauges = self.roles.gauges()
        self.metrics.blocks_free.set(free)
        self.metrics.blocks_used.set(used)
        self.metrics.requests_in_flight.set(len(self._tracked))
        queries, hits, cached = self.engine.prefix_cache_stats()
        self.metrics.prefix_cache_queries.inc(queries - self._prefix_counted[0])
        self.metrics.prefix_cache_hits.inc(hits - self._prefix_counted[1])
        self.metrics.prefix_cache_blocks.set(cached)
        self._prefix_counted = (queries, hits)
        self.metrics.reservations_held.set(gauges["reservations"])
        self.metrics.quarantined_blocks.set(gauges["quarantined_blocks"])
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.take_cache_events())
        self._snapshot = {"free_blocks": free, "used_blocks": used,
                          "num_blocks": self.engine.num_blocks, **gauges,
                          "requests_in_flight": len(self._tracked)}
