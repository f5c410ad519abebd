"""Small socket helpers shared by the sidecar and the proxy (no heavy imports)."""

from __future__ import annotations

import ipaddress
import socket

LISTEN_BACKLOG = 2048
DRAINING_HEADER = "x-kvxfer-draining"
"""Set on a sidecar's 503 while it drains: nothing was started, try another instance."""


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


WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` means every address of the machine (nobody can dial it)."""
    return host.strip() in WILDCARD_HOSTS


def endpoint(host: str, port: int) -> str:
    """``tcp://host:port``, with IPv6 literals bracketed (ZMQ's form of an address)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def bare_host(host: str) -> str:
    """``host`` without the brackets of an IPv6 literal (``[::1]`` -> ``::1``)."""
    host = host.strip()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


AUTO = "auto"
"""``--advertise-host auto``: the address this machine's host name resolves to."""


def own_address() -> str:
    """The first non-loopback address ``gethostname()`` resolves to (in a container or
    a Kubernetes pod: its own IP, which both write into ``/etc/hosts``)."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"--advertise-host auto: this host's name {name!r} does not "
                         f"resolve ({exc}); give the address itself") from None
    for info in infos:
        address = str(info[4][0])
        if not ipaddress.ip_address(address.split("%")[0]).is_loopback:
            return address
    raise ValueError(f"--advertise-host auto: this host's name {name!r} resolves only to "
                     f"loopback addresses; give the address peers reach this instance at")


def advertised_host(bind_host: str, advertise_host: str | None, what: str) -> str:
    """The address peers are told to reach a listener bound on ``bind_host`` at.

    ``advertise_host`` when given (``auto``: :func:`own_address`), else ``bind_host``
    when it is a concrete address; a wildcard bind without an advertised host raises
    ``ValueError`` (``what`` names the listener's flag in the message): peers cannot
    dial ``0.0.0.0`` or ``::``.
    """
    if advertise_host is not None and advertise_host.strip():
        chosen = own_address() if advertise_host.strip() == AUTO else bare_host(advertise_host)
        if is_wildcard(chosen):
            raise ValueError(f"--advertise-host {advertise_host!r} is a wildcard address; "
                             f"give an address peers can reach (e.g. this machine's or "
                             f"pod's IP)")
        return chosen
    if is_wildcard(bind_host):
        raise ValueError(f"{what} {bind_host!r} binds every address, so peers cannot be "
                         f"told which one reaches this instance: pass --advertise-host "
                         f"ADDR (or set $KVXFER_ADVERTISE_HOST) with an address they can "
                         f"reach, e.g. the pod IP")
    return bare_host(bind_host)


def resolved(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses ``host`` (a literal or a name) resolves to (empty: it does not)."""
    try:
        infos = socket.getaddrinfo(bare_host(host), None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}


def _is_loopback(host: str) -> bool | None:
    """Whether ``host`` (a literal or a name) is loopback only; None: it does not resolve."""
    host = bare_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        pass
    addresses = resolved(host)
    return all(address.is_loopback for address in addresses) if addresses else None


def unreachable_advertised(bind_host: str, advertised: str, what: str) -> str | None:
    """Why peers told ``advertised`` cannot reach a listener bound on ``bind_host`` (None:
    they may): a loopback bind reaches only this machine, so an advertised address that
    is not loopback (or does not resolve) cannot work. ``what`` names the bind flag."""
    if is_wildcard(bind_host) or _is_loopback(bind_host) is not True:
        return None  # every address, or a concrete one (NAT may map another to it)
    if _is_loopback(advertised):
        return None
    return (f"{what} {bare_host(bind_host)!r} listens on loopback only, but peers are told "
            f"to reach it at {advertised!r}, which is not this machine's loopback: set {what} "
            f"0.0.0.0 (or the address {advertised!r} names) so that they can")
