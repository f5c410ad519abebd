"""This machine's network interfaces: which hold an address, and keeping UCX on them.

:func:`keep_ucx_on` sets ``UCX_NET_DEVICES`` to the interfaces holding a loopback instance's
address, because a connection over an interface that goes away hangs its READs; elsewhere,
or where the variable is set, the operator chooses.

Design: docs/design/net.md#keeping-ucx-on-the-right-interfaces
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
    is loopback (a connection over an interface that goes away would hang its READs):
    sets ``UCX_NET_DEVICES`` and returns its
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
