"""Sidecars under load and when transfers fail: real processes, real HTTP, NIXL and ZMQ.

* 8 concurrent disaggregated requests (all with the same X-Request-Id) answer
  like a plain instance, and every block on both sides comes back;
* a decode whose READ fails (bad block ids) tells the prefill, which frees the
  lease at once; an unused lease expires after its TTL;
* a prefill killed after answering: policy ``recompute`` answers correctly and
  counts a recompute, policy ``fail`` answers 502 naming the transfer failure;
* a client that leaves while its KV read is in flight: the decode frees the
  blocks only after the read ended (the deferred-abort rule);
* /metrics shows the transfer; idle sidecars use little CPU.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import zmq
from shared_servers import PullPair
from sidecars import Sidecar, SidecarGroup, Spec, disaggregated, free_port, prefill_body

from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.envelope import encode_message
from kvxfer.wire.messages import RenewAck

BODY = {"max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": True}
PROMPTS = [f"request number {i}: " + "abcdefgh" * (i + 1) for i in range(8)]
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def rig(plain: Sidecar, pull_pair: PullPair, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[dict[str, Sidecar]]:
    """A reference, a prefill, and a decode for each failure policy: the run's shared
    sidecars (``shared_servers.py``) and a recompute decode of this module's own (a test
    parks a request on it)."""
    with SidecarGroup(tmp_path_factory.mktemp("rig")) as group:
        recompute = group.start_one(Spec("decode", policy="recompute"))
        yield {"both": plain, "prefill": pull_pair.prefill, "recompute": recompute,
               "fail": pull_pair.decode}


@pytest.fixture(scope="module")
def small_decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A decode with 8 blocks of 16 tokens: one 100-token request fills most of it."""
    with SidecarGroup(tmp_path_factory.mktemp("small")) as group:
        yield group.start_one(Spec("decode", policy="fail", num_blocks=8))


