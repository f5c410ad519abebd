"""What happens to every HTTP request before and after its route: pure ASGI middleware.

From the outside in: :class:`MetricsMiddleware` (counts every answer, 401s
included), :class:`RequestIdMiddleware` (the ``X-Request-Id`` both upstream
calls carry and the answer echoes), :class:`ApiKeyMiddleware` (bearer token, shared
with the sidecars: :mod:`kvxfer.net.api_key`).
Pure ASGI rather than Starlette's ``BaseHTTPMiddleware`` so that streamed
bodies pass through unbuffered and routes see the server's own ``receive``.
"""

from __future__ import annotations

import time
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvxfer.net.api_key import ApiKeyMiddleware
from proxy.errors import CLIENT_CLOSED
from proxy.metrics import ProxyMetrics

__all__ = ["ApiKeyMiddleware", "MetricsMiddleware", "RequestIdMiddleware", "request_id"]

REQUEST_ID_HEADER = "x-request-id"
# Where RequestIdMiddleware leaves the id for the routes.
SCOPE_REQUEST_ID = "kvxfer_proxy.request_id"


def request_id(scope: Scope) -> str:
    """The request id :class:`RequestIdMiddleware` chose for this request."""
    return str(scope[SCOPE_REQUEST_ID])


class RequestIdMiddleware:
    """Keep the client's ``X-Request-Id`` or make one (a UUID4), and echo it on the answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get(REQUEST_ID_HEADER) or str(uuid.uuid4())
        scope[SCOPE_REQUEST_ID] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []),
                           (REQUEST_ID_HEADER.encode(), rid.encode("latin-1"))]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class MetricsMiddleware:
    """Requests by route and status, requests in flight, time to the first body byte."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.metrics.route_label(scope["path"])
        start = time.perf_counter()
        status = 500  # what the server answers if the app fails before starting a response
        first_byte = True

        async def send_observed(message: Message) -> None:
            nonlocal status, first_byte
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and first_byte and (
                    message.get("body") or not message.get("more_body", False)):
                first_byte = False
                if status != CLIENT_CLOSED:
                    self.metrics.time_to_first_byte.labels(route).observe(
                        time.perf_counter() - start)
            await send(message)

        in_flight = self.metrics.in_flight.labels(route)
        in_flight.inc()
        try:
            await self.app(scope, receive, send_observed)
        finally:
            in_flight.dec()
            self.metrics.requests.labels(route, str(status)).inc()
