"""The prefill's first token: handed to the decode in ``kv_transfer_params.first_token``,
answered by the decode at once and continued from, and a one-token request answered by
the prefill alone. Real sidecars and the real proxy (the run's shared ones,
``shared_servers.py``, and a prefill of this module's own for the tests that freeze it);
every answer is checked against a single instance (``both``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from shared_servers import PullPair
from sidecars import ProxyProcess, Sidecar, SidecarGroup, Spec, prefill_body, streamed

from kvxfer.engine.sampler import SamplingParams, sample, skip_draw, top_p_filter
from kvxfer.wire.params import RemoteParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MODEL = "kvxfer-tiny"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "ignore_eos": True}
SEEDED: dict[str, Any] = {"model": MODEL, "temperature": 1.0, "seed": 11, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "What colour is the sky?"}]


@dataclass(frozen=True)
class Fleet:
    both: Sidecar
    prefill: Sidecar
    decode: Sidecar
    proxy: ProxyProcess
    frozen: Sidecar  # a prefill of this module's own: the tests that freeze one use it


@pytest.fixture(scope="module")
def fleet(plain: Sidecar, pull_pair: PullPair, proxied: ProxyProcess,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with SidecarGroup(tmp_path_factory.mktemp("first-token")) as group:
        yield Fleet(plain, pull_pair.prefill, pull_pair.decode, proxied,
                    group.start_one(Spec("prefill")))


def idle(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0
                and health["requests_in_flight"] == 0)


@pytest.fixture(autouse=True)
def ends_idle(fleet: Fleet) -> Iterator[None]:
    yield
    for sidecar in (fleet.both, fleet.prefill, fleet.decode, fleet.frozen):
        sidecar.wait_for("idle: no request, lease or used block", idle, timeout=20)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return dict(response.json())


def answer_of(body: dict[str, Any]) -> Any:
    """What a client compares: each choice's text, tokens' logprobs and finish, and usage."""
    choices = []
    for choice in body["choices"]:
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        choices.append((choice["index"], text, choice.get("logprobs"), choice["finish_reason"]))
    return choices, body["usage"]


def transfers(fleet: Fleet) -> float:
    return fleet.decode.metric("kvxfer_kv_transfers_total", outcome="ok")


def decode_calls(fleet: Fleet) -> float:
    return sum(fleet.decode.metric("kvxfer_http_requests_total", route=route, status="200")
               for route in (COMPLETIONS, CHAT))


# -- the sampler's stream ------------------------------------------------------------------

@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.05])
def test_skipping_a_draw_leaves_the_generator_where_the_draw_would(top_p: float) -> None:
    """A decode continues a seeded request's random stream past the prefill's draw without
    its logits: only valid while a draw's use of the generator does not depend on the
    probabilities (this fails if a torch release changes that)."""
    vocab = 1000
    params = SamplingParams(temperature=0.8, top_p=top_p, seed=3)
    for trial in range(5):
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(trial)) * 4
        drawn, skipped = (torch.Generator().manual_seed(3) for _ in range(2))
        sample(logits, params, drawn)
        skip_draw(skipped, vocab)
        assert torch.equal(drawn.get_state(), skipped.get_state())
    assert top_p_filter(torch.ones(4) / 4, 1.0).sum() == pytest.approx(1.0)


def test_first_token_params_are_checked() -> None:
    base = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 5,
            "remote_block_ids": [1], "remote_request_id": "r", "tp_size": 1}
    first = RemoteParams.parse({**base, "first_token": {"id": 3, "logprob": -0.5,
                                                        "top": [[3, -0.5], [4, -1]]}})
    assert first.first_token is not None and first.first_token.top == ((3, -0.5), (4, -1.0))
    assert RemoteParams.parse(base).first_token is None
    for bad in ({"id": -1, "logprob": 0}, {"id": 1, "logprob": 0.5}, {"id": 1},
                {"id": 1, "logprob": -1, "extra": 1}, {"id": 1, "logprob": -1, "top": [[1]]},
                {"id": 1, "logprob": -1, "top": [[1, -1]] * 21}, "token"):
        with pytest.raises(ValueError, match=r"^kv_transfer_params\.first_token must be"):
            RemoteParams.parse({**base, "first_token": bad})


# -- answers -------------------------------------------------------------------------------

CASES = {
    "greedy": (COMPLETIONS, {"prompt": "The first token", "max_tokens": 8, **GREEDY}),
    "seeded": (COMPLETIONS, {"prompt": "Sample from a seed", "max_tokens": 10, **SEEDED}),
    "top-p": (COMPLETIONS, {"prompt": "Nucleus", "max_tokens": 8, **SEEDED, "top_p": 0.8}),
    "logprobs": (COMPLETIONS, {"prompt": "Log them", "max_tokens": 5, "logprobs": 3,
                               **SEEDED}),
    "chat": (CHAT, {"messages": MESSAGES, "max_tokens": 6, "logprobs": True,
                    "top_logprobs": 2, **SEEDED}),
    "echo": (COMPLETIONS, {"prompt": "Echo me", "max_tokens": 4, "echo": True, **GREEDY}),
    "n=2": (COMPLETIONS, {"prompt": "Two choices", "max_tokens": 5, "n": 2, **SEEDED}),
}


@pytest.mark.parametrize("case", CASES)
def test_answers_through_the_proxy_are_one_instance_s(fleet: Fleet, case: str) -> None:
    route, body = CASES[case]
    want = ok(fleet.both.post(route, body))
    assert answer_of(ok(fleet.proxy.post(route, body))) == answer_of(want)
    stream = fleet.proxy.post(route, {**body, "stream": True})
    one = fleet.both.post(route, {**body, "stream": True})
    assert streamed(stream) == streamed(one)


def test_the_decode_continues_from_the_token_it_is_given(fleet: Fleet) -> None:
    """The decode does not sample the first token again: given another one in the params,
    it answers that token and continues from it, as one instance continues that prompt."""
    body = {"prompt": [100, 101, 102, 103, 104], "max_tokens": 6, "logprobs": 0, **GREEDY}
    params = ok(fleet.prefill.post(COMPLETIONS, prefill_body(body)))["kv_transfer_params"]
    sampled = params["first_token"]["id"]
    other = (sampled + 1) % 256
    params["first_token"] = {"id": other, "logprob": -1.5, "top": []}
    before = transfers(fleet)
    got = ok(fleet.decode.post(COMPLETIONS, {**body, "kv_transfer_params": params}))
    assert transfers(fleet) == before + 1, "the prompt's KV was not read"
    rest = ok(fleet.both.post(COMPLETIONS, {**body, "prompt": body["prompt"] + [other],
                                            "max_tokens": 5}))
    logprobs = got["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] == -1.5
    assert logprobs["tokens"][1:] == rest["choices"][0]["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        rest["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)


def frozen_prefill_stream(fleet: Fleet, body: dict[str, Any], frozen_s: float
                          ) -> tuple[float, str]:
    """Prefill ``body`` on the module's own prefill, freeze it (SIGSTOP), stream the
    decode's answer and thaw the prefill ``frozen_s`` after the first token arrived:
    (seconds to the first token, the whole stream)."""
    params = ok(fleet.frozen.post(COMPLETIONS, prefill_body(body)))["kv_transfer_params"]
    decode_body = {**body, "stream": True, "kv_transfer_params": params}
    os.kill(fleet.frozen.pid, signal.SIGSTOP)
    try:
        with httpx.Client(timeout=30, trust_env=False) as client, \
                client.stream("POST", f"{fleet.decode.url}{COMPLETIONS}",
                              json=decode_body) as response:
            start = time.monotonic()
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            waited = time.monotonic() - start
            time.sleep(frozen_s)
            os.kill(fleet.frozen.pid, signal.SIGCONT)
            return waited, "\n".join([first, *lines])
    finally:
        os.kill(fleet.frozen.pid, signal.SIGCONT)


# a byte of the tiny model's vocabulary may be half a character: logprobs make every
# token a chunk of its own
FROZEN = {"prompt": "Frozen after the prefill", "max_tokens": 6, "logprobs": 0, **GREEDY}


def test_the_first_token_streams_before_any_kv_is_read(fleet: Fleet) -> None:
    """With the prefill frozen after it answered, the decode can neither claim nor read the
    lease, yet the client has its first token at once; thawed (before the decode's claim
    times out), the rest follows and the whole stream is one instance's."""
    want = streamed(fleet.both.post(COMPLETIONS, {**FROZEN, "stream": True}))
    waited, text = frozen_prefill_stream(fleet, FROZEN, 0.3)
    assert waited < 0.7, f"the first token waited {waited:.2f} s for a frozen prefill"
    assert streamed(httpx.Response(200, text=text)) == want


