"""``proxy.fanout``: splitting a several-prompt request, merging answers and streams,
naming the failing prompt, and the two ways of running the pairs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from proxy.contract import drain_request, prefill_request
from proxy.errors import ProxyError, UpstreamRejected, bad_gateway
from proxy.fanout import (
    SSEParser,
    StreamMerger,
    choices_per_prompt,
    for_prompt,
    gather_or_cancel,
    gather_settled,
    merge_answers,
    merged_stream,
    split_prompts,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)


def answer(texts: list[str], prompt_tokens: int, completion_tokens: int) -> bytes:
    return encode({"id": "cmpl-x", "object": "text_completion", "model": "m",
                   "choices": [{"index": j, "text": t, "finish_reason": "length"}
                               for j, t in enumerate(texts)],
                   "usage": {"prompt_tokens": prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens},
                   "kv_transfer_params": None})


# -- splitting ----------------------------------------------------------------------------

@pytest.mark.parametrize(("route", "prompt", "parts"), [
    (COMPLETIONS, ["a", "b"], ["a", "b"]),
    (COMPLETIONS, [[1, 2], [3]], [[1, 2], [3]]),
    (COMPLETIONS, "a", None),
    (COMPLETIONS, [1, 2, 3], None),  # token ids: one prompt
    (COMPLETIONS, ["only"], None),
    (COMPLETIONS, ["a", [1]], None),  # mixed: the sidecar refuses it
    (CHAT, ["a", "b"], None),
])
def test_split_prompts(route: str, prompt: Any, parts: list[Any] | None) -> None:
    body = {"prompt": prompt, "n": 2, "max_tokens": 3}
    got = split_prompts(route, body)
    assert (None if got is None else [b["prompt"] for b in got]) == parts
    if got is not None:
        assert all(b["n"] == 2 and b["max_tokens"] == 3 for b in got)


@pytest.mark.parametrize(("n", "want"), [(3, 3), (None, 1), ("2", 1), (0, 1), (True, 1)])
def test_choices_per_prompt(n: Any, want: int) -> None:
    assert choices_per_prompt({} if n is None else {"n": n}) == want


def test_prefill_takes_one_sample_and_a_drain_one_token() -> None:
    body = {"prompt": "x", "n": 4, "max_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}
    assert prefill_request(body)["n"] == 1
    assert "n" not in prefill_request({"prompt": "x"})
    drain = drain_request(body, {"remote_request_id": "r@1"})
    assert drain == {"prompt": "x", "n": 1, "max_tokens": 1, "stream": False,
                     "kv_transfer_params": {"remote_request_id": "r@1"}}


# -- whole answers ------------------------------------------------------------------------

def test_merged_answer_indexes_choices_by_prompt_and_sums_usage() -> None:
    merged = msgspec.json.decode(merge_answers([
        (answer(["a0", "a1"], 5, 8), "http://d0"), (answer(["b0", "b1"], 7, 8), "http://d1")],
        n=2))
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert merged["usage"] == {"prompt_tokens": 12, "completion_tokens": 16,
                               "total_tokens": 28}
    assert merged["id"] == "cmpl-x" and merged["kv_transfer_params"] is None


def test_an_answer_that_cannot_be_merged_is_a_502_naming_the_decode() -> None:
    with pytest.raises(ProxyError) as caught:
        merge_answers([(answer(["a"], 1, 1), "http://d0"), (b'{"choices": 3}', "http://d1")], 1)
    assert caught.value.status == 502 and "decode instance http://d1" in caught.value.message


# -- streams ------------------------------------------------------------------------------

def chunk(index: int, text: str) -> bytes:
    return b"data: " + encode({"id": "cmpl-x", "object": "text_completion",
                               "choices": [{"index": index, "text": text}]}) + b"\n\n"


def usage_chunk(prompt: int, completion: int) -> bytes:
    return b"data: " + encode({"id": "cmpl-x", "object": "text_completion", "choices": [],
                               "usage": {"prompt_tokens": prompt,
                                         "completion_tokens": completion,
                                         "total_tokens": prompt + completion}}) + b"\n\n"


def test_sse_parser_joins_split_events() -> None:
    parser = SSEParser()
    raw = chunk(0, "a") + b"data: [DONE]\n\n"
    assert parser.feed(raw[:7]) == []
    assert parser.feed(raw[7:]) == [raw[len(b"data: "):raw.index(b"\n\n")], b"[DONE]"]


async def from_bytes(*parts: bytes, pause: float = 0.0) -> AsyncIterator[bytes]:
    for part in parts:
        await asyncio.sleep(pause)
        yield part


def run_merged(sources: list[AsyncIterator[bytes]], n: int, include_usage: bool
               ) -> list[Any]:
    async def collect() -> list[bytes]:
        merger = StreamMerger(n, lambda i: f"http://d{i}")
        return [out async for out in merged_stream(sources, merger, include_usage)]

    out = b"".join(asyncio.run(collect()))
    return [p if p == b"[DONE]" else msgspec.json.decode(p) for p in SSEParser().feed(out)]


def test_merged_stream_reindexes_sums_usage_and_ends_once() -> None:
    events = run_merged([
        from_bytes(chunk(0, "a0"), chunk(1, "a1"), usage_chunk(5, 2), b"data: [DONE]\n\n"),
        from_bytes(chunk(1, "b1"), chunk(0, "b0"), usage_chunk(7, 2), b"data: [DONE]\n\n"),
    ], n=2, include_usage=True)
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {
        "prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16}
    texts = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in events[:-2]}
    assert texts == {0: "a0", 1: "a1", 2: "b0", 3: "b1"}
    without = run_merged([from_bytes(chunk(0, "a"), usage_chunk(1, 1)),
                          from_bytes(chunk(0, "b"), usage_chunk(1, 1))], 1, False)
    assert without[-1] == b"[DONE]" and len(without) == 3, "no usage chunk unless asked for"
    assert all(e["choices"] and "usage" not in e for e in without[:-1])


def test_an_error_event_ends_the_merged_stream() -> None:
    error = b'data: {"error": {"message": "boom", "code": 502}}\n\n'
    events = run_merged([from_bytes(chunk(0, "a"), error),
                         from_bytes(chunk(0, "b"), chunk(0, "c"), pause=0.05)], 1, True)
    assert events[-2] == {"error": {"message": "boom", "code": 502}}
    assert events[-1] == b"[DONE]"
    assert "c" not in [e["choices"][0]["text"] for e in events if isinstance(e, dict)
                       and e.get("choices")]


def test_a_broken_source_raises_naming_its_prompt() -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield chunk(0, "x")
        raise bad_gateway("decode instance http://d1 failed: ReadError")

    with pytest.raises(ProxyError, match=r"^prompt\[1\]: decode instance http://d1 failed"):
        run_merged([from_bytes(chunk(0, "a"), pause=0.05), broken()], 1, False)


# -- errors and running -------------------------------------------------------------------

def rejected(param: str | None) -> UpstreamRejected:
    body = encode({"error": {"message": "the prompt has 3000 tokens", "type": "x",
                             "param": param, "code": 400}})
    return UpstreamRejected(400, body, "application/json", "prefill", "http://p0")


def test_a_prompt_error_names_the_prompt_others_pass_unchanged() -> None:
    named = for_prompt(1, rejected("prompt"))
    assert isinstance(named, UpstreamRejected) and named.status == 400
    assert msgspec.json.decode(named.content)["error"]["message"] == \
        "prompt[1]: the prompt has 3000 tokens"
    other = rejected("model")
    assert for_prompt(1, other) is other
    assert for_prompt(0, bad_gateway("x")).message == "prompt[0]: x"  # type: ignore[union-attr]


def test_gather_settled_lets_every_call_finish() -> None:
    done: list[int] = []

    async def call(i: int) -> int:
        if i == 0:
            raise ValueError("first fails")
        await asyncio.sleep(0.02)
        done.append(i)
        return i

    results = asyncio.run(gather_settled([call(i) for i in range(3)]))
    assert isinstance(results[0], ValueError) and results[1:] == [1, 2] and done == [1, 2]


def test_gather_or_cancel_cancels_the_rest_and_discards_what_came() -> None:
    cancelled: list[int] = []
    discarded: list[int] = []

    async def call(i: int) -> int:
        if i == 1:
            await asyncio.sleep(0.02)
            raise bad_gateway("decode failed")
        if i == 0:
            return 0
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    async def discard(result: int) -> None:
        discarded.append(result)

    with pytest.raises(ProxyError, match=r"^prompt\[1\]: decode failed"):
        asyncio.run(gather_or_cancel([call(i) for i in range(3)], discard))
    assert cancelled == [2] and discarded == [0]
