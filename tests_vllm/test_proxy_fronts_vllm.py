"""kvxfer-proxy in front of a real vLLM NixlConnector pair: vLLM's own kv_transfer_params
are relayed unchanged, and every answer is the single instance's greedy answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import completion, metric, proxy_for, streamed, streamed_text, wait_idle

from kvxfer.bench.vllm import VllmServer


@pytest.fixture(scope="module")
def proxy(nixl_pair: tuple[VllmServer, VllmServer], log_dir: Path) -> Iterator[str]:
    with proxy_for(*nixl_pair, log_dir) as url:
        yield url


def body_for(chat: bool, case: str) -> tuple[str, dict[str, object]]:
    question = f"({case}) Name three colours of the rainbow and the capital of France."
    if chat:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": question}],
                                        "max_tokens": 24, "temperature": 0}
    return "/v1/completions", {"prompt": f"Question {case}: {question}\nAnswer:",
                               "max_tokens": 24, "temperature": 0}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_proxy_answers_as_one_vllm_instance(nixl_pair: tuple[VllmServer, VllmServer],
                                            proxy: str, chat: bool, stream: bool) -> None:
    prefill, decode = nixl_pair
    path, body = body_for(chat, f"{'chat' if chat else 'text'}-{stream}")
    alone = completion(prefill.url, body, path)["choices"][0]
    expected = alone["message"]["content"] if chat else alone["text"]
    reads = metric(decode.url, "vllm:nixl_xfer_time_seconds_count")
    if stream:
        got = streamed_text(streamed(proxy, body, path), chat)
    else:
        choice = completion(proxy, body, path)["choices"][0]
        got = choice["message"]["content"] if chat else choice["text"]
    assert got == expected
    assert expected.strip(), "the model answered nothing: the comparison proves nothing"
    assert metric(decode.url, "vllm:nixl_xfer_time_seconds_count") == reads + 1, \
        "the decode did not read the prompt's KV from the prefill"


def test_nothing_left_behind(nixl_pair: tuple[VllmServer, VllmServer], proxy: str) -> None:
    completion(proxy, {"prompt": "Counting: one, two,", "max_tokens": 4, "temperature": 0})
    for server in nixl_pair:
        wait_idle(server)
