"""More than one host, for real: prefills, a decode and the proxy in network namespaces.

Each namespace stands for a machine: two prefills, a decode and the proxy. Each has one
interface, ``kvx0``, with an address of its own on a private /24 that only these
namespaces use; the interfaces meet on a bridge inside one more namespace (the
"switch"), which also has one link to the namespace the test runs in, so the test
talks to them as a client on the same network would. UCX is forced onto TCP over
``kvx0`` (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=kvx0``): no shared memory or cma between the
"hosts", and the prefills offer no copies on their host (``--no-host-reads``): namespaces
share the PID space, so a decode would otherwise map a prefill's cache across them. The
single-instance reference (``both``) runs in the test's own namespace.

Checked:

* the accuracy prompts through the proxy (kvxfer-tiny) answer exactly (tokens and
  logprobs) what the reference answers, with the KV read across the network from both
  prefills; every block is freed on every side afterwards;
* a prefill's link cut in the middle of a read (egress slowed so that the read takes
  seconds; ``ip link set kvx0 down`` once part of it has crossed): UCX over TCP notices
  nothing, but the prefill's side channel answers no more heartbeats, so the decode's
  read fails within the heartbeat bound (1.25 x ``--kv-heartbeat-timeout``), well before
  its ``--kv-read-timeout``, naming the silent prefill; the proxy runs the request again
  on the other prefill and the client gets the one-instance answer within a deadline;
  the decode frees its blocks at once and the prefill at its lease TTL, the proxy takes
  the cut-off prefill out of rotation and the decode serves from the other one; once
  the link is back, the first prefill serves again;
* SmolLM2 once: a prefill and a decode in two namespaces answer a chat question exactly
  as one instance does.

Needs root and ``ip netns`` (skipped elsewhere, saying which). Every namespace and link
is removed at the end, also on failure; only processes started here are stopped, by
PID.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecars import (
    READY_TIMEOUT_S,
    Launched,
    NsSpec,
    Sidecar,
    SidecarGroup,
    Spec,
    at,
    disaggregated,
    health_inside,
)

from kvxfer.harness.network import UCX_ENV, Network, why_not
from kvxfer.transfer.peers import DEAD_PEER_S

ROOT = Path(__file__).resolve().parent.parent
NO_HOST_READS = "--no-host-reads"  # a prefill on another "host" is read over the network
LEASE_TTL_S = 3.0               # the prefill frees an unread lease this soon
READ_TIMEOUT_S = 8.0            # the decode gives up a read this soon
HEARTBEAT_S = 2.0               # ... or one whose prefill answers no heartbeat this long
HEARTBEAT_BOUND_S = 1.25 * HEARTBEAT_S  # after the cut, the read fails this soon
HEARTBEAT_SLACK_S = 1.5         # two busy cores; the bound plus it stays far below 8 s
CUT_DEADLINE_S = HEARTBEAT_BOUND_S + HEARTBEAT_SLACK_S + 7.0  # the retried answer
SLOW_RATE = "10mbit"            # the prefill's egress during the cut test: ~1.2 MB/s
# the link was down ~20 s: TCP's next retransmit comes within about as long again
QUARANTINE_END_S = 90.0
CUT_PROMPT_TOKENS = 1800        # kvxfer-tiny: 2 KiB of KV per token, ~3.6 MB, ~3 s slowed
REAL_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces() -> None:
    """Probe once, when the first test of this file runs (not while collecting)."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)


@dataclass
class Rig:
    network: Network
    reference: Sidecar
    prefills: dict[str, Sidecar]   # by role (namespace) name
    decode: Sidecar
    proxy: Launched


PREFILLS = ("prefill", "prefill2")


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    made = Network((*PREFILLS, "decode", "proxy"))
    try:
        yield made
    finally:
        made.close()  # the fixtures using it stopped their processes first


