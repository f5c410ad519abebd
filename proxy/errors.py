"""Errors the proxy answers with, in the OpenAI shape.

Every failure a client can see is a :class:`ProxyError` (or an upstream answer
passed through unchanged). The body is ``{"error": {"message", "type", "param",
"code"}}`` with ``code`` the HTTP status, as the sidecars answer.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Not an HTTP standard status: nginx's "client closed request". Recorded in
# metrics for requests whose client left before the answer; never sent.
CLIENT_CLOSED = 499


class ProxyError(Exception):
    """A request failed; ``status`` is the HTTP status the client receives."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.kind, self.param)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """The OpenAI-style JSON error body."""
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": status}
    return msgspec.json.encode({"error": error})


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", param)


def bad_gateway(message: str) -> ProxyError:
    """An upstream answered with a 5xx, broke the connection, or answered nonsense."""
    return ProxyError(502, message, "upstream_error")


def unavailable(message: str) -> ProxyError:
    """No instance of a role could take the request."""
    return ProxyError(503, message, "service_unavailable")


class NoInstance(ProxyError):
    """No instance of a role took the request (each was unreachable or draining): nothing
    was started on any of them (503)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "service_unavailable")


class UpstreamFailed(ProxyError):
    """An instance took a call and failed it: answered 5xx, broke the connection, or gave
    no answer in time (502, or 504 ``upstream_timeout``). ``role`` and ``url`` name it.
    Raised before any byte of its answer reached the client, the router may run the
    request again on other instances (:mod:`proxy.router`)."""

    def __init__(self, status: int, message: str, kind: str, role: str, url: str) -> None:
        super().__init__(status, message, kind)
        self.role = role
        self.url = url


def upstream_failed(role: str, url: str, message: str) -> UpstreamFailed:
    return UpstreamFailed(502, message, "upstream_error", role, url)


def upstream_timeout(role: str, url: str, message: str) -> UpstreamFailed:
    return UpstreamFailed(504, message, "upstream_timeout", role, url)


class UpstreamRejected(Exception):
    """An upstream answered 4xx: the request itself is wrong, so the client gets
    that answer (status and body) unchanged instead of a proxy error."""

    def __init__(self, status: int, content: bytes, content_type: str, stage: str,
                 url: str) -> None:
        super().__init__(f"{stage} instance {url} answered HTTP {status}")
        self.status = status
        self.content = content
        self.content_type = content_type
        self.stage = stage
        self.url = url
