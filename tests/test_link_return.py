"""A read (pull) or a push given up while its link was down must not write into another
request once the link is back.

A prefill and a decode on two "hosts" (network namespaces, UCX over TCP), the decode with a
small cache (``--num-blocks 120``) so that the blocks of a long prompt are soon another
request's. The prefill's link is cut while the decode reads a long prompt; the decode gives
the read up (heartbeats) and serves on, clients ask it for completions the whole time, and
the link comes back while they run. What the prefill's kernel still held for the old
connection then lands. Every answer is compared with one instance's: before the decode kept
such blocks out of use (quarantined), the pull run served 6 wrong answers of 78. In push
mode the prefill WRITEs the long prompt into blocks the decode reserved; the decode gives
the push up at the reservation's deadline plus the grace, and keeps the blocks out of use
until the prefill says its WRITEs ended, which it can only say once they landed. Heavy
tier: about a minute per mode. The single instance is the run's shared one (``plain``, see
``shared_servers.py``), whose answers to the clients' prompts both modes compare with.

Needs root and ``ip netns`` (skipped elsewhere, saying which).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecars import NsSpec, Sidecar, SidecarGroup, at, disaggregated, prefill_body

from kvxfer.harness.network import UCX_ENV, Network, why_not
from kvxfer.wire.reservations import PUSH_GRACE_S

pytestmark = pytest.mark.heavy

HEARTBEAT_S = 2.0
NUM_BLOCKS = 120                 # kvxfer-tiny, 16-token blocks: 1,920 tokens in all
CUT_PROMPT = ("A long prompt read while its prefill drops off the network. " * 40)[:1800]
DOWN_S = 15.0                    # the link stays down this long
QUARANTINE_END_S = 90.0          # TCP retransmits within this once the link is back
AFTER_S = 60.0                   # the clients' answers once the blocks are free, within
CLIENTS = 3
CLIENT_PROMPTS = [f"Client {i} asks about blocks, links and stale bytes. " * 8
                  for i in range(6)]  # ~410 tokens, +150: three hold 105 of the 120 blocks
MAX_TOKENS = 150
RESERVE_S = 8.0                  # push: the reservation outlives the slowed push


@pytest.fixture(scope="module")
def want(plain: Sidecar) -> dict[str, dict[str, Any]]:
    """One instance's answer to each client prompt."""
    return {p: completion(plain, p) for p in CLIENT_PROMPTS}


@pytest.fixture
def network() -> Iterator[Network]:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    made = Network(("lrprefill", "lrdecode"))
    try:
        yield made
    finally:
        made.close()


def completion(sidecar: Sidecar, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
    response = sidecar.post("/v1/completions", body, timeout=120.0)
    assert response.status_code == 200, f"{sidecar.spec.name}: {response.text}"
    return dict(response.json()["choices"][0])


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    if got["text"] != want["text"]:
        return False
    pairs = zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"],
                strict=True)
    return all(abs(a - b) <= 1e-4 for a, b in pairs)


