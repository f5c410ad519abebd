"""A vLLM decode with KvxferConnector and prefills that differ from it. One it cannot read
from (another model) fails the request by its policy with an error naming the peer and
the field; nothing hangs and neither side keeps blocks. One that keeps another block size
(a vLLM prefill with ``--block-size 64``, a kvxfer sidecar with 16-token blocks; the decode
has vLLM's CPU default, 128) or packs K and V otherwise (a sidecar) is read and converted:
the answer is the single vLLM instance's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import PAIR_LEASE_TTL, completion, metric, proxy_for, wait_idle
from sidecars import Spec, prefill_body, sidecars

from kvxfer.bench.vllm import (
    SERVED_NAME,
    VllmServer,
    kv_transfer_config,
    model_directory,
    prompt_ids,
)


def pair_sidecar(pair_key: Path) -> tuple[str, ...]:
    """A sidecar's flags to talk to kvxfer_pair: its KV key, and its lease TTL (a decode
    refuses leases longer than 4 of its own)."""
    return ("--kv-key-file", str(pair_key), "--lease-ttl", str(PAIR_LEASE_TTL))


def failed_load_line(decode: VllmServer, prompt: str | list[int],
                     params: dict[str, Any]) -> str:
    """Send ``params`` to the decode: the load must fail at once (policy "fail") and be
    counted; the decode's log line about it, which names the prefill engine."""
    failed = metric(decode.url, "vllm:kvxfer_num_failed_transfers_total")
    started = time.monotonic()
    reply = httpx.post(f"{decode.url}/v1/completions", timeout=60, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": params})
    assert time.monotonic() - started < 30, "the failed load hung the request"
    assert reply.status_code != 200 or \
        reply.json()["choices"][0]["finish_reason"] != "length", reply.text
    assert metric(decode.url, "vllm:kvxfer_num_failed_transfers_total") == failed + 1
    log = decode.log_path.read_text(errors="replace")
    return next(ln for ln in reversed(log.splitlines()) if params["remote_engine_id"] in ln)


@pytest.mark.parametrize(("model", "fields"), [("kvxfer-tiny", ("model",))])
def test_mismatched_prefill_fails_cleanly(kvxfer_pair: tuple[VllmServer, VllmServer],
                                          log_dir: Path, pair_key: Path, model: str,
                                          fields: tuple[str, ...]) -> None:
    _, decode = kvxfer_pair
    spec = Spec(role="prefill", block_size=128, num_blocks=16,
                extra=("--model", model, "--dtype", "float32", *pair_sidecar(pair_key)))
    sidecar_logs = log_dir / f"sidecar-{model}"
    sidecar_logs.mkdir(exist_ok=True)
    with sidecars(sidecar_logs, [spec]) as (sidecar,):
        answer = sidecar.post("/v1/completions",
                              prefill_body({"prompt": "The capital of France is",
                                            "max_tokens": 1}))
        assert answer.status_code == 200, answer.text
        params = answer.json()["kv_transfer_params"]
        line = failed_load_line(decode, "The capital of France is", params)
        for name in fields:
            assert name in line, f"the decode's error does not name {name!r}: {line}"
        sidecar.wait_for("its lease released and blocks freed",
                         lambda h: h["leases"] == 0 and h["used_blocks"] == 0)
    wait_idle(decode)


def test_a_prefill_of_another_block_size_feeds_the_decode(
        kvxfer_pair: tuple[VllmServer, VllmServer], vllm_python: str, log_dir: Path,
        pair_extra: dict[str, object]) -> None:
    """A vLLM prefill at 64-token blocks, the decode at 128: the decode pairs each of its
    blocks with the two prefill blocks holding its tokens and converts (vLLM's CPU packing
    keeps K transposed per block, so a 128-token block is no two 64-token ones byte for
    byte), token- and log-probability-exact against one instance. The prefill runs eager:
    its block size keys vLLM's compile cache apart, and compiling for it alone took a
    minute or two (test_tp compares an eager instance with compiled ones the same way)."""
    alone_server, decode = kvxfer_pair
    config = kv_transfer_config("kvxfer", pair_extra)
    other = VllmServer("kvxfer-prefill-block64", vllm_python, model_directory(), config, 0,
                       log_dir, block_size=64, args=("--enforce-eager",))
    try:
        other.start()
        with proxy_for(other, decode, log_dir) as proxy:
            for tokens in (200, 700):
                body = {"prompt": prompt_ids(tokens, 3), "max_tokens": 8, "temperature": 0,
                        "logprobs": 1}
                alone = completion(alone_server.url, body)["choices"][0]
                reads = metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count")
                got = completion(proxy, body)["choices"][0]
                assert metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count") == reads + 1
                assert got["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
                worst = max(abs(a - b) for a, b in zip(
                    got["logprobs"]["token_logprobs"], alone["logprobs"]["token_logprobs"],
                    strict=True))
                assert worst <= 1e-4, f"log-probabilities differ by up to {worst}"
        wait_idle(other)  # the decode's "done" ended the lease: the prefill freed its blocks
        wait_idle(decode)
    finally:
        other.stop()


@pytest.mark.parametrize(("packing", "block_size"),
                         [("vllm-cpu-vec", 128), ("token", 128), ("token", 16)])
def test_a_kvxfer_sidecar_prefill_feeds_a_vllm_decode(
        kvxfer_pair: tuple[VllmServer, VllmServer], log_dir: Path, pair_key: Path,
        packing: str, block_size: int) -> None:
    """One protocol across two engines: kvxfer's reference engine (float32) prefills, a
    vLLM decode with KvxferConnector (128-token blocks) reads it, and the answer is
    vLLM's own. With ``--kv-packing vllm-cpu-vec`` and 128-token blocks the sidecar keeps
    its cache as vLLM's CPU backend does and the bytes are copied as they are; with its
    own ``token`` packing the decode converts them (kvxfer.plan.staging), also from the
    sidecar's default 16-token blocks."""
    alone_server, decode = kvxfer_pair
    spec = Spec(role="prefill", block_size=block_size, num_blocks=2048 // block_size,
                extra=("--model", "smollm2-135m-instruct", "--dtype", "float32",
                       "--kv-packing", packing, "--served-model-name", SERVED_NAME,
                       *pair_sidecar(pair_key)))
    body = {"prompt": "Q: What is the capital of France? Answer in a sentence.\nA:",
            "max_tokens": 16, "temperature": 0}
    alone = completion(alone_server.url, body)["choices"][0]["text"]
    sidecar_logs = log_dir / f"sidecar-{packing}-packing-{block_size}"
    sidecar_logs.mkdir(exist_ok=True)
    with sidecars(sidecar_logs, [spec]) as (sidecar,), \
            proxy_for(sidecar, decode, log_dir) as proxy:
        reads = metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count")
        got = completion(proxy, body)["choices"][0]["text"]
        assert metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count") == reads + 1
        assert got == alone  # with the K/V packing wrong it is garbage ("\n\n\n further")
        assert len(got.split()) >= 3, got
        sidecar.wait_for("its lease released and blocks freed",
                         lambda h: h["leases"] == 0 and h["used_blocks"] == 0)
    wait_idle(decode)
