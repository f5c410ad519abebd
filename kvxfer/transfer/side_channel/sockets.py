"""What both ends of the side channel share: ZMQ sockets, size limits, waits (addresses:
:func:`kvxfer.net.hosts.endpoint`)."""

from __future__ import annotations

import socket

import zmq

POLL_INTERVAL_S = 0.05        # how long close() may wait for a serving thread to notice
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


def connect_error(host: str, port: int, timeout: float) -> str | None:
    """Why a plain TCP connect to host:port fails (refused, unknown host...), or None if it
    succeeds. Used once before a handshake and again to explain a timeout; a ZMQ monitor
    on every attempt would say the same but costs ~0.2 ms per fetch."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
