"""The official ``openai`` client against a real sidecar and through the real proxy.

Real processes: the run's shared ``both`` sidecar (the single-instance reference),
prefill and decode sidecar (policy ``fail``, so that a failed read is never hidden by a
recompute) and the ``python -m proxy`` in front of them (``shared_servers.py``), and
this module's prefill with other weights whose KV every decode refuses. Each test runs
the calls real clients make (several prompts, ``n``, seeds, stop strings, logprobs,
streamed usage, chat with a system message, echo, errors) on the single sidecar and
through the proxy, and checks that the disaggregated answer is the single-instance one
(greedy, or seeded). Blocks and leases must all be free after every test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from shared_servers import PullPair
from sidecars import ProxyProcess, Sidecar, SidecarGroup, Spec, events, prefill_body

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MODEL = "kvxfer-tiny"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}
SAMPLED: dict[str, Any] = {"model": MODEL, "temperature": 1.0, "seed": 7,
                           "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What colour is the sky?"}]
LOGPROB_TOLERANCE = 1e-4
TARGETS = ["sidecar", "proxy"]


@dataclass(frozen=True)
class Fleet:
    both: Sidecar
    prefill: Sidecar
    decode: Sidecar
    other_weights: Sidecar  # a prefill with seed 1: every decode refuses its KV
    proxy: ProxyProcess
    clients: dict[str, openai.OpenAI]

    @property
    def reference(self) -> openai.OpenAI:
        return self.clients["sidecar"]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def fleet(plain: Sidecar, pull_pair: PullPair, proxied: ProxyProcess,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with SidecarGroup(tmp_path_factory.mktemp("openai-client")) as group:
        other = group.start_one(Spec("prefill", extra=("--seed", "1", "--lease-ttl", "2")))
        clients = {"sidecar": client(plain.url), "proxy": client(proxied.url)}
        yield Fleet(plain, pull_pair.prefill, pull_pair.decode, other, proxied, clients)
        for c in clients.values():
            c.close()


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest, fleet: Fleet) -> Iterator[openai.OpenAI]:
    yield fleet.clients[request.param]
    wait_idle(fleet)


def idle(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0
                and health["requests_in_flight"] == 0)


def wait_idle(fleet: Fleet, timeout: float = 20.0) -> None:
    """Every sidecar: no request in flight, no lease, every block free."""
    for sidecar in (fleet.both, fleet.prefill, fleet.decode, fleet.other_weights):
        sidecar.wait_for("idle: no request, lease or used block", idle, timeout)


@dataclass(frozen=True)
class Counts:
    """What the transfer path did, read from the sidecars' /metrics."""

    prefill_calls: float
    reads: float
    sibling_copies: float

    @staticmethod
    def of(fleet: Fleet) -> Counts:
        calls = sum(fleet.prefill.metric("kvxfer_http_requests_total", route=route,
                                         status="200") for route in (COMPLETIONS, CHAT))
        return Counts(calls, fleet.decode.metric("kvxfer_kv_transfers_total", outcome="ok"),
                      fleet.decode.metric("kvxfer_kv_sibling_copies_total"))

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.prefill_calls - other.prefill_calls, self.reads - other.reads,
                      self.sibling_copies - other.sibling_copies)


def texts(answer: Any) -> list[str]:
    """Choice texts (completions) or message contents (chat), in index order."""
    choices = sorted(answer.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(len(choices)))
    return [c.text if hasattr(c, "text") else c.message.content for c in choices]


def assert_close(got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, abs=LOGPROB_TOLERANCE)


# -- several prompts ----------------------------------------------------------------------

PROMPT_LISTS = {"strings": ["The first prompt", "a second one", "third"],
                "token ids": [[256, 104, 105, 33], [256, 79, 75], [256] + [120] * 20]}


@pytest.mark.parametrize("kind", PROMPT_LISTS)
def test_a_list_of_prompts_answers_one_choice_each(fleet: Fleet, target: openai.OpenAI,
                                                   kind: str) -> None:
    prompts = PROMPT_LISTS[kind]
    before = Counts.of(fleet)
    answer = target.completions.create(prompt=prompts, max_tokens=5, **GREEDY)
    alone = [fleet.reference.completions.create(prompt=p, max_tokens=5, **GREEDY)
             for p in prompts]
    assert texts(answer) == [texts(a)[0] for a in alone]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert answer.usage.completion_tokens == 5 * len(prompts)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 5 * len(prompts)
    if target is fleet.clients["proxy"]:
        done = Counts.of(fleet) - before
        assert (done.prefill_calls, done.reads) == (len(prompts), len(prompts)), done