@pytest.fixture(scope="module")
def short_lease(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A prefill whose leases last 2 s (the kill test kills it: use it before that)."""
    with SidecarGroup(tmp_path_factory.mktemp("short")) as group:
        yield group.start_one(Spec("prefill", extra=("--lease-ttl", "2")))


def reference(both: Sidecar, prompt: str) -> dict[str, Any]:
    response = both.post(COMPLETIONS, {**BODY, "prompt": prompt})
    assert response.status_code == 200, response.text
    return dict(response.json()["choices"][0])


def same_answer(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return got["logprobs"]["tokens"] == want["logprobs"]["tokens"] and all(
        abs(a - b) < 1e-4 for a, b in zip(got["logprobs"]["token_logprobs"],
                                          want["logprobs"]["token_logprobs"], strict=True))


def all_blocks_free(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0
                and health["free_blocks"] == health["num_blocks"])


def test_eight_concurrent_requests_with_one_request_id(rig: dict[str, Sidecar]) -> None:
    prefill, decode = rig["prefill"], rig["fail"]
    want = [reference(rig["both"], p) for p in PROMPTS]
    done_before = prefill.metric("kvxfer_kv_leases_released_total", reason="done")

    def one(prompt: str) -> tuple[httpx.Response, httpx.Response]:
        return disaggregated(prefill, decode, COMPLETIONS, {**BODY, "prompt": prompt},
                             request_id="same-id")

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    lease_ids = [first.json()["kv_transfer_params"]["remote_request_id"] for first, _ in results]
    assert len(set(lease_ids)) == len(PROMPTS), f"lease ids collide: {lease_ids}"
    # random, not made from the client's X-Request-Id (which anyone could guess)
    assert not any("same-id" in i for i in lease_ids) and min(map(len, lease_ids)) >= 22
    for i, (_, second) in enumerate(results):
        assert second.status_code == 200, f"request {i}: {second.text}"
        assert same_answer(second.json()["choices"][0], want[i]), f"request {i} differs"
    prefill.wait_for("every lease released and block free", all_blocks_free)
    decode.wait_for("every block free", all_blocks_free)
    released = prefill.metric("kvxfer_kv_leases_released_total", reason="done") - done_before
    assert released == len(PROMPTS)


@pytest.mark.parametrize("path", ["transfer", "plain"])
def test_requests_wait_for_blocks_instead_of_failing(rig: dict[str, Sidecar],
                                                     small_decode: Sidecar, path: str) -> None:
    """4 requests of 60 + 40 tokens (7 blocks each) on an 8-block decode: they queue
    (remote ones before their READ, running ones by preemption) and all answer right."""
    body = {**BODY, "max_tokens": 40}
    prompts = [f"{i}" * 59 for i in range(4)]  # BOS + 59 bytes = 60 tokens = 4 blocks
    want = [ok_json(rig["both"].post(COMPLETIONS, {**body, "prompt": p}))["choices"][0]
            for p in prompts]

    def one(prompt: str) -> httpx.Response:
        if path == "plain":
            return small_decode.post(COMPLETIONS, {**body, "prompt": prompt})
        return disaggregated(rig["prefill"], small_decode, COMPLETIONS,
                             {**body, "prompt": prompt})[1]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(one, prompts))
    for i, answer in enumerate(answers):
        assert same_answer(ok_json(answer)["choices"][0], want[i]), f"request {i} differs"
    small_decode.wait_for("every block free", all_blocks_free)
    rig["prefill"].wait_for("every lease released", all_blocks_free)


def ok_json(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, f"{response.status_code}: {response.text}"
    return dict(response.json())


def test_metrics_show_the_transfer(rig: dict[str, Sidecar]) -> None:
    prefill, decode = rig["prefill"], rig["fail"]
    before = decode.metrics()
    first, second = disaggregated(prefill, decode, COMPLETIONS, {**BODY, "prompt": PROMPTS[3]})
    assert second.status_code == 200, second.text
    after = decode.metrics()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    blocks = len(first.json()["kv_transfer_params"]["remote_block_ids"])
    # 4 layers x 4 heads x 16 tokens x 2 x 16 floats = 32 KiB per block, all moved
    assert grew("kvxfer_kv_transfer_bytes_total") == blocks * 32768
    assert grew("kvxfer_kv_transfer_descriptors_total") >= 1
    assert grew("kvxfer_kv_transfer_duration_seconds_count") == 1
    # one sample per read in each size histogram, summing to what the counters say
    assert grew("kvxfer_kv_transfer_size_bytes_count") == 1
    assert grew("kvxfer_kv_transfer_size_bytes_sum") == blocks * 32768
    assert grew("kvxfer_kv_transfer_size_descriptors_count") == 1
    assert (grew("kvxfer_kv_transfer_size_descriptors_sum")
            == grew("kvxfer_kv_transfer_descriptors_total"))
    assert grew("kvxfer_kv_transfers_total", outcome="ok") == 1
    assert grew("kvxfer_http_requests_total", route=COMPLETIONS, status="200") == 1
    assert grew("kvxfer_generation_tokens_total") == BODY["max_tokens"]


def test_failed_read_releases_the_prefill_lease(rig: dict[str, Sidecar]) -> None:
    prefill, decode = rig["prefill"], rig["fail"]
    failed_before = prefill.metric("kvxfer_kv_leases_released_total", reason="failed")
    body = {**BODY, "prompt": PROMPTS[2]}
    first = prefill.post(COMPLETIONS, prefill_body(body), headers={"x-request-id": "failing"})
    params = first.json()["kv_transfer_params"]
    prefill.wait_for("the lease held", lambda h: h["leases"] == 1)
    bad = [10_000 + i for i in range(len(params["remote_block_ids"]))]
    second = decode.post(COMPLETIONS, {**body, "kv_transfer_params": {
        **params, "remote_block_ids": bad}})
    assert second.status_code == 502, second.text
    error = second.json()["error"]
    assert error["type"] == "kv_transfer_error"
    assert "block id 10000" in error["message"] and params["remote_engine_id"] in error["message"]
    prefill.wait_for("the lease released", all_blocks_free)
    # the decode's "done" said it gave up
    assert prefill.metric("kvxfer_kv_leases_released_total",
                          reason="failed") == failed_before + 1
    decode.wait_for("every block free", all_blocks_free)
    # A late "done" for the ended lease must never match a new lease: its id is not reused.
    again = prefill.post(COMPLETIONS, prefill_body(body),
                         headers={"x-request-id": params["remote_request_id"]})
    fresh = again.json()["kv_transfer_params"]
    assert fresh["remote_request_id"] != params["remote_request_id"]
    ok_json(decode.post(COMPLETIONS, {**body, "kv_transfer_params": fresh}))
    prefill.wait_for("the second lease released", all_blocks_free)


def test_unread_lease_expires(short_lease: Sidecar) -> None:
    first = short_lease.post(COMPLETIONS, prefill_body({**BODY, "prompt": PROMPTS[0]}))
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["lease_expires_at"] - time.time() < 2.5
    held = len(params["remote_block_ids"])
    short_lease.wait_for("the blocks leased", lambda h: h["used_blocks"] == held)
    short_lease.wait_for("the lease expired", all_blocks_free, timeout=15)
    assert short_lease.metric("kvxfer_kv_leases_released_total", reason="expired") == 1


def test_prefill_killed_after_answering(rig: dict[str, Sidecar], short_lease: Sidecar) -> None:
    bodies = [{**BODY, "prompt": p} for p in PROMPTS[4:6]]
    answers = [short_lease.post(COMPLETIONS, prefill_body(b)) for b in bodies]
    assert all(a.status_code == 200 for a in answers)
    params = [a.json()["kv_transfer_params"] for a in answers]
    short_lease.kill()
    recompute, fail = rig["recompute"], rig["fail"]
    recomputes = recompute.metric("kvxfer_kv_recomputes_total")

    ok = recompute.post(COMPLETIONS, {**bodies[0], "kv_transfer_params": params[0]})
    assert ok.status_code == 200, ok.text
    assert same_answer(ok.json()["choices"][0], reference(rig["both"], PROMPTS[4]))
    assert recompute.metric("kvxfer_kv_recomputes_total") == recomputes + 1
    assert recompute.metric("kvxfer_kv_transfer_failures_total") >= 1

    failed = fail.post(COMPLETIONS, {**bodies[1], "kv_transfer_params": params[1]})
    assert failed.status_code == 502, failed.text
    error = failed.json()["error"]
    assert error["type"] == "kv_transfer_error"
    assert "KV transfer" in error["message"] and params[1]["remote_engine_id"] in error["message"]
    assert str(params[1]["remote_port"]) in error["message"]
    for decode in (recompute, fail):
        decode.wait_for("every block free", all_blocks_free)


STALLING = CompatInfo(model="stalling", dtype="float32", cache_dtype="float32", head_size=8,
                      total_kv_heads=1, num_layers=1)  # a renewal's hash is not checked


def test_abort_during_a_read_waits_for_the_read(rig: dict[str, Sidecar]) -> None:
    """A peer that accepts the handshake but answers only when told keeps the read
    in flight for as long as the test wants (a real ZMQ socket, a stalling peer)."""
    decode = rig["recompute"]
    recomputes = decode.metric("kvxfer_kv_recomputes_total")
    aborted = decode.metric("kvxfer_kv_transfers_total", outcome="aborted")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    client = httpx.Client(timeout=2.0, trust_env=False)
    body = {**BODY, "prompt": "Hello stalled peer", "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": "prefill-stalling", "remote_host": "127.0.0.1",
        "remote_port": port, "remote_block_ids": [0, 1], "remote_request_id": "stalled",
        "remote_num_tokens": 19, "tp_size": 1, "lease_expires_at": time.time() + 60}}
    outcome: list[BaseException] = []

    def send() -> None:
        try:
            client.post(f"{decode.url}{COMPLETIONS}", json=body)
        except httpx.TimeoutException as exc:  # the client gives up: it disconnects
            outcome.append(exc)

    thread = threading.Thread(target=send)
    try:
        thread.start()
        assert router.poll(20_000), "the decode never claimed the lease"
        claimer, _claim = router.recv_multipart()
        router.send_multipart([claimer, encode_message(RenewAck("stalled", True, 60.0),
                                                       compat=STALLING)])  # granted
        assert router.poll(20_000), "the decode never asked for the peer's metadata"
        identity, *_ = router.recv_multipart()
        decode.wait_for("the request parked on its blocks",
                        lambda h: h["used_blocks"] == 2 and h["requests_in_flight"] == 1)
        thread.join(timeout=20)
        client.close()
        assert outcome, "the request should have timed out on the client side"
        time.sleep(0.5)  # ample time for the server to notice the disconnect
        held = decode.health()
        assert held["used_blocks"] == 2, "blocks freed while the READ could still write them"
        router.send_multipart([identity, b"not a kvxfer message"])
        decode.wait_for("the aborted request's blocks free", all_blocks_free)
        assert decode.health()["requests_in_flight"] == 0
    finally:
        thread.join(timeout=20)
        client.close()
        router.close()
        ctx.term()
    assert decode.metric("kvxfer_kv_transfers_total", outcome="aborted") == aborted + 1
    assert decode.metric("kvxfer_kv_recomputes_total") == recomputes, "aborted, not recomputed"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_sidecars_use_little_cpu(rig: dict[str, Sidecar]) -> None:
    sidecars = [rig["prefill"], rig["fail"]]
    for sidecar in sidecars:
        sidecar.wait_for("idle", all_blocks_free)
    time.sleep(3.0)
    start = {s.pid: cpu_seconds(s.pid) for s in sidecars}
    began = time.monotonic()
    time.sleep(3.0)
    elapsed = time.monotonic() - began
    for sidecar in sidecars:
        share = (cpu_seconds(sidecar.pid) - start[sidecar.pid]) / elapsed
        print(f"idle {sidecar.spec.role} sidecar: {100 * share:.2f}% of a core")
        assert share < 0.05, f"idle {sidecar.spec.role} uses {100 * share:.1f}% of a core"
