"""Calls from the proxy to one instance, over the app's one pooled ``httpx.AsyncClient``.

This module turns every way a call can fail into one exception:

- :class:`Unreachable`: no connection could be opened, so nothing was sent and
  the caller may safely try another instance of the role;
- :class:`~proxy.errors.UpstreamRejected`: the instance answered 4xx (passed
  through to the client unchanged);
- :class:`~proxy.errors.ProxyError` 502 (5xx, broken connection) or 504
  (timeout), its message naming the stage ("prefill" / "decode") and the URL.

The stage of a call is the role of the instance it goes to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import msgspec

from proxy.balancer import Instance
from proxy.config import ProxyConfig
from proxy.errors import UpstreamRejected, bad_gateway, gateway_timeout
from proxy.metrics import ProxyMetrics

# Connections per instance; well above the concurrency one proxy process serves.
MAX_CONNECTIONS = 1024
MAX_KEEPALIVE = 256
# How much of an upstream's error answer goes into the proxy's message.
EXCERPT_CHARS = 300


class Unreachable(Exception):
    """Connecting to ``instance`` failed; no byte of the request was sent."""

    def __init__(self, instance: Instance, reason: str) -> None:
        super().__init__(f"{instance.role} instance {instance.url}: {reason}")
        self.instance = instance
        self.reason = reason


def new_client(config: ProxyConfig) -> httpx.AsyncClient:
    """The pooled client an app shares across all its requests and health checks.

    Each instance gets a connection pool of its own (``mounts``): httpcore's pool
    bookkeeping costs O(connections^2) per call, so one pool for every instance
    would slow all calls down as the total connection count grows.
    """
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_KEEPALIVE)
    urls = [*config.prefill_urls, *config.decode_urls]
    return httpx.AsyncClient(
        timeout=httpx.Timeout(config.request_timeout, connect=config.connect_timeout),
        limits=limits,
        mounts={url: httpx.AsyncHTTPTransport(limits=limits) for url in urls},
        # Environment proxy settings must never reroute calls to the sidecars.
        trust_env=False,
        # Streams are relayed byte for byte, so ask for them uncompressed.
        headers={"accept-encoding": "identity"})


class Upstream:
    """Sends calls to instances and reports failures as the exceptions above."""

    def __init__(self, client: httpx.AsyncClient, config: ProxyConfig,
                 metrics: ProxyMetrics) -> None:
        self.client = client
        self.request_timeout = config.request_timeout
        self.metrics = metrics

    async def fetch(self, instance: Instance, method: str, path: str, request_id: str,
                    content: bytes | None = None) -> httpx.Response:
        """One whole (non-streamed) call, bounded by ``request_timeout`` in total.

        Returns only a 2xx answer with its body read.
        """
        request = self._request(instance, method, path, request_id, content)
        start = time.perf_counter()
        try:
            response = await asyncio.wait_for(self.client.send(request), self.request_timeout)
        except (httpx.TransportError, asyncio.TimeoutError) as exc:
            raise self.failure(instance, exc) from exc
        self.observe(instance, start)
        if not response.is_success:
            raise self._rejection(instance, response)
        return response

    async def open_stream(self, instance: Instance, path: str, request_id: str,
                          content: bytes) -> OpenStream:
        """Send a call and return its 2xx answer with the body still to be read.

        The caller must ``aclose()`` it. The wait for the headers, and later for
        each chunk, is bounded by ``request_timeout``.
        """
        request = self._request(instance, "POST", path, request_id, content)
        start = time.perf_counter()
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise self.failure(instance, exc) from exc
        if response.is_success:
            return OpenStream(self, instance, response, start)
        try:
            await response.aread()
        except httpx.TransportError as exc:
            raise self.failure(instance, exc) from exc
        finally:
            await response.aclose()
        raise self._rejection(instance, response)

    def _request(self, instance: Instance, method: str, path: str, request_id: str,
                 content: bytes | None) -> httpx.Request:
        headers = {"x-request-id": request_id}
        if content is not None:
            headers["content-type"] = "application/json"
        return self.client.build_request(method, instance.url + path, content=content,
                                         headers=headers)

    def observe(self, instance: Instance, start: float) -> None:
        """Record a finished call (``start`` from ``time.perf_counter()``)."""
        self.metrics.upstream_latency.labels(instance.role, instance.url).observe(
            time.perf_counter() - start)

    def _error(self, instance: Instance, kind: str, detail: str | None) -> None:
        """Count a failed call; ``detail`` (None for a client error) becomes ``last_error``."""
        self.metrics.upstream_errors.labels(instance.role, instance.url, kind).inc()
        if detail is not None:
            instance.last_error = detail

    def failure(self, instance: Instance, exc: Exception) -> Exception:
        """The exception that reports ``exc`` from a call to ``instance``."""
        who = f"{instance.role} instance {instance.url}"
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            self._error(instance, "unreachable", detail)
            return Unreachable(instance, detail)
        if isinstance(exc, (asyncio.TimeoutError, httpx.TimeoutException)):
            self._error(instance, "timeout", f"no answer within {self.request_timeout:g} s")
            return gateway_timeout(f"{who} did not answer within {self.request_timeout:g} s "
                                   f"({type(exc).__name__})")
        self._error(instance, "broken", detail)
        return bad_gateway(f"{who} failed: {detail}")

    def _rejection(self, instance: Instance, response: httpx.Response) -> Exception:
        """What reports a non-2xx answer: a 4xx passes through, anything else is a 502."""
        status = response.status_code
        if 400 <= status < 500:
            self._error(instance, "rejected", None)
            return UpstreamRejected(status, response.content,
                                    response.headers.get("content-type", "application/json"),
                                    instance.role, instance.url)
        self._error(instance, f"http_{status}", f"answered HTTP {status}")
        return bad_gateway(f"{instance.role} instance {instance.url} answered HTTP {status}: "
                          f"{error_excerpt(response.content)}")


def error_excerpt(content: bytes) -> str:
    """The ``error.message`` of an OpenAI-style body, else the start of the body as text."""
    try:
        message = msgspec.json.decode(content)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        message = None
    if not isinstance(message, str):
        message = content.decode("utf-8", "replace")
    return message[:EXCERPT_CHARS] or "(empty body)"



class OpenStream:
    """A 2xx answer whose body is still arriving, from :meth:`Upstream.open_stream`."""

    def __init__(self, upstream: Upstream, instance: Instance, response: httpx.Response,
                 start: float) -> None:
        self.upstream = upstream
        self.instance = instance
        self.response = response
        self.start = start  # time.perf_counter() when the call was sent

    @property
    def media_type(self) -> str:
        return str(self.response.headers.get("content-type", "text/event-stream")).split(";")[0]

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, byte for byte; a failure midway is a ProxyError."""
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            raise self.upstream.failure(self.instance, exc) from exc

    async def aclose(self) -> None:
        """Close the connection if the body is unfinished; record the call's latency."""
        await self.response.aclose()
        self.upstream.observe(self.instance, self.start)
