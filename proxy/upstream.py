"""Calls from the proxy to one instance, over the app's one pooled ``aiohttp.ClientSession``.

Every failure becomes one exception: :class:`Unreachable` and :class:`Draining` (nothing
sent or started: try another instance), :class:`~proxy.errors.UpstreamRejected` (4xx) and
:class:`~proxy.errors.UpstreamFailed` (502 or 504, naming the stage and the URL).

Design: docs/design/proxy.md#calling-one-instance
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
import msgspec

from kvxfer.net.hosts import DRAINING_HEADER
from proxy.balancer import Instance
from proxy.config import ProxyConfig
from proxy.errors import (
    UpstreamRejected,
    bad_gateway,
    upstream_failed,
    upstream_timeout,
)
from proxy.metrics import ProxyMetrics

# Connections in the pool, all instances together; well above the concurrency one
# proxy process serves.
MAX_CONNECTIONS = 1024
# How long (seconds) an idle connection is kept for reuse: below the 5 s after which
# uvicorn (the sidecars' server, and vLLM's) closes an idle connection, so that the
# proxy never sends a request on a connection the sidecar is closing at that moment.
KEEPALIVE_S = 4.0
# How much of an upstream's error answer goes into the proxy's message.
EXCERPT_CHARS = 300

# What a failed call is called in messages, by what happened.
CONNECT_ERROR = "ConnectError"  # refused, unreachable host: nothing was sent
CONNECT_TIMEOUT = "ConnectTimeout"
READ_TIMEOUT = "ReadTimeout"  # no answer, or no next chunk, within request_timeout
PROTOCOL_ERROR = "RemoteProtocolError"  # connection closed or answer malformed midway
READ_ERROR = "ReadError"  # the socket failed (reset) after the request was sent


class Unreachable(Exception):
    """Connecting to ``instance`` failed; no byte of the request was sent."""

    def __init__(self, instance: Instance, reason: str) -> None:
        super().__init__(f"{instance.role} instance {instance.url}: {reason}")
        self.instance = instance
        self.reason = reason


class Draining(Unreachable):
    """``instance`` is draining: it refused the call before starting anything."""


def _draining(status: int, headers: Mapping[str, str]) -> bool:
    return status == 503 and DRAINING_HEADER in headers


@dataclass(frozen=True)
class Answer:
    """A whole upstream answer: status, ``content-type`` header value, body bytes."""

    status: int
    content_type: str
    content: bytes


def new_client(config: ProxyConfig) -> aiohttp.ClientSession:
    """The pooled session an app shares across all its requests and health checks.

    Create it on the app's event loop (inside the lifespan). Calls default to
    ``config``'s connect timeout and no read bound; :class:`Upstream` and the
    health checker pass their own bounds per call.
    """
    connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, limit_per_host=0,
                                     keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout),
        # Environment proxy settings must never reroute calls to the sidecars.
        trust_env=False,
        # Streams are relayed byte for byte, so ask for them uncompressed and never decode.
        auto_decompress=False, headers={"accept-encoding": "identity"})


def failure_name(exc: BaseException) -> str:
    """What happened to a call that raised ``exc`` (one of the names above)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return CONNECT_TIMEOUT
    if isinstance(exc, aiohttp.ClientConnectorError):
        return CONNECT_ERROR
    if isinstance(exc, asyncio.TimeoutError):
        return READ_TIMEOUT
    if isinstance(exc, aiohttp.ClientOSError):
        return READ_ERROR
    return PROTOCOL_ERROR


def error_excerpt(content: bytes) -> str:
    """The ``error.message`` of an OpenAI-style body, else the start of the body as text."""
    try:
        message = msgspec.json.decode(content)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        message = None
    if not isinstance(message, str):
        message = content.decode("utf-8", "replace")
    return message[:EXCERPT_CHARS] or "(empty body)"


