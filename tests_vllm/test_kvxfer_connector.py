"""KvxferConnector in real vLLM: a prefill and a decode with it, through kvxfer-proxy,
answer as one vLLM instance (tokens and log-probabilities), read only what the decode's
prefix cache lacks, leak nothing, and refuse a lease read twice (the request failing or,
with ``kv_load_failure_policy`` "recompute", recomputed)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import (
    cache_mappings,
    completion,
    metric,
    proxy_for,
    streamed,
    streamed_text,
    wait_idle,
)

from kvxfer.bench.vllm import (
    SERVED_NAME,
    VllmServer,
    kv_transfer_config,
    model_directory,
    prefill,
    prompt_ids,
)

BLOCK_BYTES = 30 * 3 * 128 * 128 * 4  # one block of all 30 layers, float32


@pytest.fixture(scope="module")
def proxy(kvxfer_pair: tuple[VllmServer, VllmServer], log_dir: Path) -> Iterator[str]:
    with proxy_for(*kvxfer_pair, log_dir) as url:
        yield url


@pytest.mark.parametrize("tokens", [100, 500, 1500])
def test_prompts_match_one_instance(kvxfer_pair: tuple[VllmServer, VllmServer], proxy: str,
                                    tokens: int) -> None:
    pre, decode = kvxfer_pair
    body = {"prompt": prompt_ids(tokens, tokens), "max_tokens": 8, "temperature": 0,
            "logprobs": 1}
    alone = completion(pre.url, body)["choices"][0]
    reads = metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count")
    moved = metric(decode.url, "vllm:kvxfer_bytes_transferred_sum")
    got = completion(proxy, body)["choices"][0]
    assert got["text"] == alone["text"]
    assert got["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
    worst = max(abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"],
                                           alone["logprobs"]["token_logprobs"], strict=True))
    assert worst <= 1e-4, f"log-probabilities differ by up to {worst}"
    assert metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count") == reads + 1
    assert metric(decode.url, "vllm:kvxfer_bytes_transferred_sum") - moved == \
        math.ceil(tokens / 128) * BLOCK_BYTES


def test_the_decode_copies_out_of_the_prefill_cache_mapped(
        kvxfer_pair: tuple[VllmServer, VllmServer], proxy: str) -> None:
    """vLLM allocated each instance's cache inside KvxferConnector's allocation context, in
    shared memory: the decode maps the prefill's and copies a request out of it, one copy
    (a NIXL READ of vLLM's cache would take a descriptor per layer)."""
    pre, decode = kvxfer_pair
    descriptors = metric(decode.url, "vllm:kvxfer_num_descriptors_sum")
    reads = metric(decode.url, "vllm:kvxfer_num_descriptors_count")
    completion(proxy, {"prompt": prompt_ids(100, 31), "max_tokens": 2, "temperature": 0})
    assert metric(decode.url, "vllm:kvxfer_num_descriptors_count") == reads + 1
    assert metric(decode.url, "vllm:kvxfer_num_descriptors_sum") == descriptors + 1
    assert "rw-s" in cache_mappings(pre)  # its own cache, allocated shared
    assert "rw-s" in cache_mappings(decode)  # so is the decode's
    assert "r--s" in cache_mappings(decode)  # and the prefill's is mapped here


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_streams_through_the_proxy(kvxfer_pair: tuple[VllmServer, VllmServer], proxy: str,
                                   chat: bool) -> None:
    pre, _ = kvxfer_pair
    question = f"({chat}) What is the capital of France? Say it in a sentence."
    path, body = (("/v1/chat/completions",
                   {"messages": [{"role": "user", "content": question}]}) if chat
                  else ("/v1/completions", {"prompt": f"Q: {question}\nA: The capital"}))
    body.update(max_tokens=16, temperature=0)
    alone = completion(pre.url, body, path)["choices"][0]
    expected = alone["message"]["content"] if chat else alone["text"]
    assert streamed_text(streamed(proxy, body, path), chat) == expected
    assert expected.strip()


def test_a_lease_is_read_once(kvxfer_pair: tuple[VllmServer, VllmServer]) -> None:
    pre, decode = kvxfer_pair
    prompt = prompt_ids(300, 7)
    params = prefill(pre.url, prompt)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": params}
    first = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)
    assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] == "length"
    failed = metric(decode.url, "vllm:kvxfer_num_failed_transfers_total")
    replay = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)
    # vLLM's kv_load_failure_policy "fail": the replayed request ends in an error
    assert replay.status_code != 200 or replay.json()["choices"][0]["finish_reason"] != "length"
    assert metric(decode.url, "vllm:kvxfer_num_failed_transfers_total") == failed + 1