@pytest.fixture(scope="module")
def rig(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    log_dir = tmp_path_factory.mktemp("netns")
    proxy: Launched | None = None
    try:
        # the single instance runs NIXL too (a both instance plays the prefill and the
        # decode): not on the namespaces' UCX devices, which this namespace lacks
        with SidecarGroup(log_dir) as here, SidecarGroup(log_dir, env=UCX_ENV) as group:
            host = ("--host", "0.0.0.0")
            reference = here.start_one(Spec("both"))
            *prefills, decode = group.start([
                *(NsSpec("prefill", netns=network.ns(role), extra=(
                    *host, "--side-channel-host", network.address(role), NO_HOST_READS,
                    "--lease-ttl", str(LEASE_TTL_S))) for role in PREFILLS),
                NsSpec("decode", netns=network.ns("decode"), policy="fail", extra=(
                    *host, "--kv-read-timeout", str(READ_TIMEOUT_S),
                    "--kv-heartbeat-timeout", str(HEARTBEAT_S))),
            ])
            for role, sidecar in zip(PREFILLS, prefills, strict=True):
                at(sidecar, network.address(role))
            at(decode, network.address("decode"))
            proxy = Launched("proxy", [
                "ip", "netns", "exec", network.ns("proxy"), sys.executable, "-m", "proxy",
                "--host", "0.0.0.0", "--port", "0", "--health-interval", "0.5",
                "--connect-timeout", "2",
                "--prefiller-hosts", *(network.address(role) for role in PREFILLS),
                "--prefiller-ports", *(str(s.port) for s in prefills),
                "--decoder-hosts", network.address("decode"),
                "--decoder-ports", str(decode.port)], log_dir)
            proxy.wait_ready(time.monotonic() + READY_TIMEOUT_S)
            at(proxy, network.address("proxy"))
            yield Rig(network, reference, dict(zip(PREFILLS, prefills, strict=True)), decode,
                      proxy)
    finally:
        if proxy is not None:
            proxy.stop()


def instances(proxy: Launched) -> dict[str, bool]:
    """{url: healthy} as the proxy's /health reports its instances."""
    body = proxy.get("/health", timeout=5.0).json()
    return {i["url"]: bool(i["healthy"]) for i in body["instances"]}


def wait_instances(proxy: Launched, what: str, check: Any, timeout: float = 20.0) -> None:
    """Until ``check(instances(proxy))`` holds."""
    deadline = time.monotonic() + timeout
    seen: dict[str, bool] = {}
    while time.monotonic() < deadline:
        try:
            seen = instances(proxy)
            if check(seen):
                return
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"proxy: {what} not within {timeout} s; instances {seen}\n"
                         f"{proxy.log_tail(10)}")


def all_healthy(seen: dict[str, bool]) -> bool:
    return len(seen) == len(PREFILLS) + 1 and all(seen.values())


def completion(target: Launched, prompt: str, max_tokens: int) -> dict[str, Any]:
    response = target.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, "logprobs": 1})
    assert response.status_code == 200, f"{target.name}: {response.status_code} {response.text}"
    return dict(response.json()["choices"][0])


def assert_same(got: dict[str, Any], want: dict[str, Any], prompt: str) -> None:
    assert got["text"] == want["text"], f"{prompt!r}: tokens differ"
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"], prompt
    for a, b in zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"],
                    strict=True):
        assert abs(a - b) <= 1e-4, f"{prompt!r}: logprob {a} vs {b}"


def assert_serves(rig: Rig, prompts: list[str], max_tokens: int = 16) -> None:
    """Each prompt through the proxy answers what the reference answers."""
    for prompt in prompts:
        want = completion(rig.reference, prompt, max_tokens)
        assert_same(completion(rig.proxy, prompt, max_tokens), want, prompt)


def transfers(sidecar: Sidecar, outcome: str) -> float:
    return sidecar.metric("kvxfer_kv_transfers_total", outcome=outcome)


def done_leases(sidecar: Sidecar) -> float:
    return sidecar.metric("kvxfer_kv_leases_released_total", reason="done")


def test_accuracy_prompts_across_namespaces(rig: Rig) -> None:
    data = json.loads((ROOT / "scripts" / "accuracy_prompts.json").read_text())
    prompts, max_tokens = data["prompts"][:4], int(data["max_tokens"])
    wait_instances(rig.proxy, "every instance healthy", all_healthy)
    reads = transfers(rig.decode, "ok")
    done = {role: done_leases(s) for role, s in rig.prefills.items()}
    assert_serves(rig, prompts, max_tokens)
    assert transfers(rig.decode, "ok") == reads + len(prompts), "not every answer read KV"
    assert rig.decode.metric("kvxfer_kv_transfer_bytes_total") > 0
    for role, sidecar in rig.prefills.items():  # round robin: each prefill served some
        assert done_leases(sidecar) > done[role], f"{role} served no read"
        sidecar.wait_for("all blocks free", lambda h: h["used_blocks"] == 0 and
                         h["leases"] == 0, timeout=10)
    rig.decode.wait_for("all blocks free", lambda h: h["used_blocks"] == 0, timeout=10)


