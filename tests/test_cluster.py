"""Leaving one machine: advertised addresses, IPv6, DNS membership, SIGTERM drains.

Real ``kvxfer serve`` and proxy processes on loopback. Names are resolved through
a hosts file the test rewrites (``kvxfer-proxy --hosts-file``), since no DNS can
be run here; the proxy's resolver is the same code path either way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecars import (
    ROOT,
    Launched,
    SidecarGroup,
    Spec,
    disaggregated,
    new_api_key,
    prefill_body,
)

from kvxfer.harness import preloaded
from kvxfer.net.hosts import advertised_host, bare_host, is_wildcard, unreachable_advertised
from proxy.balancer import Balancer
from proxy.config import ProxyConfig
from proxy.discovery import hosts_file_resolver, is_name, split_hosts

BODY = {"prompt": "the cluster test", "max_tokens": 4, "temperature": 0}
NAME = "decode.kvxfer.test"


def has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


# -- addresses: pure rules ----------------------------------------------------------------

@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_bind_needs_an_advertised_host(host: str) -> None:
    assert is_wildcard(host)
    with pytest.raises(ValueError, match="--advertise-host"):
        advertised_host(host, None, "--side-channel-host")
    assert advertised_host(host, "10.1.2.3", "--side-channel-host") == "10.1.2.3"
    assert advertised_host(host, "[fd00::5]", "--side-channel-host") == "fd00::5"


def test_a_concrete_bind_advertises_itself_unless_told_otherwise() -> None:
    assert advertised_host("10.0.0.7", None, "x") == "10.0.0.7"
    assert advertised_host("[::1]", None, "x") == "::1" == bare_host("[::1]")
    assert advertised_host("10.0.0.7", "prefill-0.prefill", "x") == "prefill-0.prefill"
    with pytest.raises(ValueError, match="wildcard"):
        advertised_host("10.0.0.7", "0.0.0.0", "x")


@pytest.mark.parametrize(("bind", "advertised", "refused"), [
    ("127.0.0.1", "prefill-0.invalid", True),  # does not resolve: nobody reaches it
    ("127.0.0.1", "10.1.2.3", True),
    ("::1", "fd00::5", True),
    ("127.0.0.1", "localhost", False),
    ("127.0.0.1", "127.0.0.2", False),
    ("0.0.0.0", "10.1.2.3", False),
    ("10.0.0.7", "prefill-0.invalid", False),  # a concrete bind: maybe behind NAT
])
def test_a_loopback_bind_advertised_elsewhere_is_refused(bind: str, advertised: str,
                                                         refused: bool) -> None:
    problem = unreachable_advertised(bind, advertised, "--side-channel-host")
    assert (problem is not None) is refused, problem
    if refused:
        assert problem is not None and "set --side-channel-host 0.0.0.0" in problem


def test_serve_refuses_a_loopback_side_channel_advertised_elsewhere() -> None:
    done = preloaded.run("kvxfer.cli", ["serve", "--role", "prefill", "--port", "0", "--host",
                                        "0.0.0.0", "--advertise-host", "prefill-0.invalid"],
                         ROOT, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "kvxfer serve: error: --side-channel-host '127.0.0.1' listens on loopback only" \
        in done.stderr, done.stderr
    assert "set --side-channel-host 0.0.0.0" in done.stderr and "Traceback" not in done.stderr


def test_serve_refuses_a_wildcard_side_channel_without_an_advertised_host() -> None:
    done = preloaded.run("kvxfer.cli", ["serve", "--role", "prefill", "--port", "0",
                                        "--side-channel-host", "0.0.0.0"], ROOT, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "kvxfer serve: error:" in done.stderr and "--advertise-host" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarGroup]:
    with SidecarGroup(tmp_path_factory.mktemp("cluster")) as started:
        yield started


def test_a_wildcard_bind_advertises_the_given_host(group: SidecarGroup) -> None:
    prefill, decode = group.start([
        Spec("prefill", extra=("--host", "0.0.0.0", "--side-channel-host", "0.0.0.0",
                               "--advertise-host", "127.0.0.1")),
        Spec("decode", policy="fail")])
    assert prefill.url.startswith("http://127.0.0.1:"), prefill.url
    health = prefill.health()
    assert health["side_channel_host"] == "127.0.0.1" == health["http_host"]
    first, second = disaggregated(prefill, decode, "/v1/completions", BODY)
    assert first.json()["kv_transfer_params"]["remote_host"] == "127.0.0.1"
    assert second.status_code == 200, second.text
    assert decode.metric("kvxfer_kv_transfers_total", outcome="ok") >= 1


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_ipv6_loopback_end_to_end(group: SidecarGroup) -> None:
    v6 = ("--host", "::1", "--side-channel-host", "::1")
    prefill, decode, single = group.start([Spec("prefill", extra=v6),
                                           Spec("decode", policy="fail", extra=v6),
                                           Spec("both", extra=("--host", "::1"))])
    assert prefill.url.startswith("http://[::1]:"), prefill.url
    first, second = disaggregated(prefill, decode, "/v1/completions", BODY)
    assert first.json()["kv_transfer_params"]["remote_host"] == "::1"
    assert second.status_code == 200, second.text
    want = single.post("/v1/completions", BODY).json()["choices"][0]["text"]
    assert second.json()["choices"][0]["text"] == want
    proxy = Launched("proxy", [
        sys.executable, "-m", "proxy", "--host", "::1", "--port", "0",
        "--prefiller-hosts", "::1", "--prefiller-ports", str(prefill.port),
        "--decoder-hosts", "::1", "--decoder-ports", str(decode.port),
        "--health-interval", "0.5"], group.log_dir)
    try:
        proxy.wait_ready(time.monotonic() + 60)
        assert proxy.url.startswith("http://[::1]:"), proxy.url
        wait_until("the proxy sees both", lambda: httpx.get(
            f"{proxy.url}/health", timeout=5, trust_env=False).status_code == 200)
        through = httpx.post(f"{proxy.url}/v1/completions", json=BODY, timeout=60,
                             trust_env=False)
        assert through.status_code == 200, through.text
        assert through.json()["choices"][0]["text"] == want
    finally:
        proxy.stop()


# -- membership: pure parts -----------------------------------------------------------------

def test_names_and_addresses_are_told_apart() -> None:
    assert is_name("prefill.kvxfer.svc") and is_name("decode")
    assert not any(is_name(h) for h in ("127.0.0.1", "::1", "[fd00::1]", "localhost"))
    urls, names = split_hosts(["10.0.0.1", "prefill.svc"], [8100, 8101], "prefiller")
    assert urls == ("http://10.0.0.1:8100",) and names == (("prefill.svc", 8101),)


def test_hosts_file_resolver_reads_the_file_each_time(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# comment\n10.0.0.1 a.svc b.svc\n10.0.0.2 a.svc\n")
    resolve = hosts_file_resolver(hosts)
    assert resolve("a.svc") == ["10.0.0.1", "10.0.0.2"] and resolve("c.svc") == []
    hosts.write_text("10.0.0.3 a.svc\n")
    assert resolve("a.svc") == ["10.0.0.3"]


def test_set_members_adds_retires_and_forgets() -> None:
    config = ProxyConfig(prefill_urls=("http://10.0.0.9:1",), decode_urls=(),
                         decode_names=((NAME, 8200),))
    balancer = Balancer(config)
    joined = balancer.set_members("decode", ["http://10.0.0.1:8200", "http://10.0.0.2:8200"])
    assert [i.url for i in joined] == ["http://10.0.0.1:8200", "http://10.0.0.2:8200"]
    for instance in joined:
        balancer.mark_up(instance)
    busy = joined[0]
    balancer.acquire(busy)
    assert balancer.set_members("decode", ["http://10.0.0.2:8200"]) == []
    assert busy.retired and busy in balancer.instances("decode")  # its call finishes
    assert [i.url for i in balancer.candidates("decode")] == ["http://10.0.0.2:8200"]
    balancer.release(busy)
    balancer.set_members("decode", ["http://10.0.0.2:8200"])
    assert [i.url for i in balancer.instances("decode")] == ["http://10.0.0.2:8200"]


# -- membership and drain with real processes ---------------------------------------------

class Stream:
    """A bounded stream of client requests through the proxy, on a thread; counts."""

    def __init__(self, url: str, count: int, headers: dict[str, str]) -> None:
        self.url, self.count, self.headers = url, count, headers
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60.0, trust_env=False, headers=self.headers) as client:
            for k in range(self.count):
                try:
                    answer = client.post(f"{self.url}/v1/completions",
                                         json={**BODY, "prompt": f"request {k} of a stream"})
                except httpx.HTTPError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.statuses.append(answer.status_code)
                if answer.status_code != 200:
                    self.errors.append(f"{answer.status_code}: {answer.text[:300]}")

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the client stream did not finish in {timeout} s"


def proxy_instances(proxy: Launched, key: str) -> dict[str, dict[str, Any]]:
    body = httpx.get(f"{proxy.url}/health", headers={"authorization": f"Bearer {key}"},
                     timeout=5, trust_env=False).json()
    return {i["url"]: i for i in body.get("instances", [])}


def replace_file(path: Path, text: str) -> None:
    """Rewrite ``path`` as a whole (a new file renamed over it), as an operator's tools
    do: written in place, the proxy's resolver may read it empty mid-write and drop every
    instance the name maps to."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    os.replace(fresh, path)