def cut_request(prefill: Sidecar, decode: Sidecar, mode: str,
                body: dict[str, Any]) -> Callable[[], httpx.Response]:
    """A request prefilled and decoded as the proxy would: what asks the decode, which
    returns its answer. Pull: the prefill's answer names its blocks, and the decode reads
    them once asked. Push: the decode reserves first and the prefill WRITEs into the
    reservation while it computes, before it answers (here, at once)."""
    if mode == "pull":
        return lambda: disaggregated(prefill, decode, "/v1/completions", body)[1]
    reserved = decode.post("/v1/kv/reserve", {"endpoint": "/v1/completions", "body": body})
    assert reserved.status_code == 200, reserved.text
    first = prefill.post("/v1/completions", {**prefill_body(body), "kv_transfer_params": {
        "do_remote_decode": True, "kv_reservation": reserved.json()["kv_reservation"]}})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    return lambda: decode.post("/v1/completions", {**body, "kv_transfer_params": params},
                               timeout=120.0)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_bytes_of_a_transfer_given_up_never_land_in_another_request(
        network: Network, tmp_path: Path, mode: str, want: dict[str, dict[str, Any]]) -> None:
    host = ("--host", "0.0.0.0")
    push = ("--kv-transfer-mode", "push", "--lease-ttl", str(RESERVE_S),
            "--side-channel-host", network.address("lrdecode")) if mode == "push" else ()
    with SidecarGroup(tmp_path, env=UCX_ENV) as group:
        prefill, decode = group.start([
            NsSpec("prefill", netns=network.ns("lrprefill"), extra=(
                *host, "--side-channel-host", network.address("lrprefill"),
                "--no-host-reads", "--lease-ttl", "3")),
            NsSpec("decode", netns=network.ns("lrdecode"), policy="fail", extra=(
                *host, "--num-blocks", str(NUM_BLOCKS), "--kv-read-timeout", "8",
                "--kv-heartbeat-timeout", str(HEARTBEAT_S), *push)),
        ])
        at(prefill, network.address("lrprefill"))
        at(decode, network.address("lrdecode"))
        body = {"prompt": "warm up", "max_tokens": 2, "temperature": 0}
        warm = cut_request(prefill, decode, mode, body)()
        assert warm.status_code == 200, warm.text

        network.slow("lrprefill", "10mbit")  # ~3 s for the long prompt's KV
        cut: dict[str, Any] = {}

        def read_long() -> None:
            cut["status"] = decode_long().status_code

        wrong: list[str] = []
        served: list[float] = []
        stop = threading.Event()

        def client(i: int) -> None:
            k = i
            while not stop.is_set():
                prompt = CLIENT_PROMPTS[k % len(CLIENT_PROMPTS)]
                k += CLIENTS
                got = completion(decode, prompt)
                served.append(time.monotonic())
                if not same(got, want[prompt]):
                    wrong.append(prompt[:9])

        reader = threading.Thread(target=read_long, daemon=True)
        clients = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(CLIENTS)]
        linked = True
        try:
            before = network.sent_bytes("lrprefill")
            decode_long = cut_request(prefill, decode, mode, {
                "prompt": CUT_PROMPT, "max_tokens": 4, "temperature": 0})
            reader.start()
            deadline = time.monotonic() + 30
            while network.sent_bytes("lrprefill") - before < 256 * 1024:
                assert time.monotonic() < deadline, "the long prompt's read never began"
                time.sleep(0.02)
            network.link("lrprefill", up=False)
            linked = False
            reader.join(HEARTBEAT_S + 15 + (RESERVE_S + PUSH_GRACE_S if push else 0))
            assert cut.get("status") == 502, f"the cut transfer ended {cut}"
            assert decode.health()["quarantined_blocks"] > 0
            for thread in clients:
                thread.start()
            time.sleep(DOWN_S)
            assert decode.health()["quarantined_blocks"] > 0, "freed while the link was down"
            network.link("lrprefill", up=True)
            linked = True
            back = time.monotonic()
            # the old READ or WRITE lands once TCP retransmits (its backoff grew while the
            # link was down); until then its blocks stay out of use
            decode.wait_for("the quarantined blocks freed",
                            lambda h: not h["quarantined_blocks"], timeout=QUARANTINE_END_S)
            freed = time.monotonic()
            deadline = freed + AFTER_S
            while sum(t > freed for t in served) < 2 * CLIENTS:
                assert time.monotonic() < deadline, "the decode served little once it was back"
                time.sleep(0.1)
        finally:
            stop.set()
            if not linked:
                network.link("lrprefill", up=True)
            for thread in clients:
                thread.join(60)
        assert not wrong, f"{len(wrong)} wrong answers of {len(served)}: {wrong}"
        # freed by the writer's word once its WRITEs ended, not by taking it for gone
        assert "no longer runs" not in decode.log_tail(2000)
        decode.wait_for("nothing held", lambda h: not h["used_blocks"], timeout=30)
        print(f"link return ({mode}): {len(served)} answers, all right; the quarantined "
              f"blocks were freed {freed - back:.1f} s after the link was back")