def assert_same_answer(got: dict, alone: dict) -> None:
    assert got["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
    worst = max(abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"],
                                           alone["logprobs"]["token_logprobs"], strict=True))
    assert worst <= 1e-4, f"log-probabilities differ by up to {worst}"


def test_a_decode_prefix_hit_reads_only_the_blocks_past_it(
        kvxfer_pair: tuple[VllmServer, VllmServer], proxy: str) -> None:
    """The decode computed the first 600 tokens of a 700-token prompt before (4 whole
    blocks of 128 in its prefix cache): the load reads the prefill's 2 blocks past them,
    and the answer is one instance's."""
    pre, decode = kvxfer_pair
    prompt = prompt_ids(700, 4242)
    completion(decode.url, {"prompt": prompt[:600], "max_tokens": 1})
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    alone = completion(pre.url, body)["choices"][0]
    reads = metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count")
    moved = metric(decode.url, "vllm:kvxfer_bytes_transferred_sum")
    assert_same_answer(completion(proxy, body)["choices"][0], alone)
    assert metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count") == reads + 1
    assert metric(decode.url, "vllm:kvxfer_bytes_transferred_sum") - moved == 2 * BLOCK_BYTES


def test_a_failed_load_is_recomputed_under_that_policy(
        kvxfer_pair: tuple[VllmServer, VllmServer], vllm_python: str, log_dir: Path,
        pair_extra: dict[str, object]) -> None:
    """A decode with ``kv_load_failure_policy`` "recompute" given a lease another decode
    already read: its claim is refused, the load fails, and vLLM computes the prompt
    itself; the answer is one instance's, and the prefill keeps nothing. The new decode runs
    eager (compiled, the test took a minute): what it computes itself is checked against a
    compiled instance, as test_tp checks an eager one."""
    pre, first_decode = kvxfer_pair
    prompt = prompt_ids(300, 77)
    params = prefill(pre.url, prompt)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    taken = completion(first_decode.url, {**body, "kv_transfer_params": params})
    alone = completion(pre.url, body)["choices"][0]
    assert_same_answer(taken["choices"][0], alone)
    config = kv_transfer_config("kvxfer", pair_extra, policy="recompute")
    decode = VllmServer("kvxfer-decode-recompute", vllm_python, model_directory(), config, 0,
                        log_dir, args=("--enforce-eager",))
    try:
        decode.start()
        failed = metric(decode.url, "vllm:kvxfer_num_failed_transfers_total")
        got = completion(decode.url, {**body, "kv_transfer_params": params})["choices"][0]
        assert got["finish_reason"] == "length"
        assert_same_answer(got, alone)
        assert metric(decode.url, "vllm:kvxfer_num_failed_transfers_total") == failed + 1
        wait_idle(decode)
    finally:
        decode.stop()
    wait_idle(pre)


def test_nothing_left_behind(kvxfer_pair: tuple[VllmServer, VllmServer], proxy: str) -> None:
    completion(proxy, {"prompt": "Counting: one, two,", "max_tokens": 4, "temperature": 0})
    for server in kvxfer_pair:
        wait_idle(server)
