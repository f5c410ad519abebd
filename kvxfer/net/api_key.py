"""HTTP API keys: ``Authorization: Bearer KEY`` on every route but a minimal ``/health``.

Shared by the sidecars and the proxy. :class:`ApiKeyMiddleware` answers 401 before any route
runs; without a key every caller counts as authenticated.

Design: docs/design/net.md#http-api-keys
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

import msgspec
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvxfer.net.kv_key import unsafe_mode

log = logging.getLogger(__name__)

# Where ApiKeyMiddleware records, for the routes, whether the caller sent the key.
SCOPE_AUTHENTICATED = "kvxfer.authenticated"
OPEN_PATHS: tuple[str, ...] = ("/health",)


class ApiKeyError(ValueError):
    """A key option that cannot work (empty key, unreadable key file)."""


def load_key(key: str | None, key_file: str | None, env_var: str, flag: str) -> str | None:
    """The key from ``--flag``, else ``--flag-file``, else ``$env_var``; None for no key.

    A key file holds the key on its first line (trailing whitespace ignored). Raises
    :class:`ApiKeyError` for an empty key or an unreadable file, naming the option.
    """
    if key is not None and key_file is not None:
        raise ApiKeyError(f"give {flag} or {flag}-file, not both")
    if key_file is not None:
        try:
            problem = unsafe_mode(Path(key_file).stat())
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyError(f"cannot read {flag}-file {key_file}: {exc}") from None
        if problem is not None:  # as the KV key file: others must not read it
            raise ApiKeyError(f"{flag}-file {key_file} {problem}")
        key = text.splitlines()[0] if text.strip() else ""
        where = f"{flag}-file {key_file}"
    elif key is not None:
        where = flag
        log.warning("%s on the command line shows in the process list to every user of this "
                    "host; prefer %s-file (mode 600) or $%s", flag, flag, env_var)
    else:
        key = os.environ.get(env_var)
        where = f"${env_var}"
        if key is None:
            return None
    key = key.strip()
    if not key:
        raise ApiKeyError(f"{where} is empty; omit it to run without an API key")
    return key


def bearer_problem(authorization: str | None, key: bytes) -> str | None:
    """Why ``authorization`` is refused, or None when it carries ``key``."""
    if not authorization:
        return "missing Authorization header; send 'Authorization: Bearer <api key>'"
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return f"Authorization scheme {scheme!r} is not supported; use 'Bearer <api key>'"
    # Constant-time comparison; the key itself never appears in a message.
    if not hmac.compare_digest(token.strip().encode(), key):
        return "invalid API key in the Authorization header"
    return None


def authenticated(scope: Scope) -> bool:
    """Whether this request carried the key (True when no key is configured)."""
    return bool(scope.get(SCOPE_AUTHENTICATED, True))


class ApiKeyMiddleware:
    """Pure ASGI: require ``Authorization: Bearer <api_key>`` on every path but
    ``open_paths``, which run with :func:`authenticated` telling them the outcome.

    A refusal is a 401 with an OpenAI error body (``authentication_error``) and
    ``WWW-Authenticate: Bearer``.
    """

    def __init__(self, app: ASGIApp, api_key: str,
                 open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.open_paths = frozenset(open_paths)

    def problem(self, authorization: str | None) -> str | None:
        """Why ``authorization`` is refused, or None when it carries the key."""
        return bearer_problem(authorization, self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self.problem(Headers(scope=scope).get("authorization"))
        scope[SCOPE_AUTHENTICATED] = problem is None
        if problem is not None and scope["path"] not in self.open_paths:
            response = Response(_unauthorized_body(problem), 401,
                                media_type="application/json",
                                headers={"www-authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _unauthorized_body(message: str) -> bytes:
    """The OpenAI-style error body of a 401 (the shape sidecars and proxy answer with)."""
    return msgspec.json.encode({"error": {"message": message, "type": "authentication_error",
                                          "param": None, "code": 401}})
