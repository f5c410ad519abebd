"""What both ends of the side channel share: ZMQ sockets, size limits, waits (addresses:
:func:`kvxfer.net.hosts.endpoint`)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from abc import ABC, abstractmethod

import zmq

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05        # how often a closing sender looks whether it may stop
IDLE_WAIT_S = 1.0             # a thread with nothing due looks again this often at most
MAX_REQUEST_BYTES = 64 * 1024  # a request is ~100 bytes; larger inbound messages drop the peer
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
JOIN_TIMEOUT_S = 5.0          # how long close() waits for a thread before it gives up on it
PROBE_TIMEOUT_S = 0.5         # the TCP probe that explains a timeout


def new_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, host: str,
               max_bytes: int) -> zmq.Socket[bytes]:
    """A ``kind`` socket that drops unsent messages on close and inbound ones over
    ``max_bytes``; IPv6 where ``host`` is an IPv6 literal."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


class Wakeup:
    """A pipe that a :class:`zmq.Poller` watches beside a thread's sockets: :meth:`set`,
    from any thread, ends that thread's poll at once (to stop it, or to hand it work), so
    an idle side channel thread sleeps in its poll instead of waking on a timer (each
    wake-up of an idle process costs CPU; a timer at 20 Hz was a few percent of a core)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()  # set() never writes to a closed (maybe reused) fd
        self._closed = False

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        """Wake the poller (idempotent until :meth:`clear`; a no-op once closed)."""
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):  # full: the poller is woken already
                os.write(self._write, b"\0")

    def clear(self) -> None:
        """Take every pending wake-up (the polling thread, after its poll)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        """Close the pipe (idempotent), once its poller is gone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read)
            os.close(self._write)


def connect_error(host: str, port: int, timeout: float) -> str | None:
    """Why a plain TCP connect to host:port fails (refused, unknown host...), or None if it
    succeeds. Used once before a handshake and again to explain a timeout; a ZMQ monitor
    on every attempt would say the same but costs ~0.2 ms per fetch."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


class ServingThread(ABC):
    """Sockets of one ZMQ context that one daemon thread serves from :meth:`_start_thread`
    until :meth:`_close` (ZMQ sockets are not thread-safe). A subclass binds its sockets in its
    constructor, after this one's, names them in :meth:`_sockets`, and serves them in
    :meth:`_serve` until ``_stop`` is set, polling ``_wakeup`` beside them (:meth:`close`
    sets it; so may whoever hands the thread work)."""

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._stop = threading.Event()
        self._wakeup = Wakeup()
        self._thread: threading.Thread | None = None
        self._closed = False

    @abstractmethod
    def _sockets(self) -> list[zmq.Socket[bytes]]:
        """Every socket this server bound (closed by :meth:`_close`)."""

    @abstractmethod
    def _serve(self) -> None:
        """The serving thread's loop: until ``_stop`` is set; closes its sockets as it ends."""

    def _close_unbound(self) -> None:
        """A subclass whose constructor failed to bind: close what it made, then raise."""
        for sock in self._sockets():
            sock.close(linger=0)
        self._wakeup.close()
        self._ctx.term()

    def _start_thread(self, name: str, what: str) -> None:
        """Start serving on a daemon thread called ``name`` (idempotent); ``what`` names
        this server in the error of a closed one."""
        if self._closed:
            raise RuntimeError(f"{what} is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
            self._thread.start()

    def _close(self, what: str) -> None:
        """Stop serving at once and close every socket (idempotent); a thread that does
        not stop within JOIN_TIMEOUT_S keeps its sockets, logged as ``what``."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wakeup.set()
        if self._thread is None:
            for sock in self._sockets():
                sock.close(linger=0)
        else:
            self._thread.join(timeout=JOIN_TIMEOUT_S)
            if self._thread.is_alive():  # its sockets are the stuck thread's: leave them
                log.error("%s: serving thread did not stop within %.0f s", what,
                          JOIN_TIMEOUT_S)
                return
        self._wakeup.close()
        self._ctx.term()
