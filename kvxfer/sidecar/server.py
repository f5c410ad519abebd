"""The sidecar's HTTP app: OpenAI-compatible completions over the engine loop.

:func:`create_app` builds a FastAPI app around a :class:`Sidecar` (engine,
connector, engine loop, metrics); :func:`serve` binds the HTTP port first (a
port in use fails before the model loads), builds the sidecar and runs uvicorn
until SIGINT/SIGTERM.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Handlers never touch the
engine: they validate (:mod:`kvxfer.sidecar.openai_api`), submit to the
:class:`~kvxfer.sidecar.engine_loop.EngineLoop` and await its events. A client that
disconnects (streaming or not) aborts its requests; an abort during a KV read
takes effect when the read ended (see :mod:`kvxfer.sidecar.kv_loads`).

Status codes: 400 bad input (OpenAI ``invalid_request_error``), 401 without
the API key, 404 unknown model or route, 502 ``kv_transfer_error`` when a
decode's KV read failed under policy ``fail``, 500 internal errors, 503 while
shutting down or draining.

Draining (SIGTERM): the sidecar stops taking new completions (503 with the
``x-kvxfer-draining`` header, which tells the proxy to try another instance;
nothing was started, and a decode leaves the lease it was given for that other
instance), ``/health`` says ``draining`` with a 503 (out of rotation for the proxy
and for Kubernetes readiness), requests in flight finish and a prefill's leases
are read or released. It exits once it holds nothing and no request came for
:data:`DRAIN_QUIET_S` (so a proxy's pooled connections idle out first), or when
``drain_timeout`` seconds have passed (held blocks are then freed as it closes),
at most :data:`GRACEFUL_SHUTDOWN_S` later. A second SIGTERM, or SIGINT, stops at once.

With an API key (``Settings.api_key``) every route answers 401 before its
handler runs unless the request carries ``Authorization: Bearer KEY``
(:mod:`kvxfer.net.api_key`); ``/health`` still answers, but only ``{"status"}``.
So an unauthenticated request never makes a decode contact a side channel,
read, or release anything.

A decode request refused before it reaches the engine loop (bad body, 503)
whose ``kv_transfer_params`` name a prefill lease releases that lease over the
prefill's side channel (:meth:`KVConnector.release_remote`), the caller being
authenticated; refusals after that point are the connector's to release.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvxfer.net.api_key import ApiKeyMiddleware, authenticated
from kvxfer.net.hosts import DRAINING_HEADER, advertised_host, bare_host, listen_tcp
from kvxfer.sidecar.connector import KVConnector, new_engine_id
from kvxfer.sidecar.engine_loop import (
    EngineLoop,
    EngineStopped,
    Event,
    Failure,
    Sibling,
    Sink,
    Submission,
)
from kvxfer.sidecar.metrics import CONTENT_TYPE, SidecarMetrics
from kvxfer.sidecar.openai_api import (
    SSE_DONE,
    ChatRequest,
    Choice,
    CompletionRequest,
    ModelInfo,
    OpenAIError,
    Prepared,
    TokenText,
    chat_body,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_chunk,
    completion_logprobs,
    decode_body,
    error_body,
    prepare_chat,
    prepare_completion,
    sse,
    unread_lease,
    usage_chunk,
)
from kvxfer.transfer.converted.mapped_reads import shared_zeros

if TYPE_CHECKING:
    from kvxfer.engine import LLMEngine

log = logging.getLogger(__name__)
T = TypeVar("T")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ROUTES = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")
MAX_REQUEST_ID_CHARS = 200
GRACEFUL_SHUTDOWN_S = 5
# A draining sidecar exits only after this long without a new request: longer than the
# proxy keeps an idle pooled connection (4 s), so none is reused as the socket closes.
DRAIN_QUIET_S = 5.0
JSON = "application/json"


@dataclass(frozen=True)
class Settings:
    """Everything ``kvxfer serve`` is configured with (see its ``--help``)."""

    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8000
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    tp: int = 1
    kv_cache_layout: str | None = None
    block_size: int = 16
    num_blocks: int = 256
    model: str = "kvxfer-tiny"
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    kv_load_failure_policy: str = "recompute"
    lease_ttl: float = 120.0
    lease_max_age: float | None = None  # None: 4 * lease_ttl
    read_lanes: int = 2
    nixl_backends: tuple[str, ...] = ("UCX",)  # what each rank's NIXL agent runs
    # offer and use host reads of converted reads (kvxfer.transfer.converted.host_reads)
    host_reads: bool = True
    served_model_names: tuple[str, ...] = ()
    # the side channel's shared key (kvxfer.net.kv_key); None: unauthenticated, loopback only
    kv_key: bytes | None = field(default=None, repr=False)
    api_key: str | None = None  # HTTP: required as "Authorization: Bearer KEY" when set
    kv_read_timeout: float = 10.0  # decode: bound on a KV load's handshake and on its READ
    # the address peers reach this instance at; None: the bind host (never a wildcard)
    advertise_host: str | None = None
    drain_timeout: float = 30.0  # after SIGTERM: longest wait for in-flight work and leases
    kv_packing: str = "token"  # how K and V share a head's block (engine/attention.py)
    enable_prefix_caching: bool = False  # the engine's prefix cache (engine/prefix_cache.py)

    def side_channel_advertised(self) -> str:
        """The host decodes are told for this prefill's side channel (ValueError: a
        wildcard bind without ``advertise_host``)."""
        return advertised_host(self.side_channel_host, self.advertise_host,
                               "--side-channel-host")

    def http_advertised(self) -> str:
        """The HTTP host for the ready line and /health (the bind host, a wildcard
        included, when nothing else is known: nobody dials it from there)."""
        if self.advertise_host:
            return advertised_host(self.host, self.advertise_host, "--host")
        return bare_host(self.host)


class PortInUse(OSError):
    """The HTTP port cannot be bound; the message names host and port."""


class Sidecar:
    """One instance: engine, connector (workers + listener), engine loop and metrics.

    Built in that order; :meth:`close` undoes it. The loop thread starts with
    :meth:`start` (the app's lifespan does it).
    """

    def __init__(self, settings: Settings) -> None:
        from kvxfer.engine import LLMEngine

        self.settings = settings
        # checked first: a wildcard side channel without --advertise-host fails fast
        self.side_channel_advertised = settings.side_channel_advertised() \
            if settings.role == "prefill" else bare_host(settings.side_channel_host)
        self.http_host = settings.http_advertised()
        self.draining_since: float | None = None  # monotonic time of the SIGTERM
        self.http_in_flight = 0  # completion requests being answered (streams included)
        self.last_request = 0.0  # monotonic time the last completion request arrived
        self.engine: LLMEngine = LLMEngine.from_model_arg(
            settings.model, seed=settings.seed, tp=settings.tp, layout=settings.kv_cache_layout,
            block_size=settings.block_size, num_blocks=settings.num_blocks,
            dtype=settings.dtype, device=settings.device, kv_packing=settings.kv_packing,
            enable_prefix_caching=settings.enable_prefix_caching,
            # a decode on this host may map a prefill's cache
            # (kvxfer.transfer.converted.mapped_reads)
            cache_zeros=shared_zeros if settings.host_reads and settings.role == "prefill"
            and settings.device == "cpu" else None)
        self.served_names = settings.served_model_names or (self.engine.model_name,)
        self.engine_id = new_engine_id(settings.role)
        self.metrics = SidecarMetrics(role=settings.role, engine_id=self.engine_id,
                                      model=self.served_names[0],
                                      layout=self.engine.layout.name, tp=self.engine.tp)
        self.connector = KVConnector(
            self.engine, settings.role, self.metrics, engine_id=self.engine_id,
            hmac_key=settings.kv_key, side_channel_host=settings.side_channel_host,
            side_channel_port=settings.side_channel_port,
            advertise_host=self.side_channel_advertised, lease_ttl=settings.lease_ttl,
            lease_max_age=settings.lease_max_age,
            failure_policy=settings.kv_load_failure_policy, read_lanes=settings.read_lanes,
            nixl_backends=settings.nixl_backends, kv_read_timeout=settings.kv_read_timeout,
            host_reads=settings.host_reads)
        self.loop = EngineLoop(self.engine, self.connector, self.metrics)
        self.info = ModelInfo(self.served_names, self.engine.tokenizer,
                              self.engine.config.vocab_size, self.engine.max_model_len,
                              self.engine.block_size, settings.role, self.engine.num_blocks)
        self.token_text = TokenText(self.engine.tokenizer)

    def start(self) -> None:
        self.loop.start()

    def close(self) -> None:
        """Stop the engine loop, then the listener and the workers (idempotent)."""
        self.loop.stop()
        self.connector.close()

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def begin_drain(self) -> None:
        """Stop taking new requests; :meth:`drained` says when to exit (idempotent)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            log.info("kvxfer serve: draining (SIGTERM): no new requests; exiting when "
                     "in-flight requests and leases are done, at most in %g s",
                     self.settings.drain_timeout)

    def drained(self) -> bool:
        """Draining and done: nothing in flight, no lease held, no request for
        :data:`DRAIN_QUIET_S`; or ``drain_timeout`` has passed."""
        if self.draining_since is None:
            return False
        now, limit = time.monotonic(), self.settings.drain_timeout
        if now - self.draining_since >= limit:
            log.warning("kvxfer serve: drain timeout (%g s): exiting with %s", limit,
                        self.loop.snapshot())
            return True
        snap = self.loop.snapshot()
        busy = self.http_in_flight or snap.get("requests_in_flight") or snap.get("leases")
        quiet = now - max(self.draining_since, self.last_request) >= min(DRAIN_QUIET_S, limit)
        if not busy and quiet:
            log.info("kvxfer serve: drained in %.1f s", now - self.draining_since)
            return True
        return False

    def describe(self, http_port: int) -> str:
        """The start-up line: role, model, layout, TP, ports, engine id."""
        side = self.connector.side_channel_port
        return (f"role={self.settings.role} model={self.served_names[0]} "
                f"(id {self.engine.model_id}) layout={self.engine.layout.name} "
                f"tp={self.engine.tp} http={self.settings.host}:{http_port} side_channel="
                f"{f'{self.settings.side_channel_host}:{side}' if side else 'none'} "
                f"advertised={self.side_channel_advertised} "
                f"engine_id={self.engine_id}")

    def health(self) -> dict[str, Any]:
        return {"status": "draining" if self.draining else "ok", "role": self.settings.role,
                "engine_id": self.engine_id, "pid": os.getpid(),
                "model": self.served_names[0], "layout": self.engine.layout.name,
                "tp": self.engine.tp, "block_size": self.engine.block_size,
                "max_model_len": self.engine.max_model_len,
                "side_channel_host": self.side_channel_advertised,
                "http_host": self.http_host,
                "side_channel_port": self.connector.side_channel_port,
                "kv_load_failure_policy": self.settings.kv_load_failure_policy,
                "prefix_caching": self.settings.enable_prefix_caching,
                **self.loop.snapshot()}


# -- the app -------------------------------------------------------------------------------

def create_app(settings: Settings, sidecar: Sidecar | None = None) -> FastAPI:
    """The FastAPI app of a sidecar (built from ``settings`` unless given)."""
    side = sidecar if sidecar is not None else Sidecar(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        side.start()
        try:
            yield
        finally:
            side.close()

    app = FastAPI(title="kvxfer sidecar", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.sidecar = side
    handlers = _Handlers(side)
    app.add_api_route(COMPLETIONS, handlers.completions, methods=["POST"])
    app.add_api_route(CHAT, handlers.chat, methods=["POST"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics, methods=["GET"])
    _install_error_handlers(app)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(_CountRequests, side=side)  # outermost: counts 401s too
    return app


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers=headers, media_type=JSON)


def _error(exc: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    return Response(exc.body(), exc.status, headers=headers, media_type=JSON)


def _install_error_handlers(app: FastAPI) -> None:
    async def openai_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return _error(exc)

    async def validation_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(OpenAIError(400, f"invalid request: {first.get('msg', exc)}",
                                  param=param))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            return _error(OpenAIError(404, message, "not_found_error"))
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(OpenAIError(exc.status_code, message, kind))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                  "internal_error"))

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)


class _CountRequests:
    """ASGI middleware: count requests by route (known routes, else "other") and status,
    and the completion requests in flight (what a drain waits for).

    Pure ASGI (no BaseHTTPMiddleware) so that handlers still see the client's
    disconnect through ``receive``.
    """

    def __init__(self, app: ASGIApp, side: Sidecar) -> None:
        self.app, self.side, self.metrics = app, side, side.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        completion = scope["path"] in (COMPLETIONS, CHAT)
        if completion:
            self.side.http_in_flight += 1
            self.side.last_request = time.monotonic()
        try:
            await self.app(scope, receive, counting_send)
        finally:
            if completion:
                self.side.http_in_flight -= 1
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.http_requests.labels(route, str(status)).inc()


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    """Return once the client disconnects (call only after the body was read)."""
    for _ in range(10_000):  # each receive() waits for connection activity
        message = await receive()
        if message["type"] == "http.disconnect":
            return
    await asyncio.Event().wait()  # a client that keeps sending junk: never "gone"


async def _unless_gone(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or :class:`ClientGone` (``work`` cancelled) if the client left."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


class _EventStream(Response):
    """An SSE response that sends ``chunks`` as they come and notices a client leaving.

    ``on_disconnect`` runs when the response ends for any reason; it must abort
    only what did not finish.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 headers: dict[str, str]) -> None:
        self.chunks, self.on_disconnect = chunks, on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({**headers, "cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            await _unless_gone(receive, self._send_all(send))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):  # the client left, or the connection broke
            return
        finally:
            self.on_disconnect()  # aborts whatever did not finish; a no-op after the end

    async def _send_all(self, send: Send) -> None:
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})


class _Handlers:
    """The route handlers of one app."""

    def __init__(self, side: Sidecar) -> None:
        self.side = side
        self.created = int(time.time())

    async def health(self, request: Request) -> Response:
        """200 while the engine loop runs, else 503; details only with the API key."""
        loop = self.side.loop
        if not authenticated(request.scope):
            if self.side.draining:
                return _json({"status": "draining"}, 503, {DRAINING_HEADER: "1"})
            return _json({"status": "ok" if loop.running else "error"},
                         200 if loop.running else 503)
        if not loop.running:
            return _json({"status": "error", "role": self.side.settings.role,
                          "error": loop.error or "the engine loop is not running"}, 503)
        if self.side.draining:
            return _json(self.side.health(), 503, {DRAINING_HEADER: "1"})
        return _json(self.side.health())

    async def models(self) -> Response:
        return _json({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "kvxfer",
             "root": self.side.engine.model_name, "max_model_len": self.side.engine.max_model_len}
            for name in self.side.served_names]})

    async def metrics(self) -> Response:
        return Response(self.side.metrics.render(), media_type=CONTENT_TYPE)

    def _refuse_draining(self) -> Response:
        """503 for a new request while draining; the header tells a proxy that nothing
        was started (a decode left the lease alone), so another instance may take it."""
        return _error(OpenAIError(503, "this instance is draining (shutting down): send "
                                       "the request to another instance",
                                  "service_unavailable"), {DRAINING_HEADER: "1"})

    async def completions(self, request: Request) -> Response:
        if self.side.draining:
            return self._refuse_draining()
        raw = await request.body()
        prepared = self._prepare(raw, lambda: prepare_completion(
            decode_body(raw, CompletionRequest), self.side.info))
        return await self._answer(request, prepared)

    async def chat(self, request: Request) -> Response:
        if self.side.draining:
            return self._refuse_draining()
        raw = await request.body()
        prepared = self._prepare(raw, lambda: prepare_chat(decode_body(raw, ChatRequest),
                                                           self.side.info))
        return await self._answer(request, prepared)

    def _prepare(self, raw: bytes, prepare: Callable[[], Prepared]) -> Prepared:
        """``prepare()``; when it refuses the request, release the lease it names."""
        try:
            return prepare()
        except OpenAIError as exc:
            remote = unread_lease(raw, self.side.settings.role)
            if remote is not None:
                self.side.connector.release_remote(
                    remote, f"the decode refused the request ({exc.status}): {exc.message}")
            raise

    async def _answer(self, request: Request, prepared: Prepared) -> Response:
        base = _request_id(request)
        headers = {"x-request-id": base}
        loop = self.side.loop
        ids = loop.reserve_ids(base, prepared.num_choices)
        submissions = _submissions(prepared, ids)
        sink = Sink(asyncio.get_running_loop())
        try:
            loop.submit(submissions, sink)
        except EngineStopped as exc:
            loop.release_ids(ids)
            if prepared.remote is not None:
                self.side.connector.release_remote(prepared.remote,
                                                   f"the decode is not serving: {exc}")
            return _error(OpenAIError(503, str(exc), "service_unavailable"), headers)
        answer = _Answer(self.side, prepared, ids, sink, base)
        try:
            if prepared.stream:
                return await answer.stream(request.receive, headers)
            return await answer.whole(request.receive, headers)
        except ClientGone:
            answer.abort()
            return Response(status_code=499)  # nobody reads it; counted in metrics
        except asyncio.CancelledError:  # the server is shutting down
            answer.abort()
            raise


def _submissions(prepared: Prepared, ids: list[str]) -> list[Submission]:
    """One submission per choice (``ids[k]`` is choice ``k``); a decode request's ``n``
    samples are one submission whose siblings start from its single KV read."""
    params = prepared.choice_params
    if prepared.remote is not None:
        siblings = tuple(Sibling(ids[k], k, params(k)) for k in range(1, len(ids)))
        return [Submission(ids[0], 0, prepared.prompts[0], params(0), remote=prepared.remote,
                           siblings=siblings)]
    return [Submission(rid, k, prepared.prompts[k // prepared.n], params(k), hold=prepared.hold)
            for k, rid in enumerate(ids)]


def _request_id(request: Request) -> str:
    """The client's X-Request-Id when it is usable, else a fresh one."""
    given = request.headers.get("x-request-id", "").strip()
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable():
        return given
    return uuid.uuid4().hex


class _Answer:
    """Collects one HTTP request's events into a JSON answer or an SSE stream."""

    def __init__(self, side: Sidecar, prepared: Prepared, ids: list[str], sink: Sink,
                 base: str) -> None:
        self.side, self.prepared, self.ids, self.sink = side, prepared, ids, sink
        self.response_id = f"{'chatcmpl' if prepared.chat else 'cmpl'}-{base}"
        self.created = int(time.time())
        self.choices = [Choice(k, k // prepared.n, prepared.echo_text(k))
                        for k in range(len(ids))]
        self.open = set(range(len(ids)))  # choices without a final event yet

    def abort(self) -> None:
        """Abort the choices still running (the client left, or another choice failed)."""
        self.sink.closed = True
        running = [self.ids[i] for i in sorted(self.open)]
        if running:
            self.side.loop.abort(running)
        self.open.clear()

    async def _next(self) -> Event:
        event = await self.sink.queue.get()
        if event.final:
            self.open.discard(event.index)
        return event

    def _failure(self, failure: Failure, headers: dict[str, str]) -> Response:
        self.abort()
        return _error(OpenAIError(failure.status, failure.message, failure.kind), headers)

    async def whole(self, receive: Receive, headers: dict[str, str]) -> Response:
        async def collect() -> Failure | None:
            for _ in range(self.prepared.params.max_tokens * len(self.ids) + len(self.ids)):
                if not self.open:
                    return None
                event = await self._next()
                if event.failure is not None:
                    return event.failure
                assert event.output is not None
                self.choices[event.index].add(event.output)
                self.choices[event.index].kv_transfer_params = event.kv_transfer_params
            return Failure(500, "the engine sent more outputs than tokens", "internal_error")

        failure = await _unless_gone(receive, collect())
        if failure is not None:
            return self._failure(failure, headers)
        build = chat_body if self.prepared.chat else completion_body
        return _json(build(self.response_id, self.created, self.prepared.model, self.choices,
                           self.prepared, self.side.token_text), headers=headers)

    async def stream(self, receive: Receive, headers: dict[str, str]) -> Response:
        # Wait for the first event before answering, so that a failure before any
        # token (a refused request, a failed KV read) still gets a real HTTP status.
        first = await _unless_gone(receive, self._next())
        if first.failure is not None:
            return self._failure(first.failure, headers)
        return _EventStream(self._chunks(first), self.abort, headers)

    async def _chunks(self, first: Event) -> AsyncIterator[bytes]:
        if self.prepared.chat:
            for choice in self.choices:
                yield sse(chat_chunk(self.response_id, self.created, self.prepared.model,
                                     choice.index, {"role": "assistant", "content": ""}, None,
                                     None))
        elif self.prepared.echo is not None:  # the prompt comes first, as in the whole answer
            for choice in self.choices:
                yield sse(completion_chunk(self.response_id, self.created, self.prepared.model,
                                           choice.index, choice.echo, None, None))
        event: Event | None = first
        limit = self.prepared.params.max_tokens * len(self.ids) + len(self.ids)
        for _ in range(limit):
            if event is None:
                if not self.open:
                    break
                event = await self._next()
            if event.failure is not None:
                self.abort()
                yield sse(error_body(event.failure.status, event.failure.message,
                                     event.failure.kind))
                break
            chunk = self._chunk(event)
            if chunk is not None:
                yield sse(chunk)
            event = None
        if self.prepared.include_usage:
            yield sse(usage_chunk(self.response_id, self.created, self.prepared.model,
                                  self.prepared.chat, self.choices))
        yield SSE_DONE

    def _chunk(self, event: Event) -> dict[str, Any] | None:
        """The SSE chunk for one output (None when it has nothing to show yet)."""
        assert event.output is not None
        output, choice = event.output, self.choices[event.index]
        prior = list(choice.token_ids)
        choice.add(output)
        if not (output.new_text or output.finished or (self.prepared.logprobs
                                                       and output.logprobs)):
            return None
        names = self.side.token_text
        reason = output.finish_reason if output.finished else None
        p = self.prepared
        if p.chat:
            logprobs = chat_logprobs(output.logprobs, names) if p.logprobs else None
            delta = {"content": output.new_text} if output.new_text or not output.finished \
                else {}
            return chat_chunk(self.response_id, self.created, p.model, event.index, delta,
                              logprobs, reason)
        logprobs = completion_logprobs(output.logprobs, prior, names) if p.logprobs else None
        return completion_chunk(self.response_id, self.created, p.model, event.index,
                                output.new_text, logprobs, reason)


# -- running it ---------------------------------------------------------------------------

def bind_http(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for the HTTP server (PortInUse names the port)."""
    try:
        sock = listen_tcp(host, port)
    except OSError as exc:
        raise PortInUse(f"cannot listen on {host}:{port} (HTTP port {port}): "
                        f"{exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class _Interrupted(BaseException):
    """SIGINT/SIGTERM while the sidecar was still starting."""


def serve(settings: Settings, ready: Callable[[str], None] | None = None) -> None:
    """Run a sidecar until SIGINT/SIGTERM; ``ready(line)`` once it accepts requests.

    Raises PortInUse, OSError (side channel), ValueError / CheckpointError (bad
    settings) before serving anything.
    """
    sock = bind_http(settings.host, settings.port)
    port = sock.getsockname()[1]
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise _Interrupted(signal.Signals(signum).name)

    side: Sidecar | None = None
    try:
        for sig in previous:
            signal.signal(sig, interrupt)
        side = Sidecar(settings)
        log.info("kvxfer serve: %s", side.describe(port))
        if settings.kv_key is None and settings.role != "both":
            log.warning("kvxfer serve: no --kv-key-file: the KV side channel, NIXL "
                        "notifications and lease tickets are unauthenticated; anyone who "
                        "reaches %s may read, free or overwrite leased KV. Use this only on "
                        "loopback or a network you trust completely",
                        side.side_channel_advertised if settings.role == "prefill"
                        else "this decode's HTTP port")
        if settings.api_key is None:
            log.warning("kvxfer serve: no --api-key: anyone who reaches %s:%d may use this "
                        "sidecar's HTTP API", settings.host, port)
        app = create_app(settings, side)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        http = f"[{side.http_host}]" if ":" in side.http_host else side.http_host
        line = f"kvxfer serve ready: http://{http}:{port} {side.describe(port)}"
        server = _Server(config, lambda: (ready or _print_ready)(line), side)

        def stop_server(_signum: int, _frame: FrameType | None) -> None:
            # Before uvicorn takes over the signals this makes it stop right after its
            # start-up; after, uvicorn restores this handler and re-raises into it.
            server.should_exit = True

        for sig in previous:
            signal.signal(sig, stop_server)
        server.run(sockets=[sock])
    except _Interrupted as exc:
        log.info("kvxfer serve: %s during start-up, stopping", exc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if side is not None:
            side.close()
        sock.close()


def _print_ready(line: str) -> None:
    print(line, flush=True)


class _Server(uvicorn.Server):
    """uvicorn's Server, announcing readiness once the socket accepts requests; the
    first SIGTERM drains the sidecar (see the module docstring) instead of stopping."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None],
                 side: Sidecar) -> None:
        super().__init__(config)
        self.on_ready, self.side = on_ready, side

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.side.draining and not self.should_exit:
            self.side.begin_drain()  # on_tick ends the server once drained
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.side.drained()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_ready()
