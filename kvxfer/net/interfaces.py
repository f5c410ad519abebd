"""This machine's network interfaces: which hold an address, and keeping UCX on them.

UCX puts every interface it finds when a NIXL agent is made into the agent's worker
address, and peers may wire their connection (and the TCP lane that carries a READ's
"done" notification) over any of them. On a host where interfaces come and go (container
and namespace veths), a connection made over one that is then removed hangs without an
error: the bytes of a READ on one host still move (cma), but its notification, and so the
READ, never completes, and the read fails only at ``--kv-read-timeout``. A new
handshake cannot help either: the prefill's worker address still names the lost
interface. :func:`keep_ucx_on` keeps UCX's network transports on the interfaces of the
address peers reach this instance at, which lives as long as the instance does, when that
address is loopback (every peer on this machine). Elsewhere the operator chooses:
``UCX_NET_DEVICES`` also names the RDMA devices UCX may use (by HCA port, ``mlx5_0:1``,
not by the interface holding the address), so naming that interface alone would turn
RDMA off.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

from kvxfer.net.hosts import resolved

log = logging.getLogger(__name__)

UCX_DEVICES_ENV = "UCX_NET_DEVICES"
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def interfaces_holding(host: str) -> tuple[str, ...]:
    """The names of this machine's interfaces that hold an address ``host`` resolves to,
    sorted (empty: none does, e.g. an address NAT maps here, or ``host`` does not
    resolve)."""
    return _holding(resolved(host))


def _holding(wanted: set[Address]) -> tuple[str, ...]:
    import psutil

    found = set()
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                held = ipaddress.ip_address(addr.address.split("%")[0])
            except ValueError:
                continue
            if held in wanted:
                found.add(name)
    return tuple(sorted(found))


def keep_ucx_on(host: str) -> str | None:
    """Keep the UCX network transports of the NIXL agents this process makes from now on
    to the interfaces holding ``host``, the address peers reach this instance at, when it
    is loopback (see the module docstring): sets ``UCX_NET_DEVICES`` and returns its
    value. None, and nothing set, when the variable is set already (the operator's choice
    stands), ``host`` is not loopback (or does not resolve), or no interface here holds it
    (then UCX keeps every interface)."""
    if os.environ.get(UCX_DEVICES_ENV):
        return None
    addresses = resolved(host)  # once: a name's lookup may be slow
    if not addresses or not all(address.is_loopback for address in addresses):
        log.info("UCX may use every interface for %s (set %s on a host whose interfaces "
                 "come and go, RDMA devices included)", host, UCX_DEVICES_ENV)
        return None
    names = _holding(addresses)
    if not names:
        return None
    os.environ[UCX_DEVICES_ENV] = ",".join(names)
    return os.environ[UCX_DEVICES_ENV]