class Upstream:
    """Sends calls to instances and reports failures as the exceptions above."""

    def __init__(self, session: aiohttp.ClientSession, config: ProxyConfig,
                 metrics: ProxyMetrics) -> None:
        self.session = session
        self.request_timeout = config.request_timeout
        self.metrics = metrics
        # a prefill computes one token: its bound is the tighter of the two
        self.prefill_timeout = min(config.prefill_timeout, config.request_timeout)
        self._auth = upstream_auth(config)
        # A whole answer within request_timeout (a prefill's within prefill_timeout); a
        # stream's headers and each chunk within request_timeout.
        self._whole = aiohttp.ClientTimeout(total=config.request_timeout,
                                            sock_connect=config.connect_timeout)
        self._prefill = aiohttp.ClientTimeout(total=self.prefill_timeout,
                                              sock_connect=config.connect_timeout)
        self._per_read = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout,
                                               sock_read=config.request_timeout)

    async def fetch(self, instance: Instance, method: str, path: str, request_id: str,
                    content: bytes | None = None) -> Answer:
        """One whole (non-streamed) call, bounded in total by ``prefill_timeout`` for a
        prefill instance (it computes one token), else by ``request_timeout``.

        Returns only a 2xx answer. Cancelling the caller closes the connection,
        which is how the instance learns that nobody waits for the answer.
        """
        start = time.perf_counter()
        try:
            async with self.session.request(method, instance.url + path, data=content,
                                            headers=self._headers(request_id, content),
                                            timeout=self._timeout(instance)) as response:
                answer = Answer(response.status, _content_type(response),
                                await response.read())
                draining = _draining(response.status, response.headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self.failure(instance, exc, self._limit(instance)) from exc
        self.observe(instance, start)
        if draining:
            raise self.draining(instance)
        if not 200 <= answer.status < 300:
            raise self._rejection(instance, answer)
        return answer

    async def open_stream(self, instance: Instance, path: str, request_id: str,
                          content: bytes) -> OpenStream:
        """Send a call and return its 2xx answer with the body still to be read.

        The caller must ``aclose()`` it. The wait for the headers, and later for
        each chunk, is bounded by ``request_timeout``.
        """
        start = time.perf_counter()
        try:
            response = await self.session.request("POST", instance.url + path, data=content,
                                                  headers=self._headers(request_id, content),
                                                  timeout=self._per_read)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self.failure(instance, exc) from exc
        if 200 <= response.status < 300:
            return OpenStream(self, instance, response, start)
        if _draining(response.status, response.headers):
            response.release()
            raise self.draining(instance)
        try:
            answer = Answer(response.status, _content_type(response), await response.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self.failure(instance, exc) from exc
        finally:
            response.release()  # back to the pool if read to the end, else closed
        raise self._rejection(instance, answer)

    def draining(self, instance: Instance) -> Draining:
        """What reports a draining instance's 503 (the caller tries the next one)."""
        self._error(instance, "draining", "draining (answered 503: shutting down)")
        return Draining(instance, "draining (shutting down)")

    def _timeout(self, instance: Instance) -> aiohttp.ClientTimeout:
        return self._prefill if instance.role == "prefill" else self._whole

    def _limit(self, instance: Instance) -> float:
        """Seconds a whole answer of ``instance`` may take."""
        return self.prefill_timeout if instance.role == "prefill" else self.request_timeout

    def _headers(self, request_id: str, content: bytes | None) -> dict[str, str]:
        headers = {"x-request-id": request_id, **self._auth}
        if content is not None:
            headers["content-type"] = "application/json"
        return headers

    def observe(self, instance: Instance, start: float) -> None:
        """Record a finished call (``start`` from ``time.perf_counter()``)."""
        self.metrics.upstream_latency.labels(instance.role, instance.url).observe(
            time.perf_counter() - start)

    def _error(self, instance: Instance, kind: str, detail: str | None) -> None:
        """Count a failed call; ``detail`` (None for a client error) becomes ``last_error``."""
        self.metrics.upstream_errors.labels(instance.role, instance.url, kind).inc()
        if detail is not None:
            instance.last_error = detail

    def failure(self, instance: Instance, exc: BaseException,
                limit: float | None = None) -> Exception:
        """The exception that reports ``exc`` from a call to ``instance`` whose wait was
        bounded by ``limit`` seconds (default ``request_timeout``)."""
        who = f"{instance.role} instance {instance.url}"
        name = failure_name(exc)
        detail = f"{name}: {exc}" if str(exc) else name
        if name in (CONNECT_ERROR, CONNECT_TIMEOUT):
            self._error(instance, "unreachable", detail)
            return Unreachable(instance, detail)
        if name == READ_TIMEOUT:
            limit = self.request_timeout if limit is None else limit
            self._error(instance, "timeout", f"no answer within {limit:g} s")
            return upstream_timeout(instance.role, instance.url,
                                    f"{who} did not answer within {limit:g} s ({name})")
        self._error(instance, "broken", detail)
        return upstream_failed(instance.role, instance.url, f"{who} failed: {detail}")

    def _rejection(self, instance: Instance, answer: Answer) -> Exception:
        """What reports a non-2xx answer: a 4xx passes through, anything else is a 502."""
        status = answer.status
        if status == 401:  # the proxy, not the client, authenticates to the sidecars
            self._error(instance, "unauthorized", "answered HTTP 401: the proxy's key is "
                                                  "missing or wrong")
            return bad_gateway(f"{instance.role} instance {instance.url} refused the proxy "
                               f"(HTTP 401): give the proxy the sidecars' key with "
                               f"--upstream-api-key")
        if 400 <= status < 500:
            self._error(instance, "rejected", None)
            return UpstreamRejected(status, answer.content, answer.content_type,
                                    instance.role, instance.url)
        self._error(instance, f"http_{status}", f"answered HTTP {status}")
        return upstream_failed(instance.role, instance.url,
                               f"{instance.role} instance {instance.url} answered HTTP {status}: "
                               f"{error_excerpt(answer.content)}")


def upstream_auth(config: ProxyConfig) -> dict[str, str]:
    """The ``Authorization`` header every call to a sidecar carries (none without a key)."""
    key = config.upstream_api_key
    return {} if key is None else {"authorization": f"Bearer {key}"}


def _content_type(response: aiohttp.ClientResponse) -> str:
    return response.headers.get("content-type", "application/json")


class OpenStream:
    """A 2xx answer whose body is still arriving, from :meth:`Upstream.open_stream`."""

    def __init__(self, upstream: Upstream, instance: Instance,
                 response: aiohttp.ClientResponse, start: float) -> None:
        self.upstream = upstream
        self.instance = instance
        self.response = response
        self.start = start  # time.perf_counter() when the call was sent

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def media_type(self) -> str:
        return self.response.headers.get("content-type", "text/event-stream").split(";")[0]

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, byte for byte; a failure midway is a ProxyError."""
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self.upstream.failure(self.instance, exc) from exc

    async def aclose(self) -> None:
        """Free the connection (closed if the body is unfinished); record the call's latency."""
        self.response.release()
        self.upstream.observe(self.instance, self.start)
