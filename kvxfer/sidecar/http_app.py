"""The sidecar's HTTP app: OpenAI-compatible completions over the engine loop.

:func:`create_app` builds a FastAPI app around a
:class:`~kvxfer.sidecar.instance.Sidecar` (engine, roles, engine loop, metrics);
:func:`serve` binds the HTTP port first (a port in use fails before the model loads),
builds the sidecar and runs uvicorn until SIGINT/SIGTERM (SIGTERM drains first; a second
signal, or SIGINT, stops at once). Handlers (:mod:`kvxfer.sidecar.handlers`) never touch
the engine: they validate, submit to the :class:`~kvxfer.sidecar.engine_loop.EngineLoop`
and await its events. Routes, status codes, draining and the API key:
``docs/design/openai-api.md``, "The sidecar's HTTP surface".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvxfer.net.api_key import ApiKeyMiddleware
from kvxfer.net.hosts import listen_tcp
from kvxfer.sidecar.handlers import (
    CHAT,
    COMPLETIONS,
    RELEASE,
    RESERVE,
    CountRequests,
    Handlers,
    install_error_handlers,
)
from kvxfer.sidecar.instance import Sidecar
from kvxfer.sidecar.settings import Settings

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
# How long an idle client connection stays open. Far above the 4 s after which the proxy
# drops its own idle ones (proxy.upstream.KEEPALIVE_S), so that the sidecar never closes a
# connection the proxy may be sending on; and above uvicorn's 5 s default for a reason
# found in ``kvxfer bench soak``: a sidecar frozen for longer than the timeout closed, on
# waking, the kept-alive connections whose requests had reached it meanwhile, unread.
KEEP_ALIVE_S = 75
TICK_S = 1.0           # the server's own tick (uvicorn ticks ten times a second) ...
TICK_DRAINING_S = 0.1  # ... and while draining, so that it ends soon after the last request


class PortInUse(OSError):
    """The HTTP port cannot be bound; the message names host and port."""


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
    handlers = Handlers(side)
    app.add_api_route(COMPLETIONS, handlers.completions, methods=["POST"])
    app.add_api_route(CHAT, handlers.chat, methods=["POST"])
    app.add_api_route(RELEASE, handlers.release, methods=["POST"])
    app.add_api_route(RESERVE, handlers.reserve, methods=["POST"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics, methods=["GET"])
    install_error_handlers(app)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(CountRequests, side=side)  # outermost: counts 401s too
    return app


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


def _keep_ucx_on_the_side_channel(advertised: str) -> None:
    """An instance peers dial (a prefill; a decode taking pushes) at a loopback address
    keeps UCX on ``lo``, before its agents exist: a connection over an interface removed
    later would hang its READs (:mod:`kvxfer.net.interfaces`)."""
    from kvxfer.net.interfaces import UCX_DEVICES_ENV, keep_ucx_on

    devices = keep_ucx_on(advertised)
    if devices is not None:
        log.info("kvxfer serve: UCX network devices %s, which hold %s (set %s to choose)",
                 devices, advertised, UCX_DEVICES_ENV)


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
        if settings.serves_peers:
            _keep_ucx_on_the_side_channel(settings.side_channel_advertised())
        side = Sidecar(settings)
        log.info("kvxfer serve: %s", side.describe(port))
        if settings.transfer.kv_key is None:
            log.warning("kvxfer serve: no --kv-key-file: the KV side channel, NIXL "
                        "notifications and lease tickets are unauthenticated; anyone who "
                        "reaches %s may read, free or overwrite leased KV. Use this only on "
                        "loopback or a network you trust completely",
                        side.side_channel_advertised if settings.serves_peers
                        else "this decode's HTTP port")
        if settings.api_key is None:
            log.warning("kvxfer serve: no --api-key: anyone who reaches %s:%d may use this "
                        "sidecar's HTTP API", settings.host, port)
        app = create_app(settings, side)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                timeout_keep_alive=KEEP_ALIVE_S)
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
    first SIGTERM drains the sidecar (docs/design/openai-api.md) instead of stopping."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None],
                 side: Sidecar) -> None:
        super().__init__(config)
        self.on_ready, self.side = on_ready, side
        self._signalled = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.side.draining and not self.should_exit:
            self.side.begin_drain()  # on_tick ends the server once drained
        else:
            super().handle_exit(sig, frame)
        if self._loop is not None:  # the next tick now, not at the end of the wait
            self._loop.call_soon_threadsafe(self._signalled.set)

    async def main_loop(self) -> None:
        """uvicorn's loop at one tick a second instead of ten: an idle sidecar's CPU was
        mostly those wake-ups. A signal ticks at once; a drain ticks fast."""
        self._loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter += 10  # uvicorn refreshes its Date header when counter % 10 == 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._signalled.wait(),
                                       TICK_DRAINING_S if self.side.draining else TICK_S)
            self._signalled.clear()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.side.drained()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_ready()