def test_a_claim_given_up_on_is_released(fleet: Fleet) -> None:
    """Frozen longer than the decode waits for its claim: the client has its first token,
    then a clear error (policy fail), and the lease the prefill grants on waking, to a
    decode that gave up, ends within seconds instead of at its TTL (120 s)."""
    waited, text = frozen_prefill_stream(fleet, FROZEN, 2.0)
    assert waited < 1.0
    assert '"kv_transfer_error"' in text and "did not answer this decode's claim" in text, text
    fleet.frozen.wait_for("the lease released", idle, timeout=10)


def test_a_stop_on_the_first_token_reads_nothing(fleet: Fleet) -> None:
    full = ok(fleet.both.post(COMPLETIONS, {"prompt": "Stop at once", "max_tokens": 4,
                                            **GREEDY}))["choices"][0]["text"]
    stop = next(ch for ch in full if ch != "\ufffd" and ch.isprintable())
    body = {"prompt": "Stop at once", "max_tokens": 4, "stop": [stop], **GREEDY}
    want = ok(fleet.both.post(COMPLETIONS, body))
    assert want["choices"][0]["finish_reason"] == "stop"
    reads = transfers(fleet)
    answered = fleet.prefill.metric("kvxfer_kv_leases_released_total", reason="answered")
    assert answer_of(ok(fleet.proxy.post(COMPLETIONS, body))) == answer_of(want)
    fleet.prefill.wait_for("the lease released", idle, timeout=10)
    assert transfers(fleet) == reads, "a KV read for an answer that was complete"
    assert fleet.prefill.metric("kvxfer_kv_leases_released_total",
                                reason="answered") == answered + 1


