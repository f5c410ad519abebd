"""Hosts in network namespaces joined by a bridge, for tests and benchmarks (root only).

Between such hosts keep UCX on TCP over :data:`IFACE` (:data:`UCX_ENV`) and run prefills with
``--no-host-reads`` (namespaces share the PID space). :class:`Network` removes what it made
on :meth:`~Network.close`; its names carry the builder's pid.

Design: docs/design/bench.md#hosts-in-network-namespaces
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

IFACE = "kvx0"  # the one interface of every "host" namespace
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": IFACE}
CMD_TIMEOUT_S = 20.0


def why_not() -> str | None:
    """Why namespaces, veth links and ``tc`` cannot be used here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces and veth links (run as root, as CI does)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip netns`, `tc`)"
    probe = f"kvxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=CMD_TIMEOUT_S)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT_S)
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command (``ip``, ``tc``) with a deadline; fails naming it."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def in_ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", ns, *argv, check=check)


class Network:
    """Namespaces joined by a bridge; :meth:`close` removes all of it (idempotent).

    ``hosts`` maps a role to (namespace, address). Names carry this process's id, so
    that two runs on one machine never touch each other's namespaces or links.
    """

    def __init__(self, roles: tuple[str, ...]) -> None:
        self.tag = f"kvxt{os.getpid() % 100000}"
        self.subnet = self._free_subnet()
        self.switch = f"{self.tag}-sw"
        self.uplink = f"{self.tag}h"           # the test's end, in our own namespace
        self.namespaces: list[str] = []
        self.hosts: dict[str, tuple[str, str]] = {}
        try:
            self._build(roles)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> str:
        """A 10.213.N prefix no route of this machine uses."""
        routes = sh("ip", "-4", "route", "show", "table", "all").stdout
        choices = [n for n in range(16, 250) if f"10.213.{n}." not in routes]
        assert choices, "every 10.213.N.0/24 is routed here already"
        return f"10.213.{random.choice(choices)}"

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        in_ns(name, "ip", "link", "set", "lo", "up")

    def _build(self, roles: tuple[str, ...]) -> None:
        self._add_ns(self.switch)
        in_ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        in_ns(self.switch, "ip", "link", "set", "br0", "up")
        # our own end: address .1, the peer a port of the bridge
        sh("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "up0",
           "netns", self.switch)
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.uplink)
        sh("ip", "link", "set", self.uplink, "up")
        self._attach("up0")
        for index, role in enumerate(roles, start=2):
            ns, address = f"{self.tag}-{role}", f"{self.subnet}.{index}"
            self._add_ns(ns)
            port = f"p{index}"
            sh("ip", "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port,
               "netns", self.switch)
            in_ns(ns, "ip", "addr", "add", f"{address}/24", "dev", IFACE)
            in_ns(ns, "ip", "link", "set", IFACE, "up")
            self._attach(port)
            self.hosts[role] = (ns, address)

    def _attach(self, port: str) -> None:
        in_ns(self.switch, "ip", "link", "set", port, "master", "br0")
        in_ns(self.switch, "ip", "link", "set", port, "up")

    def ns(self, role: str) -> str:
        return self.hosts[role][0]

    def address(self, role: str) -> str:
        return self.hosts[role][1]

    def link(self, role: str, up: bool) -> None:
        """Take ``role``'s interface down (the cable pulled) or up again."""
        in_ns(self.ns(role), "ip", "link", "set", IFACE, "up" if up else "down")

    def slow(self, role: str, rate: str | None) -> None:
        """Limit ``role``'s egress to ``rate`` (token bucket), or remove the limit."""
        if rate is None:
            in_ns(self.ns(role), "tc", "qdisc", "del", "dev", IFACE, "root", check=False)
        else:
            in_ns(self.ns(role), "tc", "qdisc", "replace", "dev", IFACE, "root", "tbf",
                  "rate", rate, "burst", "32kb", "latency", "2s")

    def sent_bytes(self, role: str) -> int:
        """Bytes ``role``'s egress qdisc has sent (``tc -s``)."""
        out = in_ns(self.ns(role), "tc", "-s", "-j", "qdisc", "show", "dev", IFACE).stdout
        return sum(int(q.get("bytes", 0)) for q in json.loads(out or "[]"))

    def close(self) -> None:
        if sh("ip", "link", "show", self.uplink, check=False).returncode == 0:
            sh("ip", "link", "del", self.uplink, check=False)
        for ns in reversed(self.namespaces):
            sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
