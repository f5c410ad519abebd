"""KvxferConnector's KV key and lease options from ``kv_connector_extra_config`` in real vLLM,
on the shared ``kvxfer_pair`` (which shares a key file and a short lease): it answers as one
instance; the prefill's params
carry a signed ticket and the lease it was given; params changed on the way (another block,
a longer lease) fail the load, so the decode never computes on KV that is not its request's;
and nothing stays held."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from helpers import PAIR_LEASE_TTL as LEASE_TTL
from helpers import completion, metric, wait_idle

from kvxfer.bench.vllm import SERVED_NAME, VllmServer, prefill, prompt_ids
from kvxfer.wire.tickets import TICKET_KEY


def decode_with(decode: VllmServer, prompt: list[int], params: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{decode.url}/v1/completions", timeout=60, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "logprobs": 1, "kv_transfer_params": params})


def test_a_keyed_pair_answers_as_one_instance(
        kvxfer_pair: tuple[VllmServer, VllmServer]) -> None:
    pre, decode = kvxfer_pair
    prompt = prompt_ids(400, 31)
    alone = completion(pre.url, {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                 "logprobs": 1})["choices"][0]
    asked = time.time()
    params = prefill(pre.url, prompt)
    assert TICKET_KEY in params, "a keyed prefill signs its params"
    assert params["lease_expires_at"] <= asked + LEASE_TTL + 5, "lease_ttl is the lease given"
    got = decode_with(decode, prompt, params)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["logprobs"]["tokens"] == alone["logprobs"]["tokens"]


@pytest.mark.parametrize("change", ["another block", "a longer lease"])
def test_params_changed_on_the_way_fail_the_load(
        kvxfer_pair: tuple[VllmServer, VllmServer], change: str) -> None:
    pre, decode = kvxfer_pair
    prompt = prompt_ids(300, 57 + len(change))
    params = prefill(pre.url, prompt)
    if change == "another block":
        params["remote_block_ids"] = [*params["remote_block_ids"][:-1],
                                      params["remote_block_ids"][-1] + 1]
    else:
        params["lease_expires_at"] += 600
    failed = metric(decode.url, "vllm:kvxfer_num_failed_transfers_total")
    got = decode_with(decode, prompt, params)
    assert got.status_code != 200 or got.json()["choices"][0]["finish_reason"] != "length"
    assert metric(decode.url, "vllm:kvxfer_num_failed_transfers_total") == failed + 1


def test_nothing_stays_held(kvxfer_pair: tuple[VllmServer, VllmServer]) -> None:
    for server in kvxfer_pair:
        wait_idle(server, timeout=LEASE_TTL + 30)  # a refused lease ends by its TTL at worst
