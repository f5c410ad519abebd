"""Servers shared by every test that only talks to them: one process each per test run,
started on first use, stopped when the run ends (a pytest plugin, see ``conftest.py``).

* ``plain``: a ``both`` sidecar (kvxfer-tiny, LBHNC, TP 1, 256 blocks of 16) that also
  answers to the model name ``tiny-alias``: the single-instance reference;
* ``pull_pair``: a prefill and a decode (policy ``fail``, so a failed read cannot hide
  behind a recompute), both like ``plain`` otherwise;
* ``proxied``: ``python -m proxy`` in front of ``pull_pair``, its health checks an hour
  apart (only the request path can mark an instance down).

A test that uses them sends requests and reads answers, /health and /metrics; it compares
counters before and after its own requests (other tests used the instances before), and
it leaves each instance idle: no request in flight, no lease, no used block. That is
checked after every such test, so a test that leaves work behind fails there instead of
the next user. A test that kills, freezes, drains or reconfigures an instance starts its
own (:class:`sidecars.SidecarGroup`).

Also shared, per module: ``key_file``, a fresh KV key file for a module's keyed sidecars,
and ``key``, the key in it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sidecars import ProxyProcess, Sidecar, SidecarGroup, Spec, start_proxies, write_key

PLAIN = Spec("both", extra=("--served-model-name", "kvxfer-tiny", "tiny-alias"))
PREFILL = Spec("prefill")
DECODE = Spec("decode", policy="fail")
IDLE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class PullPair:
    prefill: Sidecar
    decode: Sidecar


def idle(health: dict[str, Any]) -> bool:
    return bool(health["requests_in_flight"] == 0 and health["leases"] == 0
                and health["used_blocks"] == 0)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A module's KV key file (its sidecars' ``--kv-key-file``)."""
    return write_key(tmp_path_factory.mktemp("key") / "kv.key")


@pytest.fixture(scope="module")
def key(key_file: Path) -> bytes:
    """The key in :func:`key_file`, as the sidecars read it."""
    return key_file.read_bytes().strip()


@pytest.fixture(scope="session")
def _shared_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarGroup]:
    with SidecarGroup(tmp_path_factory.mktemp("shared")) as group:
        yield group


@pytest.fixture(scope="session")
def plain(_shared_group: SidecarGroup) -> Sidecar:
    return _shared_group.start_one(PLAIN)


@pytest.fixture(scope="session")
def pull_pair(_shared_group: SidecarGroup) -> PullPair:
    prefill, decode = _shared_group.start([PREFILL, DECODE])
    return PullPair(prefill, decode)


@pytest.fixture(scope="session")
def proxied(pull_pair: PullPair, _shared_group: SidecarGroup) -> Iterator[ProxyProcess]:
    proxy = ProxyProcess(_shared_group.log_dir, [pull_pair.prefill], [pull_pair.decode],
                         ("--health-interval", "3600"))
    try:
        start_proxies([proxy])
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(autouse=True)
def _shared_servers_end_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the shared sidecars: each is idle again."""
    used: list[Sidecar] = []
    if "plain" in request.fixturenames:
        used.append(request.getfixturevalue("plain"))
    if "pull_pair" in request.fixturenames:
        pair = request.getfixturevalue("pull_pair")
        used += [pair.prefill, pair.decode]
    yield
    for sidecar in used:
        sidecar.wait_for(f"shared {sidecar.spec.role} sidecar idle after {request.node.nodeid}"
                         " (no request, lease or used block)", idle, IDLE_TIMEOUT_S)
