"""Running the proxy as a process: uvicorn on ``config.host:config.port``."""

from __future__ import annotations

import importlib
import logging
import signal
import socket
import sys
from types import FrameType
from typing import Literal, TypedDict

import uvicorn

from kvxfer.net.hosts import listen_tcp
from proxy.app import create_app
from proxy.config import ProxyConfig

log = logging.getLogger(__name__)

# After SIGINT/SIGTERM, open requests (streams included) get this long to finish.
GRACEFUL_SHUTDOWN_S = 10
# How long an idle client connection stays open. uvicorn's default, 5 s, is exactly how
# long httpx (and so the openai client) reuses an idle connection: a request sent as both
# timers ran out met a closing socket ("Server disconnected without sending a response",
# seen in CI). Well above any client's expiry, as a kvxfer sidecar keeps its own.
KEEP_ALIVE_S = 75


class ServerOptions(TypedDict):
    """The uvicorn settings :func:`server_options` picks (``uvicorn.Config`` keywords)."""

    loop: Literal["uvloop", "asyncio"]
    http: Literal["httptools", "h11"]


def server_options() -> ServerOptions:
    """uvicorn's ``loop`` and ``http`` settings: uvloop and httptools when importable.

    Both are C implementations (libuv's loop, llhttp's parser) and take a good
    part of the per-request CPU off the proxy (``kvxfer bench proxy``); the
    asyncio loop and pure-Python h11 parser remain the fallback.
    """
    return {"loop": "uvloop" if _importable("uvloop") else "asyncio",
            "http": "httptools" if _importable("httptools") else "h11"}


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: any free one); OSError says which address failed."""
    try:
        return listen_tcp(host, port)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                                 f"pick another --port (0: any free port)") from None


class _Server(uvicorn.Server):
    """uvicorn's Server, printing one ready line (with the real port) on stdout.

    The line ``kvxfer-proxy ready: http://HOST:PORT`` is printed at every log
    level, so scripts that start the proxy on port 0 learn its address from it.
    """

    def __init__(self, config: uvicorn.Config, url: str) -> None:
        super().__init__(config)
        self.url = url

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(f"kvxfer-proxy ready: {self.url}", flush=True)


def serve(config: ProxyConfig) -> int:
    """Serve until SIGINT or SIGTERM, then shut down cleanly; returns the exit status.

    uvicorn takes over both signals while it runs and, once it has shut down,
    raises them again for the handlers it found; ours only note them, so a
    signalled proxy exits with status 0 instead of dying from the re-raise.
    Returns 2 when the address cannot be bound.
    """
    try:
        sock = bind(config.host, config.port)
    except OSError as exc:
        print(f"kvxfer-proxy: {exc.strerror}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"
    options = server_options()
    log.info("serving with the %s event loop and the %s HTTP parser", options["loop"],
             options["http"])
    server = _Server(uvicorn.Config(
        create_app(config), log_level=config.log_level,
        access_log=config.access_log, lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, timeout_keep_alive=KEEP_ALIVE_S,
        **options), url)
    received: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if not server.started:
        log.error("the proxy did not start on %s:%d", config.host, config.port)
        return 1
    if received:
        log.info("stopped by %s", signal.Signals(received[0]).name)
    return 0
