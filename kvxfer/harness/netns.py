"""Two network namespaces joined by a veth pair, for benchmarks (root only).

:class:`VethPair` makes ``kvxb<pid>p`` (the prefill's, ``10.214.N.2``) and
``kvxb<pid>d`` (the decode's, ``10.214.N.1``), each holding one end of a veth pair
named :data:`DEVICE`, and removes both on :meth:`~VethPair.close` (also when
building fails). A whole process must live in a namespace: UCX's TCP transport
checks routes through ``/proc/net``, which shows the namespace of a process's
main thread. So the decode side runs under ``ip netns exec``, and a spawned
prefill process calls :func:`enter` first thing, from its main thread.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess

CLONE_NEWNET = 0x40000000
DEVICE = "eth0"  # each namespace's end of the pair


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30,
                          check=check)


def why_not() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    return None


def enter(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (``ip netns`` names);
    call it from a process's main thread before any socket or thread exists."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class VethPair:
    """Namespaces ``prefill`` and ``decode``; the prefill's address is ``inside``."""

    def __init__(self) -> None:
        tag = f"kvxb{os.getpid() % 100000}"
        self.prefill, self.decode = f"{tag}p", f"{tag}d"
        subnet = f"10.214.{random.randrange(16, 250)}"  # seen only inside the two
        self.inside, self.outside = f"{subnet}.2", f"{subnet}.1"
        self._made: list[str] = []
        try:
            for ns in (self.prefill, self.decode):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.prefill, "link", "add", DEVICE, "type", "veth", "peer", "name",
                DEVICE, "netns", self.decode)
            for ns, address in ((self.prefill, self.inside), (self.decode, self.outside)):
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", DEVICE)
                _ip("-n", ns, "link", "set", DEVICE, "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove both namespaces, and with them the pair (idempotent)."""
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> VethPair:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