def wait_until(what: str, check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout} s")


@pytest.mark.heavy  # a long real-model run: the heavy tier
def test_proxy_follows_a_name_and_a_sigterm_drains_without_failed_requests(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A decode name that first maps to one decode, then to two (picked up without a
    restart); then one decode gets SIGTERM while a stream of requests runs: no
    request fails, it exits within its bound, leases and blocks are freed."""
    logs = tmp_path_factory.mktemp("drain")
    key = new_api_key()
    hosts = logs / "hosts"
    with SidecarGroup(logs) as group:
        drain = ("--drain-timeout", "10", "--host", "127.0.0.1")
        prefill, first = group.start([Spec("prefill", api_key=key),
                                      Spec("decode", policy="fail", api_key=key, extra=drain)])
        # Two decodes on one port number cannot share 127.0.0.1: each binds its own
        # loopback address, and the name maps to those addresses.
        replace_file(hosts, f"127.0.0.1 {NAME}\n")
        proxy = Launched("proxy", [
            sys.executable, "-m", "proxy", "--port", "0", "--prefiller-hosts", "127.0.0.1",
            "--prefiller-ports", str(prefill.port), "--decoder-hosts", NAME,
            "--decoder-ports", str(first.port), "--hosts-file", str(hosts),
            "--resolve-interval", "0.3", "--health-interval", "0.3", "--api-key", key],
            logs, {"KVXFER_API_KEY": key})
        try:
            proxy.wait_ready(time.monotonic() + 120)
            url_first = f"http://127.0.0.1:{first.port}"
            wait_until("the first decode in rotation",
                       lambda: proxy_instances(proxy, key).get(url_first, {}).get("healthy"))
            # A second decode on another loopback address with the same port starts later.
            second = group.start_one(Spec("decode", policy="fail", api_key=key, extra=(
                "--host", "127.0.0.2", "--port", str(first.port), "--drain-timeout", "10")))
            url_second = f"http://127.0.0.2:{first.port}"
            replace_file(hosts, f"127.0.0.1 {NAME}\n127.0.0.2 {NAME}\n")
            wait_until("the new decode in rotation",
                       lambda: proxy_instances(proxy, key).get(url_second, {}).get("healthy"))
            stream = Stream(proxy.url, 40, {"authorization": f"Bearer {key}"})
            wait_until("requests flowing", lambda: len(stream.statuses) >= 5, 60)
            served_before = first.metric("kvxfer_http_requests_total",
                                         route="/v1/completions", status="200")
            assert served_before > 0
            signalled = time.monotonic()
            assert first.process is not None
            first.process.send_signal(signal.SIGTERM)
            code = first.process.wait(10 + 5 + 10)
            took = time.monotonic() - signalled
            stream.wait(120)
            assert stream.errors == [], stream.errors
            assert len(stream.statuses) == 40
            assert code == 0, first.log_tail()
            assert took < 10 + 5 + 2, took
            log = first.log_tail(200)
            assert "draining" in log and "Traceback" not in log, log
            # the name no longer maps to the drained decode: it leaves the proxy
            replace_file(hosts, f"127.0.0.2 {NAME}\n")
            wait_until("the drained decode forgotten",
                       lambda: url_first not in proxy_instances(proxy, key))
            later = httpx.post(f"{proxy.url}/v1/completions", json=BODY, timeout=60,
                               headers={"authorization": f"Bearer {key}"}, trust_env=False)
            assert later.status_code == 200, later.text
            prefill.wait_for("every lease released and block freed",
                             lambda h: h["leases"] == 0 and h["used_blocks"] == 0)
            second.wait_for("no block held", lambda h: h["used_blocks"] == 0)
        finally:
            proxy.stop()


def test_a_draining_prefill_refuses_new_work_and_frees_its_lease_in_time(
        group: SidecarGroup) -> None:
    prefill = group.start_one(Spec("prefill", extra=("--drain-timeout", "3")))
    held = prefill.post("/v1/completions", prefill_body(BODY))
    assert held.status_code == 200, held.text
    assert prefill.health()["leases"] == 1
    assert prefill.process is not None
    signalled = time.monotonic()
    prefill.process.send_signal(signal.SIGTERM)
    wait_until("draining", lambda: prefill.get("/health").status_code == 503, 5)
    health = prefill.get("/health")
    assert health.json()["status"] == "draining" and "x-kvxfer-draining" in health.headers
    refused = prefill.post("/v1/completions", BODY)
    assert refused.status_code == 503 and "x-kvxfer-draining" in refused.headers
    assert prefill.process.wait(3 + 5 + 5) == 0
    assert time.monotonic() - signalled < 3 + 5 + 2
    assert "drain timeout" in prefill.log_tail(100)


# -- the TCP benchmark ---------------------------------------------------------------------

def test_bench_transfer_over_tcp_prints_both_paths_and_the_ratio() -> None:
    """As root the TCP half runs across two network namespaces, else over loopback."""
    done = preloaded.run("kvxfer.cli", ["bench", "transfer", "--transport", "tcp", "--cases",
                                        "BLHNC:1:1", "--tokens", "64", "--repeats", "1",
                                        "--layers", "2", "--json"], ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    root = os.geteuid() == 0 and shutil.which("ip") is not None
    assert result["tcp_path"] == "veth" if root else result["tcp_path"].startswith("loopback")
    if root:  # the two namespaces (and the veth pair inside them) are gone
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               check=True).stdout
        assert "kvxb" not in names, names
    [row] = result["rows"]
    assert row["default"]["gb_per_s"] > 0 and row["tcp"]["gb_per_s"] > 0
    assert row["tcp_vs_default"] == round(row["tcp"]["gb_per_s"] / row["default"]["gb_per_s"],
                                          3)