def test_a_list_of_prompts_streams_interleaved_with_one_usage_and_one_done(
        fleet: Fleet, target: openai.OpenAI) -> None:
    prompts = ["stream one", "stream two", "stream three"]
    whole = fleet.reference.completions.create(prompt=prompts, max_tokens=6, **GREEDY)
    chunks = list(target.completions.create(prompt=prompts, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices
                        and c.choices[0].index == i) for i in range(len(prompts))]
    assert streamed == texts(whole)
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2]


def test_a_streamed_list_through_the_proxy_ends_once(fleet: Fleet) -> None:
    body = {"prompt": ["a", "b"], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    payloads = events(fleet.proxy.post(COMPLETIONS, body))
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
    usage = [p for p in payloads[:-1] if p.get("usage")]
    assert len(usage) == 1 and usage[0] is payloads[-2]
    assert usage[0]["usage"]["completion_tokens"] == 6
    wait_idle(fleet)


# -- n ------------------------------------------------------------------------------------

def test_n_greedy_choices_are_identical_from_one_read(fleet: Fleet,
                                                      target: openai.OpenAI) -> None:
    before = Counts.of(fleet)
    answer = target.completions.create(prompt="Two of the same", n=2, max_tokens=6, **GREEDY)
    one = fleet.reference.completions.create(prompt="Two of the same", max_tokens=6, **GREEDY)
    assert texts(answer) == [texts(one)[0]] * 2
    assert answer.usage is not None and one.usage is not None
    # a prompt's tokens count once however many choices answer it (vLLM, OpenAI)
    assert answer.usage.prompt_tokens == one.usage.prompt_tokens
    assert answer.usage.completion_tokens == 12
    if target is fleet.clients["proxy"]:
        done = Counts.of(fleet) - before
        assert done == Counts(prefill_calls=1, reads=1, sibling_copies=1), done


def test_n_seeded_choices_differ_and_repeat(fleet: Fleet, target: openai.OpenAI) -> None:
    body = {"prompt": "Sample me", "n": 3, "max_tokens": 8, **SAMPLED}
    first, again = (texts(target.completions.create(**body)) for _ in range(2))
    assert first == again, "a seeded request must repeat"
    assert len(set(first)) == 3, f"the samples must differ: {first}"
    # sample j draws from seed + j, on one instance as through the proxy
    singles = [texts(fleet.reference.completions.create(
        **{**body, "n": 1, "seed": SAMPLED["seed"] + j}))[0] for j in range(3)]
    assert first == singles


def test_n_times_several_prompts_through_the_proxy(fleet: Fleet) -> None:
    proxy = fleet.clients["proxy"]
    before = Counts.of(fleet)
    body = {"prompt": ["left", "right"], "n": 2, "max_tokens": 4, **SAMPLED}
    answer = proxy.completions.create(**body)
    want = fleet.reference.completions.create(**body)
    assert texts(answer) == texts(want) and len(texts(answer)) == 4
    assert texts(answer)[2:] == texts(fleet.reference.completions.create(
        **{**body, "prompt": "right"}))
    assert answer.usage == want.usage
    assert Counts.of(fleet) - before == Counts(prefill_calls=2, reads=2, sibling_copies=2)
    wait_idle(fleet)


def test_n_chat_with_a_system_message(fleet: Fleet, target: openai.OpenAI) -> None:
    body = {"messages": MESSAGES, "n": 2, "max_completion_tokens": 5, **SAMPLED}
    answer = target.chat.completions.create(**body)
    want = fleet.reference.chat.completions.create(**body)
    assert texts(answer) == texts(want) and texts(answer)[0] != texts(answer)[1]
    assert all(c.message.role == "assistant" for c in answer.choices)
    assert answer.usage is not None and answer.usage.completion_tokens == 10
    greedy = {**body, **GREEDY, "seed": None}
    one = fleet.reference.chat.completions.create(**{**greedy, "n": 1})
    assert texts(target.chat.completions.create(**greedy)) == texts(one) * 2


def test_n_streamed_with_usage(fleet: Fleet, target: openai.OpenAI) -> None:
    body = {"prompt": "Stream two samples", "n": 2, "max_tokens": 5, **SAMPLED}
    whole = fleet.reference.completions.create(**body)
    chunks = list(target.completions.create(**body, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices
                        and c.choices[0].index == j) for j in range(2)]
    assert streamed == texts(whole)
    assert chunks[-1].usage == whole.usage


def test_a_client_leaving_frees_every_sample(fleet: Fleet, target: openai.OpenAI) -> None:
    wait_idle(fleet)
    generated = fleet.decode.metric("kvxfer_generation_tokens_total") \
        + fleet.both.metric("kvxfer_generation_tokens_total")
    stream = target.completions.create(prompt=["long one", "long two"], n=3, max_tokens=1500,
                                       stream=True, **GREEDY)
    assert next(iter(stream)).choices
    stream.close()
    wait_idle(fleet, timeout=30)
    tokens = fleet.decode.metric("kvxfer_generation_tokens_total") \
        + fleet.both.metric("kvxfer_generation_tokens_total") - generated
    assert tokens < 6 * 1500, "the abandoned samples ran to the end"


def test_a_failed_read_fails_every_sample_and_frees_their_blocks(fleet: Fleet) -> None:
    """The decode (policy fail) refuses KV from other weights: all n samples fail."""
    body = {"prompt": "doomed", "n": 3, "max_tokens": 4, "temperature": 0}
    first = fleet.other_weights.post(COMPLETIONS, prefill_body(body))
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    response = fleet.decode.post(COMPLETIONS, {**body, "kv_transfer_params": params})
    assert response.status_code == 502, response.text
    assert response.json()["error"]["type"] == "kv_transfer_error"
    wait_idle(fleet)


# -- stop strings, logprobs, usage, chat --------------------------------------------------

def test_stop_strings(fleet: Fleet, target: openai.OpenAI) -> None:
    full = texts(fleet.reference.completions.create(prompt="Stop somewhere", max_tokens=30,
                                                    **GREEDY))[0]
    stop = next(ch for ch in full[1:] if ch != "\ufffd" and ch.isprintable())
    cut = full[:full.index(stop)]
    answer = target.completions.create(prompt="Stop somewhere", max_tokens=30,
                                       stop=[stop, "never"], **GREEDY)
    assert texts(answer) == [cut] and answer.choices[0].finish_reason == "stop"
    chunks = list(target.completions.create(prompt="Stop somewhere", max_tokens=30, stop=stop,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(fleet: Fleet, target: openai.OpenAI) -> None:
    body = {"prompt": "Log my probabilities", "max_tokens": 6, "logprobs": 2, **GREEDY}
    got = target.completions.create(**body).choices[0].logprobs
    want = fleet.reference.completions.create(**body).choices[0].logprobs
    assert got is not None and want is not None
    assert got.tokens == want.tokens and len(got.tokens or []) == 6
    assert_close(got.token_logprobs or [], want.token_logprobs or [])
    assert got.text_offset == want.text_offset
    for top, token, value in zip(got.top_logprobs or [], got.tokens or [],
                                 got.token_logprobs or [], strict=True):
        assert 2 <= len(top) <= 3 and top[token] == pytest.approx(value)


def test_chat_top_logprobs(fleet: Fleet, target: openai.OpenAI) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, "logprobs": True, "top_logprobs": 3,
            **GREEDY}
    got = target.chat.completions.create(**body).choices[0].logprobs
    want = fleet.reference.chat.completions.create(**body).choices[0].logprobs
    assert got is not None and want is not None and got.content and want.content
    assert [c.token for c in got.content] == [c.token for c in want.content]
    assert_close([c.logprob for c in got.content], [c.logprob for c in want.content])
    for item in got.content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_streamed_usage_adds_up(fleet: Fleet, target: openai.OpenAI, route: str) -> None:
    if route == COMPLETIONS:
        body: dict[str, Any] = {"prompt": "Count my tokens", "max_tokens": 7, "logprobs": 0,
                                **GREEDY}
        create: Any = target.completions.create
        whole = fleet.reference.completions.create(**body)
    else:
        body = {"messages": MESSAGES, "max_tokens": 7, "logprobs": True, **GREEDY}
        create = target.chat.completions.create
        whole = fleet.reference.chat.completions.create(**body)
    chunks = list(create(**body, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    if route == COMPLETIONS:
        tokens = sum(len(c.choices[0].logprobs.tokens) for c in chunks[:-1]
                     if c.choices[0].logprobs)
    else:
        tokens = sum(len(c.choices[0].logprobs.content or []) for c in chunks[:-1]
                     if c.choices[0].logprobs)
    assert usage.completion_tokens == tokens == 7
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + 7


def test_chat_with_a_system_message_and_max_completion_tokens(
        fleet: Fleet, target: openai.OpenAI) -> None:
    for body in ({"messages": MESSAGES, "max_completion_tokens": 6, **GREEDY},
                 {"messages": MESSAGES, "max_completion_tokens": 6, **SAMPLED}):
        answer = target.chat.completions.create(**body)
        want = fleet.reference.chat.completions.create(**body)
        assert texts(answer) == texts(want)
        assert answer.usage is not None and answer.usage.completion_tokens == 6
        assert answer.choices[0].finish_reason == "length"
    # the system message is part of the prompt: without it the prompt is shorter
    short = fleet.reference.chat.completions.create(messages=MESSAGES[1:], max_tokens=1,
                                                    **GREEDY)
    assert answer.usage.prompt_tokens > short.usage.prompt_tokens  # type: ignore[union-attr]


# -- echo ---------------------------------------------------------------------------------

def test_echo_prepends_the_prompt(fleet: Fleet, target: openai.OpenAI) -> None:
    plain = texts(fleet.reference.completions.create(prompt=["Echo me", "and me"],
                                                     max_tokens=4, **GREEDY))
    echoed = texts(target.completions.create(prompt=["Echo me", "and me"], max_tokens=4,
                                             echo=True, **GREEDY))
    assert echoed == ["Echo me" + plain[0], "and me" + plain[1]]
    ids = [256, *b"token ids"]
    answer = target.completions.create(prompt=ids, max_tokens=4, echo=True, **GREEDY)
    assert texts(answer)[0].startswith("token ids")
    chunks = list(target.completions.create(prompt="Echo me", max_tokens=4, echo=True,
                                            stream=True, **GREEDY))
    assert chunks[0].choices[0].text == "Echo me"
    assert "".join(c.choices[0].text for c in chunks) == echoed[0]


# -- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_an_unknown_model_is_not_found(fleet: Fleet, target: openai.OpenAI, route: str) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        if route == COMPLETIONS:
            target.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
        else:
            target.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 404
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "model", error
    assert "'gpt-9' does not exist" in error["message"] and MODEL in error["message"]


BAD_VALUES: list[tuple[str, dict[str, Any], str, str]] = [
    ("n zero", {"n": 0}, "n", "got 0"),
    ("temperature negative", {"temperature": -1}, "temperature", "-1"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens", "got 0"),
    ("top_p above one", {"top_p": 2}, "top_p", "2"),
    ("logprobs too many", {"logprobs": 21}, "logprobs", "got 21"),
    ("echo with logprobs", {"echo": True, "logprobs": 1}, "echo", "not both"),
    ("empty stop string", {"stop": [""]}, "stop", "must not be empty"),
    ("prompt too long", {"prompt": "x" * 2100}, "prompt", "2101 tokens"),
    ("second prompt too long", {"prompt": ["fine", "y" * 2100]}, "prompt", "2101 tokens"),
]


@pytest.mark.parametrize(("case", "over", "param", "says"), BAD_VALUES,
                         ids=[c[0] for c in BAD_VALUES])
def test_bad_values_are_bad_requests_that_hold_nothing(
        fleet: Fleet, target: openai.OpenAI, case: str, over: dict[str, Any], param: str,
        says: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, **over}
    with pytest.raises(openai.BadRequestError) as caught:
        target.completions.create(**body)
    error = caught.value.body
    assert caught.value.status_code == 400 and isinstance(error, dict)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert says in error["message"], error["message"]
    if case == "second prompt too long" and target is fleet.clients["proxy"]:
        assert error["message"].startswith("prompt[1]: "), error["message"]
    # every lease the request made is ended within seconds, not at the lease TTL
    wait_idle(fleet, timeout=10)


def test_a_failed_prompt_among_several_drains_the_others_lease(fleet: Fleet) -> None:
    wait_idle(fleet)
    # the drain is a one-token decode call: its first token, the prefill's, is the whole
    # answer, so the decode reads nothing and releases the lease at once
    answered = fleet.prefill.metric("kvxfer_kv_leases_released_total", reason="answered")
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]"):
        fleet.clients["proxy"].completions.create(prompt=["fine", "z" * 2100], max_tokens=3,
                                                  model=MODEL)
    fleet.prefill.wait_for("the first prompt's lease ended", idle, timeout=10)
    assert fleet.prefill.metric("kvxfer_kv_leases_released_total",
                                reason="answered") == answered + 1

