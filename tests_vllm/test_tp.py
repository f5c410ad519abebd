"""KvxferConnector at different TP on the two sides, in real vLLM: a TP 3 instance (three
worker processes, each registering its one KV head of SmolLM2's three and serving it on
its own side channel) and a TP 1 instance, both ``kv_both``, read from each other through
kvxfer-proxy in both directions and answer as either instance alone (tokens and
log-probabilities), moving every head of every block once, and leak nothing.

SmolLM2-135M has 9 attention and 3 KV heads, so its TP sizes are 1, 3 and 9: TP 2 is
not possible with it. This machine has two cores: the TP 3 instance runs its three
workers on core 0 (in eager mode: three torch.compile runs on one core take longer than
the start-up limit) and the TP 1 instance on core 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import completion, metric, proxy_for, wait_idle

from kvxfer.bench.vllm import (
    VllmServer,
    kv_transfer_config,
    model_directory,
    prompt_ids,
    started,
)

BLOCK_BYTES = 30 * 3 * 128 * 128 * 4  # one block of all 30 layers and 3 KV heads, float32


@pytest.fixture(scope="module")
def tp_pair(vllm_python: str, log_dir: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    """The TP 3 instance (core 0) and the TP 1 instance (core 1)."""
    model, config = model_directory(), kv_transfer_config("kvxfer")
    wide = VllmServer("kvxfer-tp3", vllm_python, model, config, 0, log_dir, tp=3,
                      args=("--enforce-eager",))
    narrow = VllmServer("kvxfer-tp1", vllm_python, model, config, 1, log_dir)
    with started(wide, narrow):
        yield wide, narrow


def worst_gap(got: dict, alone: dict) -> float:
    return max(abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"],
                                          alone["logprobs"]["token_logprobs"], strict=True))


@pytest.mark.parametrize("direction", ["tp3-to-tp1", "tp1-to-tp3"])
def test_a_decode_reads_a_prefill_of_another_tp_and_answers_as_one_instance(
        tp_pair: tuple[VllmServer, VllmServer], log_dir: Path, direction: str) -> None:
    wide, narrow = tp_pair
    pre, decode = (wide, narrow) if direction == "tp3-to-tp1" else (narrow, wide)
    tokens = 300
    body = {"prompt": prompt_ids(tokens, 7 if direction == "tp3-to-tp1" else 11),
            "max_tokens": 6, "temperature": 0, "logprobs": 1}
    # salted: the answers alone leave no prefix-cache hit for the request through the pair
    alone = {server.name: completion(server.url, {**body, "cache_salt": "alone"})["choices"][0]
             for server in tp_pair}
    assert alone[wide.name]["logprobs"]["tokens"] == alone[narrow.name]["logprobs"]["tokens"]
    reads = metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count")
    moved = metric(decode.url, "vllm:kvxfer_bytes_transferred_sum")
    failed = metric(decode.url, "vllm:kvxfer_num_failed_transfers_total")
    with proxy_for(pre, decode, log_dir) as proxy:
        got = completion(proxy, body)["choices"][0]
    for server in tp_pair:
        assert got["logprobs"]["tokens"] == alone[server.name]["logprobs"]["tokens"]
        gap = worst_gap(got, alone[server.name])
        assert gap <= 1e-4, f"log-probabilities differ from {server.name} by up to {gap}"
    assert metric(decode.url, "vllm:kvxfer_num_failed_transfers_total") == failed
    # one READ per decode rank, each of its share of the heads: every byte once in all
    ranks = decode.tp
    assert metric(decode.url, "vllm:kvxfer_xfer_time_seconds_count") == reads + ranks
    assert metric(decode.url, "vllm:kvxfer_bytes_transferred_sum") - moved == \
        math.ceil(tokens / 128) * BLOCK_BYTES
    for server in tp_pair:  # every prefill rank's lease ended, every block freed
        wait_idle(server)
