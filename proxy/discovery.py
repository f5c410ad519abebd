"""Instances by DNS name: resolve, re-resolve every interval, add and retire members.

A retired address takes no new request and is forgotten once its calls finished; a name that
fails to resolve for a transient reason keeps its addresses. Resolvers:
:func:`system_resolver` (the default) and :func:`hosts_file_resolver`.

Design: docs/design/proxy.md#instances-by-dns-name
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from proxy.balancer import Balancer, Instance
from proxy.config import ROLES, ProxyConfig, base_url

log = logging.getLogger(__name__)

Resolver = Callable[[str], list[str]]
"""``name`` -> its addresses (empty: none); raises ``OSError`` when it cannot tell now."""


class NoAddresses(OSError):
    """The name exists nowhere (or has no address): its instances are gone."""


def is_name(host: str) -> bool:
    """Whether ``host`` is a DNS name to resolve (not an IP literal, not localhost)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare == "localhost":
        return False
    try:
        ipaddress.ip_address(bare.split("%")[0])
    except ValueError:
        return True
    return False


def system_resolver(name: str) -> list[str]:
    """The addresses ``getaddrinfo`` gives for ``name`` (TCP), first-seen order, unique."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def hosts_file_resolver(path: str | Path) -> Resolver:
    """A resolver reading ``path`` (``ADDRESS NAME [NAME...]`` lines, ``#`` comments) on
    every call, so a test or an operator changes membership by rewriting the file (as a
    whole: a new file renamed over it; one read while written in place may read empty)."""
    where = Path(path)

    def resolve(name: str) -> list[str]:
        found: list[str] = []
        for line in where.read_text().splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) >= 2 and name in fields[1:] and fields[0] not in found:
                found.append(fields[0])
        return found

    return resolve


class Discovery:
    """Keeps the balancer's members equal to static URLs plus resolved names."""

    def __init__(self, balancer: Balancer, config: ProxyConfig, resolve: Resolver) -> None:
        self.balancer, self.config, self.resolve = balancer, config, resolve
        self.interval = config.resolve_interval
        self._last: dict[tuple[str, int], list[str]] = {}  # (name, port) -> last URLs
        self._stop = asyncio.Event()

    @property
    def active(self) -> bool:
        return any(self.config.names(role) for role in ROLES)

    async def _urls(self, name: str, port: int) -> list[str]:
        try:
            addresses = await asyncio.to_thread(self.resolve, name)
        except OSError as exc:
            previous = self._last.get((name, port), [])
            log.warning("cannot resolve %s (%s); keeping its %d previous address(es)", name,
                        exc, len(previous))
            return previous
        urls = [base_url(address, port) for address in addresses]
        self._last[(name, port)] = urls
        return urls

    async def refresh(self) -> list[Instance]:
        """Resolve every name once and update the members; the instances that joined."""
        joined: list[Instance] = []
        for role in ROLES:
            urls = list(self.config.urls(role))
            for name, port in self.config.names(role):
                urls += [u for u in await self._urls(name, port) if u not in urls]
            joined += self.balancer.set_members(role, urls)
        return joined

    async def run(self, on_join: Callable[[Instance], Awaitable[None]]) -> None:
        """Refresh every ``interval`` seconds until :meth:`stop`; ``on_join`` each new one."""
        while not self._stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)
            if self._stop.is_set():
                return
            for instance in await self.refresh():
                await on_join(instance)

    def stop(self) -> None:
        self._stop.set()


def resolver_for(hosts_file: str | None) -> Resolver:
    return system_resolver if hosts_file is None else hosts_file_resolver(hosts_file)


def split_hosts(hosts: Sequence[str], ports: Sequence[int], flag: str
                ) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """``--<flag>-hosts`` paired with ``--<flag>-ports`` (as :func:`proxy.config.instance_urls`)
    and split into static base URLs and (name, port) pairs to resolve."""
    from proxy.config import instance_urls

    if len(hosts) == 1:
        hosts = list(hosts) * len(ports)
    instance_urls(hosts, ports, flag)  # the same checks and messages
    urls = tuple(base_url(h, p) for h, p in zip(hosts, ports, strict=True) if not is_name(h))
    names = tuple((h, p) for h, p in zip(hosts, ports, strict=True) if is_name(h))
    return urls, names
