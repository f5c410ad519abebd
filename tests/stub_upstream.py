"""Real HTTP servers for tests: any ASGI app under uvicorn in a thread, on a loopback port.

``ServerThread`` serves an app (a stub sidecar from :mod:`proxy.stub`, the
proxy itself, later a real sidecar) on a socket this module binds, so the port
is free and known before the server starts; ``stop()`` ends it and ``start()``
brings it back on the same port. ``Stub`` bundles a stub sidecar with the
behaviour and record a test steers and reads.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from proxy.stub import StubBehaviour, StubRecord, create_stub_app

START_TIMEOUT_S = 10.0


def bind_loopback(port: int = 0) -> socket.socket:
    """A TCP socket bound to 127.0.0.1:``port`` (0: any free port), not yet listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


class RefusingPort:
    """A loopback port where connections are refused: bound, never listening.

    Holding the bound socket keeps anyone else from taking the port meanwhile.
    """

    def __init__(self) -> None:
        self._sock = bind_loopback()
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._sock.close()


class ServerThread:
    """An ASGI app served by uvicorn (lifespan on) in a daemon thread."""

    def __init__(self, app: Any, port: int = 0) -> None:
        self.app = app
        self._sock = bind_loopback(port)
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ServerThread:
        if self._sock.fileno() == -1:  # stopped before: bind the same port again
            self._sock = bind_loopback(self.port)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=1)
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(server.serve([self._sock])),
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        wait_until(lambda: server.started or not self._thread_alive(), START_TIMEOUT_S,
                   f"server on port {self.port} to start")
        if not server.started:
            raise RuntimeError(f"server on port {self.port} exited during startup")
        return self

    def stop(self) -> None:
        """Stop serving and close the port (connections to it are then refused)."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=START_TIMEOUT_S)
        self._sock.close()
        self._server = None

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class Stub:
    """A stub sidecar of ``role`` served on loopback, with its behaviour and record."""

    def __init__(self, role: str, engine_id: str | None = None) -> None:
        self.role = role
        self.behaviour = StubBehaviour()
        self.record = StubRecord()
        self.engine_id = engine_id
        self.server = ServerThread(create_stub_app(role, self.behaviour, self.record,
                                                   engine_id))
        self.url = self.server.url

    def reset(self) -> None:
        """Default behaviour, empty record; releases anything a test left holding."""
        if self.behaviour.hold is not None:
            self.behaviour.hold.set()
        fresh = StubBehaviour()
        for name in vars(fresh):
            setattr(self.behaviour, name, getattr(fresh, name))
        self.record.clear()


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str,
               step_s: float = 0.01) -> None:
    """Poll ``condition`` until true; AssertionError naming ``what`` after ``timeout_s``."""
    for _ in range(max(int(timeout_s / step_s), 1)):
        if condition():
            return
        time.sleep(step_s)
    assert condition(), f"timed out after {timeout_s} s waiting for {what}"