@pytest.mark.parametrize("stream", [False, True])
def test_one_token_is_the_prefill_s_alone(fleet: Fleet, stream: bool) -> None:
    body = {"prompt": "Just one", "max_tokens": 1, "logprobs": 2, **SEEDED, "stream": stream}
    calls, leases = decode_calls(fleet), fleet.prefill.metric("kvxfer_kv_leases_released_total",
                                                              reason="answered")
    got, want = fleet.proxy.post(COMPLETIONS, body), fleet.both.post(COMPLETIONS, body)
    if stream:
        assert streamed(got) == streamed(want)
    else:
        assert answer_of(ok(got)) == answer_of(ok(want))
    assert decode_calls(fleet) == calls, "a decode call for a one-token answer"
    assert fleet.prefill.metric("kvxfer_kv_leases_released_total",
                                reason="answered") == leases, "a lease was made"


@pytest.mark.parametrize("first_token, says", [
    ({"id": 10**6, "logprob": -1.0, "top": []}, "not all in this model's vocabulary"),
    ({"id": 5, "logprob": -1.0, "top": [[5, -1.0]]}, "has 1 top log-probabilities but the "
                                                      "request asks for 0"),
])
def test_a_bad_first_token_is_a_400_that_frees_the_lease(fleet: Fleet, first_token: Any,
                                                         says: str) -> None:
    body = {"prompt": "Bad first token", "max_tokens": 4, **GREEDY}
    params = ok(fleet.prefill.post(COMPLETIONS, prefill_body(body)))["kv_transfer_params"]
    response = fleet.decode.post(COMPLETIONS, {**body, "kv_transfer_params": {
        **params, "first_token": first_token}})
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]
    fleet.prefill.wait_for("the lease released", idle, timeout=10)