def connect_every_prefill(rig: Rig) -> None:
    """Serve through the proxy until the decode has read from every prefill: it connects
    to each (handshake, NIXL, the probe that picks its path) before the link is slowed."""
    start = {role: done_leases(sidecar) for role, sidecar in rig.prefills.items()}
    for i in range(8):
        if all(done_leases(s) > start[role] for role, s in rig.prefills.items()):
            return
        completion(rig.proxy, f"Warm up {i}: " + "tokens " * 20, 2)
    raise AssertionError("the proxy did not send a request to every prefill")


@pytest.mark.heavy  # a long run: the heavy tier (test_link_return cuts links there too)
def test_link_cut_mid_read(rig: Rig) -> None:
    network, decode = rig.network, rig.decode
    wait_instances(rig.proxy, "every instance healthy", all_healthy)
    connect_every_prefill(rig)  # a cut while connecting would end at the read timeout
    prompt = ("The prefill host drops off the network while its KV is read. " * 40)
    prompt = prompt[:CUT_PROMPT_TOKENS]
    failed_before = transfers(decode, "failed")
    for role in PREFILLS:
        network.slow(role, SLOW_RATE)
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            response = rig.proxy.post("/v1/completions", {
                "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60.0)
            result["status"], result["body"] = response.status_code, response.text
        except httpx.HTTPError as exc:
            result["status"], result["body"] = None, repr(exc)
        result["ended"] = time.monotonic()

    cut = ""
    try:
        client = threading.Thread(target=ask, daemon=True)
        client.start()
        # the read is under way once a prefill holds the lease and bytes stream out of it
        deadline = time.monotonic() + 30
        while not cut:
            assert time.monotonic() < deadline, "no prefill leased the request's blocks"
            cut = next((r for r, s in rig.prefills.items() if s.health()["leases"]), "")
            time.sleep(0.02)
        prefill = rig.prefills[cut]
        retries_before = rig.proxy.metric("kvxfer_proxy_retries_total", role="decode")
        expired_before = prefill.metric("kvxfer_kv_leases_released_total", reason="expired")
        before = network.sent_bytes(cut)
        while (sent := network.sent_bytes(cut) - before) < 256 * 1024:
            assert time.monotonic() < deadline, f"only {sent} bytes left {cut}"
            time.sleep(0.02)
        cut_at = time.monotonic()
        network.link(cut, up=False)
        for role in PREFILLS:  # the other prefill at full speed for the retry
            if role != cut:
                network.slow(role, None)
        # UCX over TCP notices nothing; the heartbeats on the side channel do: the read
        # fails within their bound, long before the read timeout would end it
        while transfers(decode, "failed") == failed_before:
            assert time.monotonic() - cut_at < READ_TIMEOUT_S + 5, "the read never failed"
            time.sleep(0.05)
        read_failed = time.monotonic() - cut_at
        print(f"link cut: the decode's read failed {read_failed:.2f} s after the cut")
        assert read_failed <= HEARTBEAT_BOUND_S + HEARTBEAT_SLACK_S < READ_TIMEOUT_S - 1, \
            f"the read failed {read_failed:.1f} s after the cut: at its read timeout?"
        assert "answered no heartbeat" in decode.log_tail(200) and \
            network.address(cut) in decode.log_tail(200), decode.log_tail(20)
        client.join(CUT_DEADLINE_S + 5)
        assert not client.is_alive(), f"no answer {CUT_DEADLINE_S + 5} s after the cut"
        failed_at = result["ended"]
        assert failed_at - cut_at <= CUT_DEADLINE_S, result
        # the proxy ran the request again, on the other prefill, and the client got the
        # one-instance answer
        assert transfers(decode, "failed") == failed_before + 1
        assert result["status"] == 200, result
        want = completion(rig.reference, prompt, 4)
        assert json.loads(result["body"])["choices"][0]["text"] == want["text"], result
        assert rig.proxy.metric("kvxfer_proxy_retries_total", role="decode") \
            == retries_before + 1
        # the READ given up is still in flight: once the link is back, the prefill's
        # kernel delivers what it held and UCX places it. The decode keeps the request's
        # blocks out of use until then (quarantined), and uses nothing else
        health = decode.wait_for("the request ended", lambda h: not h["requests_in_flight"],
                                 timeout=10)
        assert health["quarantined_blocks"] >= CUT_PROMPT_TOKENS // 2 // 16, health
        assert health["used_blocks"] == health["quarantined_blocks"], health
        # the prefill (cut off, told nothing) frees its blocks when its lease expires;
        # asked over its own loopback
        deadline = time.monotonic() + LEASE_TTL_S + 10
        while (inside := health_inside(network, cut, prefill))["used_blocks"]:
            assert time.monotonic() < deadline, f"{cut} still holds blocks: {inside}"
            time.sleep(0.2)
        assert inside["leases"] == 0, inside
        # the survivors serve on: the proxy drops the cut-off prefill from rotation
        # and the decode reads from the other one
        for role in PREFILLS:
            network.slow(role, None)
        wait_instances(rig.proxy, f"{cut} out of rotation",
                       lambda seen: seen.get(prefill.url) is False, timeout=15)
        assert_serves(rig, ["A", "1, 1, 2, 3, 5, 8, 13,", "The quick brown fox"])
    finally:
        if cut:
            network.link(cut, up=True)
        for role in PREFILLS:
            network.slow(role, None)
    # back on the network: the READ given up lands, which the decode sees, and only then
    # frees the quarantined blocks
    back = time.monotonic()
    health = decode.wait_for("quarantined blocks freed", lambda h: not h["quarantined_blocks"],
                             timeout=QUARANTINE_END_S)
    print(f"link back: the decode freed the quarantined blocks {time.monotonic() - back:.1f} s "
          f"later")
    assert health["used_blocks"] == 0, health
    assert "READs of request" in decode.log_tail(200), decode.log_tail(20)
    # after the decode's fail-fast pause for a peer whose read failed, the cut prefill
    # serves again too
    wait_instances(rig.proxy, f"{cut} back in rotation", all_healthy, timeout=20)
    time.sleep(max(0.0, failed_at + DEAD_PEER_S + 0.5 - time.monotonic()))
    assert prefill.metric("kvxfer_kv_leases_released_total", reason="expired") \
        == expired_before + 1
    done = done_leases(prefill)
    assert_serves(rig, ["A", "B", "C", "D"], max_tokens=4)
    assert done_leases(prefill) > done, f"{cut} took no request after it came back"


def test_real_model_across_namespaces(network: Network, tmp_path: Path) -> None:
    """SmolLM2 once: a prefill and a decode in two namespaces answer a chat question
    exactly as one instance does, driven the way the proxy drives them."""
    host = ("--host", "0.0.0.0")
    model = ("--model", REAL_MODEL, "--num-blocks", "64")
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0, "logprobs": True}
    # the single instance runs NIXL too: not on the namespaces' UCX devices (see rig)
    with SidecarGroup(tmp_path) as here, SidecarGroup(tmp_path, env=UCX_ENV) as group:
        reference = here.start_one(Spec("both", extra=model))
        prefill, decode = group.start([
            NsSpec("prefill", netns=network.ns("prefill2"), extra=(
                *host, *model, "--side-channel-host", network.address("prefill2"),
                NO_HOST_READS)),
            NsSpec("decode", netns=network.ns("decode"), policy="fail",
                   extra=(*host, *model)),
        ])
        at(prefill, network.address("prefill2"))
        at(decode, network.address("decode"))
        want = reference.post("/v1/chat/completions", body)
        assert want.status_code == 200, want.text
        _, got = disaggregated(prefill, decode, "/v1/chat/completions", body)
        assert got.status_code == 200, got.text
        answer, expected = got.json()["choices"][0], want.json()["choices"][0]
        assert answer["message"]["content"] == expected["message"]["content"]
        assert "Paris" in answer["message"]["content"]
        pairs = zip(answer["logprobs"]["content"], expected["logprobs"]["content"], strict=True)
        for a, b in pairs:
            assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) <= 1e-4
        assert transfers(decode, "ok") == 1
        prefill.wait_for("all blocks free", lambda h: h["used_blocks"] == 0, timeout=10)
        decode.wait_for("all blocks free", lambda h: h["used_blocks"] == 0, timeout=10)
