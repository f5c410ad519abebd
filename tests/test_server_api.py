"""The sidecar's OpenAI-compatible HTTP API against real ``kvxfer serve`` processes.

Bad input answers 400 (OpenAI error body naming the value) and the server keeps
serving; streaming (SSE) matches the whole answer; logprobs, stop strings,
several prompts, /v1/models, /metrics, /health; a client that disconnects
aborts its request; the transfer path works for chat and for streams too. The sidecars
are the run's shared ones (``shared_servers.py``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from shared_servers import PullPair
from sidecars import Sidecar, disaggregated, events, prefill_body

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {"temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def trio(plain: Sidecar, pull_pair: PullPair) -> dict[str, Sidecar]:
    """The shared ``both`` (served also as ``tiny-alias``), prefill and decode (policy
    ``fail``)."""
    return {"both": plain, "prefill": pull_pair.prefill, "decode": pull_pair.decode}


@pytest.fixture(scope="module")
def both(trio: dict[str, Sidecar]) -> Sidecar:
    return trio["both"]


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, f"{response.status_code}: {response.text}"
    return dict(response.json())


# -- bad input ---------------------------------------------------------------------------

BAD_COMPLETIONS: list[tuple[str, Any, str | None, str]] = [
    # (case, body or raw bytes, param, text the message must contain)
    ("malformed json", b'{"prompt": "hi",', None, "not valid JSON"),
    ("empty body", b"", None, "empty"),
    ("not an object", b"[1, 2]", None, "array"),
    ("max_tokens as string", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "str"),
    ("temperature as string", {"prompt": "hi", "temperature": "hot"}, "temperature", "str"),
    ("stream as string", {"prompt": "hi", "stream": "yes"}, "stream", "str"),
    ("prompt as number", {"prompt": 5}, "prompt", "int"),
    ("logprobs as bool", {"prompt": "hi", "logprobs": True}, "logprobs", "bool"),
    ("empty prompt", {"prompt": ""}, "prompt", "empty string"),
    ("empty prompt list", {"prompt": []}, "prompt", "empty list"),
    ("empty token list", {"prompt": [[]]}, "prompt", "prompt[0] is an empty list"),
    ("empty second prompt", {"prompt": ["a", ""]}, "prompt", "prompt[1] is an empty string"),
    ("mixed prompt list", {"prompt": ["a", 1]}, "prompt", "list of token ids"),
    ("token id out of vocab", {"prompt": [1, 2, 999]}, "prompt", "token id 999 at position 2"),
    ("negative token id", {"prompt": [[5, -1]]}, "prompt", "token id -1"),
    ("prompt too long", {"prompt": [65] * 2040, "max_tokens": 16}, "prompt", "2040 tokens"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "got 0"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -3}, "max_tokens", "got -3"),
    ("temperature negative", {"prompt": "hi", "temperature": -0.5}, "temperature", "-0.5"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, "top_p", "got 0"),
    ("top_p above one", {"prompt": "hi", "top_p": 1.5}, "top_p", "1.5"),
    ("n zero", {"prompt": "hi", "n": 0}, "n", "got 0"),
    ("n too many", {"prompt": "hi", "n": 65}, "n", "got 65"),
    ("echo with logprobs", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo",
     "echo or logprobs"),
    ("negative seed", {"prompt": "hi", "seed": -1}, "seed", "got -1"),
    ("empty stop string", {"prompt": "hi", "stop": ["x", ""]}, "stop", "['x', '']"),
    ("logprobs too many", {"prompt": "hi", "logprobs": 21}, "logprobs", "got 21"),
    ("stream_options without stream", {"prompt": "hi", "stream_options": {}}, "stream_options",
     "stream_options"),
    ("kv_transfer_params not an object", {"prompt": "hi", "kv_transfer_params": "x"},
     "kv_transfer_params", "str"),
]

BAD_CHAT: list[tuple[str, Any, str | None, str]] = [
    ("no messages", {"max_tokens": 2}, None, "messages"),
    ("empty messages", {"messages": []}, "messages", "empty list"),
    ("message without role", {"messages": [{"content": "hi"}]}, "messages[0]", "role"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "'image_url'"),
    ("top_logprobs without logprobs", {"messages": MESSAGES, "top_logprobs": 2},
     "top_logprobs", "logprobs"),
    ("max_completion_tokens 0", {"messages": MESSAGES, "max_completion_tokens": 0},
     "max_completion_tokens", "got 0"),
]


def assert_bad_request(response: httpx.Response, param: str | None, text: str,
                       status: int = 400) -> None:
    assert response.status_code == status, f"{response.status_code}: {response.text}"
    error = response.json()["error"]
    assert error["type"] == ("invalid_request_error" if status == 400 else error["type"])
    assert error["code"] == status
    assert error["param"] == param, error
    assert text in error["message"], error["message"]


def post_raw(sidecar: Sidecar, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return sidecar.client.post(f"{sidecar.url}{path}", content=body,
                                   headers={"content-type": "application/json"})
    return sidecar.post(path, body)


@pytest.mark.parametrize(("case", "body", "param", "text"), BAD_COMPLETIONS,
                         ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_is_400_and_the_server_keeps_serving(
        both: Sidecar, case: str, body: Any, param: str | None, text: str) -> None:
    assert_bad_request(post_raw(both, COMPLETIONS, body), param, text)
    ok(both.post(COMPLETIONS, {"prompt": "still here", "max_tokens": 1}))


@pytest.mark.parametrize(("case", "body", "param", "text"), BAD_CHAT,
                         ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_is_400_and_the_server_keeps_serving(
        both: Sidecar, case: str, body: Any, param: str | None, text: str) -> None:
    assert_bad_request(post_raw(both, CHAT, body), param, text)
    ok(both.post(CHAT, {"messages": MESSAGES, "max_tokens": 1}))


@pytest.mark.parametrize("extreme", [{"temperature": 1e-38}, {"top_p": 1e-46},
                                     {"temperature": 1e-300, "top_p": 5e-324}])
def test_extreme_sampling_values_answer_and_keep_the_engine_loop(
        both: Sidecar, extreme: dict[str, float]) -> None:
    """Regression: one such request stopped the engine loop (every later request 503)."""
    body = {"prompt": "hi", "max_tokens": 2, **extreme}
    greedy = ok(both.post(COMPLETIONS, {**body, "temperature": 0, "top_p": 1.0}))
    assert ok(both.post(COMPLETIONS, body))["choices"][0]["text"] == \
        greedy["choices"][0]["text"]
    assert both.client.get(f"{both.url}/health").status_code == 200


def test_unknown_model_route_and_method_are_openai_errors(both: Sidecar) -> None:
    response = both.post(COMPLETIONS, {"prompt": "hi", "model": "gpt-9"})
    assert_bad_request(response, "model", "'gpt-9'", status=404)
    assert response.json()["error"]["type"] == "not_found_error"
    response = both.post("/v1/embeddings", {"input": "hi"})
    assert_bad_request(response, None, "/v1/embeddings", status=404)
    response = both.get(COMPLETIONS)
    assert_bad_request(response, None, "GET /v1/completions", status=405)


def decode_params(prompt_len: int, **over: Any) -> dict[str, Any]:
    blocks = -(-prompt_len // 16)
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "prefill-x", "remote_host": "127.0.0.1", "remote_port": 5555,
            "remote_block_ids": list(range(blocks)), "remote_request_id": "r",
            "remote_num_tokens": prompt_len, "tp_size": 1, "lease_expires_at": 0.0, **over}


BAD_DECODE: list[tuple[str, dict[str, Any], str]] = [
    ("missing engine id", {"remote_engine_id": None}, "remote_engine_id"),
    ("port as string", {"remote_port": "x"}, "remote_port must be int, got 'x'"),
    ("port out of range", {"remote_port": 70000}, "70000"),
    ("block ids not ints", {"remote_block_ids": [0.5]}, "remote_block_ids"),
    ("token count differs", {"remote_num_tokens": 10}, "remote_num_tokens is 10"),
    ("token count missing", {"remote_num_tokens": None}, "remote_num_tokens must be an integer"),
    ("too few blocks", {"remote_block_ids": []}, "has 0 ids"),
    ("block id of 2**63", {"remote_block_ids": [2**63]}, "outside [0, 2**63)"),
    ("block id of 2**64", {"remote_block_ids": [2**64 + 5]}, "outside [0, 2**63)"),
    ("negative block id", {"remote_block_ids": [-1]}, "outside [0, 2**63)"),
    ("repeated block id", {"remote_block_ids": [3, 3]}, "repeats a block id"),
    ("flag not a bool", {"do_remote_prefill": "yes"}, "'yes'"),
]


@pytest.mark.parametrize(("case", "over", "text"), BAD_DECODE, ids=[c[0] for c in BAD_DECODE])
def test_bad_transfer_params_on_decode_are_400_before_allocating(
        trio: dict[str, Sidecar], case: str, over: dict[str, Any], text: str) -> None:
    decode = trio["decode"]
    params = {k: v for k, v in decode_params(9, **over).items() if v is not None}
    response = decode.post(COMPLETIONS, {"prompt": "12345678", "max_tokens": 2,
                                         "kv_transfer_params": params})
    assert_bad_request(response, "kv_transfer_params", text)
    assert decode.health()["used_blocks"] == 0
    ok(decode.post(COMPLETIONS, {"prompt": "plain request", "max_tokens": 1}))


def test_transfer_paths_take_one_prompt_and_prefill_does_not_stream(
        trio: dict[str, Sidecar]) -> None:
    response = trio["decode"].post(COMPLETIONS, {"prompt": ["a", "b"],
                                                 "kv_transfer_params": decode_params(2)})
    assert_bad_request(response, "prompt", "exactly one prompt, got 2")
    prefill = trio["prefill"]
    body = prefill_body({"prompt": "hi"})
    response = prefill.post(COMPLETIONS, {**body, "stream": True})
    assert_bad_request(response, "stream", "cannot be streamed")
    response = prefill.post(COMPLETIONS, {**body, "prompt": ["a", "b"]})
    assert_bad_request(response, "prompt", "exactly one prompt, got 2")
    response = prefill.post(COMPLETIONS, {**body, "n": 2})
    assert_bad_request(response, "n", "n must be 1, got 2")
    assert prefill.health()["used_blocks"] == 0


# -- answers ------------------------------------------------------------------------------

def test_completion_answer_shape_usage_and_request_id(both: Sidecar) -> None:
    response = both.post(COMPLETIONS, {"prompt": "The answer", **GREEDY},
                         headers={"x-request-id": "my-id-1"})
    answer = ok(response)
    assert response.headers["x-request-id"] == "my-id-1"
    assert answer["id"] == "cmpl-my-id-1" and answer["object"] == "text_completion"
    assert answer["model"] == "kvxfer-tiny" and answer["kv_transfer_params"] is None
    choice = answer["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    # default max_tokens 16; byte tokenizer: BOS + 10 bytes
    assert answer["usage"] == {"prompt_tokens": 11, "completion_tokens": 16,
                               "total_tokens": 27}


@pytest.mark.parametrize("prompts", [["first prompt", "second", "third"],
                                     [[256, 104, 105], [256, 33]]], ids=["texts", "token ids"])
def test_several_prompts_answer_one_choice_each(both: Sidecar, prompts: list[Any]) -> None:
    answer = ok(both.post(COMPLETIONS, {"prompt": prompts, "max_tokens": 5, **GREEDY}))
    assert [c["index"] for c in answer["choices"]] == list(range(len(prompts)))
    for prompt, choice in zip(prompts, answer["choices"], strict=True):
        alone = ok(both.post(COMPLETIONS, {"prompt": prompt, "max_tokens": 5, **GREEDY}))
        assert choice["text"] == alone["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 5 * len(prompts)


def test_sampling_with_a_seed_repeats(both: Sidecar) -> None:
    body = {"prompt": "Once upon", "max_tokens": 12, "seed": 7, "ignore_eos": True}
    first, second = (ok(both.post(COMPLETIONS, body)) for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    greedy = ok(both.post(COMPLETIONS, {**body, "temperature": 0}))
    assert greedy["choices"][0]["text"] != first["choices"][0]["text"], \
        "temperature should default to 1.0, not greedy"


def test_completion_logprobs(both: Sidecar) -> None:
    answer = ok(both.post(COMPLETIONS, {"prompt": "Logprobs", "max_tokens": 6, "logprobs": 3,
                                        **GREEDY}))
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                 logprobs["top_logprobs"], strict=True):
        assert 3 <= len(top) <= 4 and top[token] == value
        assert value == max(top.values()), "greedy picks the most likely token"


def test_chat_answer_and_logprobs(both: Sidecar) -> None:
    answer = ok(both.post(CHAT, {"messages": MESSAGES, "max_tokens": 4, "logprobs": True,
                                 "top_logprobs": 2, **GREEDY}))
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] == item["logprob"]
    # the built-in template: "<|role|>\ncontent\n" per message, then "<|assistant|>\n"
    rendered = "<|system|>\nBe brief.\n<|user|>\nHello!\n<|assistant|>\n"
    assert answer["usage"]["prompt_tokens"] == 1 + len(rendered.encode())
    same = ok(both.post(COMPLETIONS, {"prompt": rendered, "max_tokens": 4, **GREEDY}))
    assert choice["message"]["content"] == same["choices"][0]["text"]


def stop_candidate(text: str) -> str:
    """An ASCII letter or digit in ``text`` after its first character."""
    found = next((ch for ch in text[1:] if ch.isascii() and ch.isalnum()), None)
    assert found is not None, f"no ASCII letter in {text!r} to stop at"
    return found


def test_stop_strings_whole_and_streamed(both: Sidecar) -> None:
    body = {"prompt": "Stop here", "max_tokens": 40, **GREEDY}
    full = ok(both.post(COMPLETIONS, body))["choices"][0]["text"]
    stop = stop_candidate(full)
    cut = full[:full.index(stop)]
    choice = ok(both.post(COMPLETIONS, {**body, "stop": stop}))["choices"][0]
    assert choice["text"] == cut and choice["finish_reason"] == "stop"
    chunks = events(both.post(COMPLETIONS, {**body, "stop": [stop, "never"], "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == cut
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_streamed_completion_matches_the_whole_answer(both: Sidecar) -> None:
    body = {"prompt": "Streaming", "max_tokens": 10, "logprobs": 1, **GREEDY}
    whole = ok(both.post(COMPLETIONS, body))
    chunks = events(both.post(COMPLETIONS, {**body, "stream": True,
                                            "stream_options": {"include_usage": True}}))
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    parts = chunks[:-2]
    assert all(c["object"] == "text_completion" and c["id"] == parts[0]["id"] for c in parts)
    assert "".join(c["choices"][0]["text"] for c in parts) == whole["choices"][0]["text"]
    tokens = [t for c in parts for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    offsets = [o for c in parts for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]
    assert [c["choices"][0]["finish_reason"] for c in parts][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in parts[:-1])


def test_streamed_chat_matches_the_whole_answer(both: Sidecar) -> None:
    body = {"messages": MESSAGES, "max_tokens": 6, **GREEDY}
    whole = ok(both.post(CHAT, body))
    chunks = events(both.post(CHAT, {**body, "stream": True}))
    assert chunks[-1] == "[DONE]"
    parts = chunks[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in parts)
    assert parts[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in parts)
    assert text == whole["choices"][0]["message"]["content"]
    assert parts[-1]["choices"][0]["finish_reason"] == "length"


def test_several_prompts_stream_with_their_indexes(both: Sidecar) -> None:
    body = {"prompt": ["one", "two"], "max_tokens": 3, **GREEDY}
    whole = ok(both.post(COMPLETIONS, body))
    chunks = events(both.post(COMPLETIONS, {**body, "stream": True}))[:-1]
    for index in (0, 1):
        text = "".join(c["choices"][0]["text"] for c in chunks
                       if c["choices"][0]["index"] == index)
        assert text == whole["choices"][index]["text"]


def test_models_and_served_model_aliases(both: Sidecar) -> None:
    models = ok(both.get("/v1/models"))
    assert [m["id"] for m in models["data"]] == ["kvxfer-tiny", "tiny-alias"]
    assert all(m["object"] == "model" and m["max_model_len"] == 2048 for m in models["data"])
    answer = ok(both.post(COMPLETIONS, {"prompt": "hi", "model": "tiny-alias", "max_tokens": 1}))
    assert answer["model"] == "tiny-alias"


def test_health_reports_role_engine_and_blocks(trio: dict[str, Sidecar]) -> None:
    for role, sidecar in trio.items():
        health = sidecar.health()
        assert health["status"] == "ok" and health["role"] == role
        assert health["pid"] == sidecar.pid
        assert health["engine_id"].startswith(f"{role}-")
        assert health["num_blocks"] == 256 and health["layout"] == "LBHNC"
        assert (health["side_channel_port"] is not None) == (role in ("prefill", "both"))


def test_metrics_count_requests_tokens_and_blocks(both: Sidecar) -> None:
    before = both.metrics()
    ok(both.post(COMPLETIONS, {"prompt": "count me", "max_tokens": 3, **GREEDY}))
    both.post(COMPLETIONS, {"prompt": ""})
    response = both.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    wait_idle(both)
    after = both.metrics()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("kvxfer_http_requests_total", route=COMPLETIONS, status="200") == 1
    assert grew("kvxfer_http_requests_total", route=COMPLETIONS, status="400") == 1
    assert grew("kvxfer_prompt_tokens_total") == 9
    assert grew("kvxfer_generation_tokens_total") == 3
    assert after[("kvxfer_kv_blocks_free", ())] == 256
    assert ("kvxfer_kv_transfer_bytes_total", ()) in after


# -- disconnects --------------------------------------------------------------------------

def wait_idle(sidecar: Sidecar) -> None:
    sidecar.wait_for("no request in flight and every block free",
                     lambda h: h["requests_in_flight"] == 0 and h["used_blocks"] == 0)


def test_client_disconnect_aborts_a_whole_request(both: Sidecar) -> None:
    wait_idle(both)
    before = both.metric("kvxfer_generation_tokens_total")
    with httpx.Client(timeout=0.5, trust_env=False) as client, \
            pytest.raises(httpx.TimeoutException):
        client.post(f"{both.url}{COMPLETIONS}",
                    json={"prompt": "long", "max_tokens": 2000, **GREEDY})
    wait_idle(both)
    generated = both.metric("kvxfer_generation_tokens_total") - before
    assert generated < 2000, "the abandoned request ran to completion"


def test_client_disconnect_aborts_a_stream(both: Sidecar) -> None:
    wait_idle(both)
    before = both.metric("kvxfer_generation_tokens_total")
    body = {"prompt": "long stream", "max_tokens": 2000, "stream": True, **GREEDY}
    with httpx.Client(timeout=30, trust_env=False) as client, \
            client.stream("POST", f"{both.url}{COMPLETIONS}", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_idle(both)
    generated = both.metric("kvxfer_generation_tokens_total") - before
    assert generated < 2000, "the abandoned stream ran to completion"


# -- the transfer path for chat and streams -----------------------------------------------

def test_disaggregated_chat_and_stream_match_single_instance(trio: dict[str, Sidecar]) -> None:
    both, prefill, decode = trio["both"], trio["prefill"], trio["decode"]
    reads = decode.metric("kvxfer_kv_transfers_total", outcome="ok")
    body = {"messages": MESSAGES, "max_completion_tokens": 6, "logprobs": True, **GREEDY}
    want = ok(both.post(CHAT, body))["choices"][0]
    first, second = disaggregated(prefill, decode, CHAT, body, request_id="chat-1")
    lease_id = first.json()["kv_transfer_params"]["remote_request_id"]
    assert "chat-1" not in lease_id and len(lease_id) >= 22, "a random, unguessable lease id"
    got = ok(second)["choices"][0]
    assert got["message"] == want["message"]
    for a, b in zip(got["logprobs"]["content"], want["logprobs"]["content"], strict=True):
        assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) < 1e-4

    stream_body = {"prompt": "Stream me over", "max_tokens": 7, **GREEDY}
    want_text = ok(both.post(COMPLETIONS, stream_body))["choices"][0]["text"]
    first = prefill.post(COMPLETIONS, prefill_body(stream_body))
    params = ok(first)["kv_transfer_params"]
    chunks = events(decode.post(COMPLETIONS, {**stream_body, "stream": True,
                                              "kv_transfer_params": params}))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == want_text
    assert decode.metric("kvxfer_kv_transfers_total", outcome="ok") == reads + 2


def test_prefill_serves_plain_requests_without_leasing(trio: dict[str, Sidecar]) -> None:
    prefill = trio["prefill"]
    answer = ok(prefill.post(COMPLETIONS, {"prompt": "plain", "max_tokens": 2}))
    assert answer["kv_transfer_params"] is None
    wait_idle(prefill)
    assert prefill.health()["leases"] == 0
