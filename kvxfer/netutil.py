"""Small socket helpers shared by the sidecar and the proxy (no heavy imports)."""

from __future__ import annotations

import socket

LISTEN_BACKLOG = 2048


def listen_tcp(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket on ``host:port`` (port 0: any free one).

    Binding it ourselves, before the HTTP server starts, lets a server learn its
    real port (for its ready line) and turn a busy address into a clear error.
    Raises the ``OSError`` of ``bind`` (the caller names the address in its message).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
