"""The proxy's FastAPI app: routes, error bodies, and what lives for the app's lifetime.

``create_app(config)`` builds an app that owns its own balancer, metrics
registry, pooled HTTP client and health checker, so several apps can run in
one process (tests do). The client and checker exist between lifespan start
and end; the first health round finishes before the app takes requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from kvxfer.net.api_key import authenticated
from proxy.balancer import Balancer, Instance, Split
from proxy.config import ROLES, ConfigError, ProxyConfig
from proxy.contract import CHAT_COMPLETIONS, COMPLETIONS, parse_client_body
from proxy.discovery import Discovery, resolver_for
from proxy.errors import CLIENT_CLOSED, ProxyError, UpstreamRejected, error_body
from proxy.event_streams import KVEvents, static_streams
from proxy.health import HealthChecker
from proxy.metrics import ProxyMetrics
from proxy.middleware import (
    ApiKeyMiddleware,
    MetricsMiddleware,
    RequestIdMiddleware,
    request_id,
)
from proxy.pd_watch import PDWatch
from proxy.prompts import Prompts, TokenizerError, load_tokenizer
from proxy.relay import ClientDisconnected, unless_disconnected
from proxy.router import PDRouter
from proxy.upstream import Upstream, new_client, upstream_auth

ROUTES: tuple[str, ...] = (COMPLETIONS, CHAT_COMPLETIONS, "/v1/models", "/health", "/metrics")
JSON = "application/json"
log = logging.getLogger(__name__)


class ProxyService:
    """The state of one app. ``router`` exists only while the app is running."""

    def __init__(self, config: ProxyConfig, prompts: Prompts | None = None) -> None:
        self.config = config
        try:
            static = static_streams(config.kv_events)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.kv_events = KVEvents(config.kv_key, self._count_kv_message, static)
        self.balancer = Balancer(config, self.kv_events)
        self.metrics = ProxyMetrics(self.balancer, ROUTES)
        self.prompts = prompts or Prompts(None)
        self.watch = PDWatch(lambda p, d: self.metrics.pd_unread.labels(p, d).inc())
        self.resolve = resolver_for(config.hosts_file)  # DNS names (proxy.discovery)
        self._router: PDRouter | None = None

    @property
    def router(self) -> PDRouter:
        if self._router is None:
            raise RuntimeError("the proxy app is not running (lifespan not started)")
        return self._router

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        async with new_client(self.config) as session:
            checker = HealthChecker(self.balancer, session, self.config.health_interval,
                                    self.config.connect_timeout, upstream_auth(self.config),
                                    self.config.health_timeout, self.config.health_failures,
                                    self.kv_events.observe)
            discovery = Discovery(self.balancer, self.config, self.resolve)
            await discovery.refresh()
            await checker.check_all()
            self._router = PDRouter(self.balancer, Upstream(session, self.config, self.metrics),
                                    self.metrics, self.config.retries,
                                    push=self.config.transfer_mode == "push",
                                    prompts=self.prompts,
                                    split=Split(self.config.pd_min_tokens,
                                                self.config.prefill_saturated_tokens),
                                    watch=self.watch)
            tasks = [asyncio.create_task(checker.run())]
            if discovery.active:
                tasks.append(asyncio.create_task(discovery.run(checker.check)))
            try:
                yield
            finally:
                checker.stop()
                discovery.stop()
                await asyncio.gather(*tasks)
                await self.kv_events.close()
                self._router = None

    def _instance_state(self, instance: Instance) -> dict[str, Any]:
        state = instance.state()
        kv = self.kv_events.state(instance.url)
        if kv is not None:
            state["kv_events"] = kv
        return state

    def _count_kv_message(self, url: str, outcome: str) -> None:
        self.metrics.kv_events.labels(url, outcome).inc()

    async def complete(self, request: Request, route: str) -> Response:
        """A completion request: parse, then prefill + decode unless the client leaves."""
        try:
            raw = await request.body()
            body = parse_client_body(raw)
            work = self.router.complete(route, body, request_id(request.scope))
            return await unless_disconnected(request.receive, work)
        except (ClientDisconnect, ClientDisconnected):
            self.metrics.client_disconnects.labels(route).inc()
            return Response(status_code=CLIENT_CLOSED)  # the server drops it: nobody listens

    def health(self, request: Request) -> Response:
        """200 when each role has a healthy instance, else 503; every instance's state
        too, but only for a caller with the API key (the URLs map the cluster)."""
        ready = all(self.balancer.has_healthy(role) for role in ROLES)
        body: dict[str, object] = {"status": "ok" if ready else "unavailable"}
        alarms = self.watch.state()
        if alarms:  # that P/D is not happening is said to all, between whom only with the key
            body["pd_not_happening"] = len(alarms)
        if authenticated(request.scope):
            body.update(policy=self.balancer.policy,
                        instances=[self._instance_state(i) for i in self.balancer.instances()])
            if alarms:
                body["pd_not_happening"] = alarms
        return Response(msgspec.json.encode(body), 200 if ready else 503, media_type=JSON)


def create_app(config: ProxyConfig) -> FastAPI:
    """A proxy app for ``config``; serve it with uvicorn (lifespan on). ConfigError when
    its ``--tokenizer`` cannot be loaded or a ``--kv-events`` value is malformed."""
    try:
        service = ProxyService(config, Prompts(load_tokenizer(config.tokenizer)))
    except TokenizerError as exc:
        raise ConfigError(f"--tokenizer {config.tokenizer}: {exc}") from None
    app = FastAPI(title="kvxfer proxy", lifespan=service.lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.service = service

    # Plain Starlette routes: an endpoint takes the Request and returns a Response, so
    # FastAPI's per-request dependency solving and validation would only add latency.
    async def completions(request: Request) -> Response:
        return await service.complete(request, COMPLETIONS)

    async def chat_completions(request: Request) -> Response:
        return await service.complete(request, CHAT_COMPLETIONS)

    async def models(request: Request) -> Response:
        return await service.router.models(request_id(request.scope))

    async def health(request: Request) -> Response:
        return service.health(request)

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_route(COMPLETIONS, completions, methods=["POST"])
    app.add_route(CHAT_COMPLETIONS, chat_completions, methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    add_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    else:
        log.warning("no --api-key: every client may use this proxy")
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=service.metrics)  # outermost: sees all
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error a client sees is OpenAI-shaped, except upstream 4xx passed through."""

    async def proxy_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProxyError)
        return Response(exc.body(), exc.status, media_type=JSON)

    async def upstream_rejected(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, UpstreamRejected)
        return Response(exc.content, exc.status, media_type=exc.content_type)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return Response(error_body(exc.status_code, message, "invalid_request_error"),
                        exc.status_code, media_type=JSON, headers=exc.headers)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = f"internal error: {type(exc).__name__}"  # no traceback, no internals
        return Response(error_body(500, message, "internal_error"), 500, media_type=JSON)

    app.add_exception_handler(ProxyError, proxy_error)
    app.add_exception_handler(UpstreamRejected, upstream_rejected)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
