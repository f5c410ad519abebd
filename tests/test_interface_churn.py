"""An interface that comes and goes on the host must not stall a READ (issue 24's stall).

UCX wires a connection over any interface the machine had when the agents were made. A
veth with an address, present while a prefill and a decode start and removed later (as
namespace tests and container hosts do all the time), left every later READ between them
"still in progress" until ``--kv-read-timeout``: the bytes move with cma, but the READ's
"done" notification rides a TCP connection over the removed address, which hangs without
an error. ``kvxfer serve`` now keeps UCX on the interfaces of the address peers dial it at
(:mod:`kvxfer.net.interfaces`). Real sidecars, NIXL READs (no copies on this host).

Needs root and ``ip`` (skipped elsewhere, saying which).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecars import SidecarGroup, Spec, disaggregated

from kvxfer.harness.network import sh, why_not
from kvxfer.net.interfaces import UCX_DEVICES_ENV, interfaces_holding, keep_ucx_on

READ_TIMEOUT_S = 3.0
BODY = {"prompt": "A prompt read over NIXL after an interface went away. " * 12,
        "max_tokens": 3, "temperature": 0}


@pytest.fixture
def veth() -> Iterator[str]:
    """A veth pair with an address on this host's side, removed by the test (or at the
    end); yields the name of the side holding the address."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    name, third = f"kvxch{os.getpid() % 100000}", os.getpid() % 250
    address = f"10.213.{third}.1"
    sh("ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p")
    try:
        sh("ip", "addr", "add", f"{address}/24", "dev", name)
        sh("ip", "link", "set", name, "up")
        sh("ip", "link", "set", f"{name}p", "up")
        yield name
    finally:
        sh("ip", "link", "del", name, check=False)


def test_a_read_after_an_interface_went_away_lands_at_once(
        veth: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UCX_DEVICES_ENV, raising=False)  # kvxfer chooses: nothing inherited
    with SidecarGroup(tmp_path) as group:
        prefill, decode = group.start([
            Spec("prefill", extra=("--no-host-reads",)),
            Spec("decode", policy="fail", extra=(
                "--no-host-reads", "--kv-read-timeout", str(READ_TIMEOUT_S)))])
        _, first = disaggregated(prefill, decode, "/v1/completions", BODY)
        assert first.status_code == 200, first.text  # connected while the veth was up
        sh("ip", "link", "del", veth)
        started = time.monotonic()
        _, second = disaggregated(prefill, decode, "/v1/completions", BODY)
        took = time.monotonic() - started
        assert second.status_code == 200, (
            f"{second.status_code} after {took:.1f} s: {second.text}\n{decode.log_tail()}")
        assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert took < READ_TIMEOUT_S, decode.log_tail()
        assert decode.metric("kvxfer_kv_transfers_total", outcome="ok") == 2, \
            decode.log_tail()
        assert "UCX network devices lo, which hold 127.0.0.1" in prefill.log_tail(80)


def test_ucx_is_kept_on_the_interface_holding_the_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UCX_DEVICES_ENV, raising=False)
    assert interfaces_holding("127.0.0.1") == ("lo",)
    assert interfaces_holding("localhost") == ("lo",)
    assert interfaces_holding("198.51.100.7") == ()  # TEST-NET-2: held by nobody here
    assert interfaces_holding("nowhere.invalid") == ()
    assert keep_ucx_on("198.51.100.7") is None
    assert UCX_DEVICES_ENV not in os.environ  # UCX keeps every interface then
    assert keep_ucx_on("127.0.0.1") == "lo"
    assert os.environ[UCX_DEVICES_ENV] == "lo"


def test_an_address_off_loopback_leaves_the_choice_to_the_operator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX_NET_DEVICES names RDMA devices by HCA port too: naming the interface of a
    routable address alone would turn RDMA off, so kvxfer leaves it unset there."""
    import psutil

    monkeypatch.delenv(UCX_DEVICES_ENV, raising=False)
    held = [(name, a.address) for name, addrs in psutil.net_if_addrs().items()
            for a in addrs if a.family == socket.AF_INET
            and not ipaddress.ip_address(a.address).is_loopback]
    assert held, "this test needs an interface with an address off loopback"
    name, address = held[0]
    assert interfaces_holding(address) == (name,)
    assert keep_ucx_on(address) is None
    assert UCX_DEVICES_ENV not in os.environ


def test_the_operators_ucx_devices_stand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UCX_DEVICES_ENV, "eth7")
    assert keep_ucx_on("127.0.0.1") is None
    assert os.environ[UCX_DEVICES_ENV] == "eth7"
