"""The proxy over real HTTP: stub prefill/decode sidecars and the proxy, each a uvicorn
server on its own loopback port (threads of this process), driven by an HTTP client.

What the proxy answers by itself, before any upstream call (a missing or wrong API key,
a malformed body, an unknown route), is checked in process through the app's ASGI
interface (``in_process``); every route is served over real HTTP by the other tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import httpx
import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from stub_upstream import RefusingPort, ServerThread, Stub, wait_until

from proxy.app import create_app
from proxy.balancer import Balancer
from proxy.config import ProxyConfig
from proxy.health import HealthChecker
from proxy.stub import Call

ROUTES = ("/v1/completions", "/v1/chat/completions")
WAIT_S = 10.0

StartProxy = Callable[..., ServerThread]


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, list[Stub]]]:
    """Two prefill and two decode stubs shared by the module; reset around each test."""
    fleet = {"prefill": [Stub("prefill", "engine-p0"), Stub("prefill", "engine-p1")],
             "decode": [Stub("decode"), Stub("decode")]}
    started: list[Stub] = []
    try:
        for stub in fleet["prefill"] + fleet["decode"]:
            stub.server.start()
            started.append(stub)
        yield fleet
    finally:
        for stub in started:
            stub.server.stop()


@pytest.fixture(autouse=True)
def fresh_stubs(stubs: dict[str, list[Stub]]) -> Iterator[None]:
    for stub in stubs["prefill"] + stubs["decode"]:
        stub.reset()
    yield
    for stub in stubs["prefill"] + stubs["decode"]:
        stub.reset()


def proxy_config(stubs: dict[str, list[Stub]], prefill: list[str] | None = None,
                 decode: list[str] | None = None, **overrides: Any) -> ProxyConfig:
    """A proxy's settings (default: all four stubs)."""
    settings: dict[str, Any] = {"request_timeout": 10.0, "connect_timeout": 2.0,
                                "health_interval": 60.0, **overrides}
    return ProxyConfig(
        tuple(prefill if prefill is not None else [s.url for s in stubs["prefill"]]),
        tuple(decode if decode is not None else [s.url for s in stubs["decode"]]),
        **settings)


@pytest.fixture
def start_proxy(stubs: dict[str, list[Stub]]) -> Iterator[StartProxy]:
    """Start a proxy app (default: all four stubs); stopped when the test ends."""
    servers: list[ServerThread] = []

    def start(prefill: list[str] | None = None, decode: list[str] | None = None,
              **overrides: Any) -> ServerThread:
        server = ServerThread(create_app(proxy_config(stubs, prefill, decode, **overrides)))
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def in_process(stubs: dict[str, list[Stub]]) -> Iterator[Callable[..., httpx.Client]]:
    """A client of a proxy app run in this process with no server (the ASGI interface,
    lifespan on; all four stubs behind it): for what the proxy answers by itself."""
    with contextlib.ExitStack() as running:
        def start(**overrides: Any) -> httpx.Client:
            app = create_app(proxy_config(stubs, **overrides))
            return running.enter_context(TestClient(app, raise_server_exceptions=False))

        yield start


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=WAIT_S, trust_env=False) as c:
        yield c


def only_call(stubs: list[Stub], path: str | None = None) -> Call:
    calls = [c for s in stubs for c in s.record.calls(path)]
    assert len(calls) == 1, f"expected one call, stubs got {[c.path for c in calls]}"
    return calls[0]


def error_message(response: httpx.Response) -> str:
    return str(response.json()["error"]["message"])


def read_first_event(lines: Iterator[bytes]) -> bytes:
    """Bytes of a stream up to the end of its first SSE event (bounded by the chunk count)."""
    seen = b""
    for chunk in lines:
        seen += chunk
        if b"\n\n" in seen:
            return seen
    raise AssertionError(f"stream ended before a whole event: {seen!r}")


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("route", ROUTES)
def test_prefill_then_decode_non_streaming(route: str, stubs: dict[str, list[Stub]],
                                           start_proxy: StartProxy, client: httpx.Client) -> None:
    proxy = start_proxy()
    body: dict[str, Any] = {"model": "stub-model", "temperature": 0.5, "max_tokens": 20,
                            "stream": False}
    if route.endswith("chat/completions"):
        body |= {"messages": [{"role": "user", "content": "one two three"}],
                 "max_completion_tokens": 20}
    else:
        body["prompt"] = "one two three"
    answer = client.post(proxy.url + route, json=body, headers={"X-Request-Id": "req-abc"})
    assert answer.status_code == 200, answer.text
    prefill, decode = only_call(stubs["prefill"]), only_call(stubs["decode"])
    assert (prefill.path, decode.path) == (route, route)
    expected_prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}}
    if "max_completion_tokens" in body:
        expected_prefill["max_completion_tokens"] = 1
    assert prefill.body == expected_prefill
    leased = msgspec.json.decode(bytes(prefill.sent))["kv_transfer_params"]
    assert decode.body == {**body, "kv_transfer_params": leased}
    assert answer.content == bytes(decode.sent)  # the decode's answer, byte for byte
    assert prefill.request_id == decode.request_id == answer.headers["x-request-id"] == "req-abc"


@pytest.mark.parametrize("route", ROUTES)
def test_stream_is_relayed_as_it_arrives(route: str, stubs: dict[str, list[Stub]],
                                         start_proxy: StartProxy, client: httpx.Client) -> None:
    proxy = start_proxy()
    release = threading.Event()
    for stub in stubs["decode"]:
        stub.behaviour.hold = release  # each decode stalls after its first chunk
    body = {"prompt": "a b", "messages": [], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", proxy.url + route, json=body) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        chunks = answer.iter_raw()
        # The first event reaches us while the decode still holds the rest: no buffering.
        first = read_first_event(chunks)
        assert first.startswith(b"data: {")
        release.set()
        received = first + b"".join(chunks)
    prefill, decode = only_call(stubs["prefill"]), only_call(stubs["decode"])
    assert received == bytes(decode.sent) and decode.finished
    assert received.endswith(b"data: [DONE]\n\n")
    assert prefill.body["stream"] is False and "stream_options" not in prefill.body
    assert decode.body["stream"] is True and decode.body["stream_options"] == {
        "include_usage": True}
    request_id = answer.headers["x-request-id"]
    assert prefill.request_id == decode.request_id == request_id
    assert uuid.UUID(request_id)  # generated by the proxy: the client sent none


def test_round_robin_alternates_instances(stubs: dict[str, list[Stub]],
                                          start_proxy: StartProxy, client: httpx.Client) -> None:
    proxy = start_proxy(policy="round_robin")
    engines = []
    for i in range(4):
        answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"},
                             headers={"X-Request-Id": f"rr-{i}"})
        assert answer.status_code == 200, answer.text
        engines.append(answer.json()["choices"][0]["text"].split(" from ")[1])
    assert engines[0] != engines[1] and engines[:2] == engines[2:]
    for role in ("prefill", "decode"):
        ids = [sorted(c.request_id or "" for c in s.record.calls()) for s in stubs[role]]
        assert sorted(ids) == [["rr-0", "rr-2"], ["rr-1", "rr-3"]], (role, ids)


def test_least_outstanding_avoids_a_busy_decode(stubs: dict[str, list[Stub]],
                                                start_proxy: StartProxy,
                                                client: httpx.Client) -> None:
    proxy = start_proxy(policy="least_outstanding")
    release = threading.Event()
    for stub in stubs["decode"]:
        stub.behaviour.hold = release
    with client.stream("POST", proxy.url + "/v1/completions",
                       json={"prompt": "long", "stream": True},
                       headers={"X-Request-Id": "busy"}) as streaming:
        chunks = streaming.iter_raw()
        read_first_event(chunks)
        busy = next(s for s in stubs["decode"] if s.record.calls())
        idle = next(s for s in stubs["decode"] if s is not busy)
        idle.behaviour.hold = None  # answer at once (the busy one only streams)
        states = {i["url"]: i["outstanding"] for i in client.get(proxy.url + "/health").json()[
            "instances"]}
        assert states[busy.url] == 1 and states[idle.url] == 0, states
        for i in range(3):
            answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"},
                                 headers={"X-Request-Id": f"lo-{i}"})
            assert answer.status_code == 200, answer.text
        release.set()
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    assert [c.request_id for c in busy.record.calls()] == ["busy"]
    assert [c.request_id for c in idle.record.calls()] == ["lo-0", "lo-1", "lo-2"]
    # Prefills are all idle between requests: ties alternate.
    counts = sorted(len(s.record.calls()) for s in stubs["prefill"])
    assert counts == [2, 2]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_unreachable_instance_is_skipped_and_marked_down(
        role: str, stubs: dict[str, list[Stub]], start_proxy: StartProxy,
        client: httpx.Client) -> None:
    doomed = Stub(role)
    doomed.server.start()
    others = stubs[role][:1]
    urls = {"prefill": [s.url for s in stubs["prefill"]],
            "decode": [s.url for s in stubs["decode"]]}
    urls[role] = [doomed.url, others[0].url]
    proxy = start_proxy(urls["prefill"], urls["decode"])  # both healthy at start
    doomed.server.stop()  # now refuses connections; the proxy has not noticed yet
    for _ in range(2):
        answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 200, answer.text
    assert len(others[0].record.calls()) == 2
    health = {i["url"]: i for i in client.get(proxy.url + "/health").json()["instances"]}
    assert health[doomed.url]["healthy"] is False
    assert "ConnectError" in health[doomed.url]["last_error"]
    samples = metric_samples(client.get(proxy.url + "/metrics").text)
    assert samples[("kvxfer_proxy_upstream_errors_total", frozenset(
        {"role": role, "instance": doomed.url, "kind": "unreachable"}.items()))] == 1.0


def test_health_checker_revives_an_instance(stubs: dict[str, list[Stub]],
                                            start_proxy: StartProxy,
                                            client: httpx.Client) -> None:
    comeback = Stub("decode")
    comeback.server.start()
    try:
        proxy = start_proxy(decode=[comeback.url], health_interval=0.05)

        def healthy() -> bool:
            return bool(client.get(proxy.url + "/health").status_code == 200)

        comeback.server.stop()
        wait_until(lambda: not healthy(), WAIT_S, "the stopped decode to be marked down")
        answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 503
        comeback.server.start()
        wait_until(healthy, WAIT_S, "the restarted decode to be revived")
        answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 200, answer.text
        assert len(comeback.record.calls()) == 1
    finally:
        comeback.server.stop()


def test_a_late_health_answer_takes_an_instance_out_only_when_repeated(
        stubs: dict[str, list[Stub]]) -> None:
    """A busy instance that answers /health late once stays in the rotation; the
    ``failures``-th late answer in a row, a refused connection or a 503 takes it out."""
    slow, sick = stubs["decode"]
    refused = RefusingPort()
    balancer = Balancer(ProxyConfig((stubs["prefill"][0].url,),
                                    (slow.url, sick.url, refused.url)))
    late, unwell, gone = balancer.instances("decode")
    seen: list[tuple[bool, bool, bool]] = []

    async def rounds() -> None:
        async with aiohttp.ClientSession() as session:
            checker = HealthChecker(balancer, session, 60.0, 1.0, timeout=0.2, failures=3)
            await checker.check_all()  # the two stubs answer: up
            gone.healthy = True  # as if it had been up before its process went away
            seen.append((late.healthy, unwell.healthy, gone.healthy))
            slow.behaviour.health_delay_s = 1.0
            sick.behaviour.healthy = False
            for _ in range(3):
                await checker.check_all()
                seen.append((late.healthy, unwell.healthy, gone.healthy))
            slow.behaviour.health_delay_s = 0.0
            await checker.check(late)  # answered in time: back, and the count starts over
            slow.behaviour.health_delay_s = 1.0
            await checker.check(late)
            seen.append((late.healthy, unwell.healthy, gone.healthy))

    try:
        asyncio.run(rounds())
    finally:
        refused.close()
    assert seen == [(True, True, True), (True, False, False), (True, False, False),
                    (False, False, False), (True, False, False)]
    assert "ReadTimeout (1 of 3 in a row take it out)" in (late.last_error or "")
    assert unwell.last_error == "health check: GET /health answered HTTP 503"
    assert "ConnectError" in (gone.last_error or "")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_reachable_instance_is_503_naming_the_role(
        role: str, stubs: dict[str, list[Stub]], start_proxy: StartProxy,
        client: httpx.Client) -> None:
    dead = RefusingPort()
    try:
        urls = {"prefill": [s.url for s in stubs["prefill"]],
                "decode": [s.url for s in stubs["decode"]]}
        urls[role] = [dead.url]
        proxy = start_proxy(urls["prefill"], urls["decode"])
        answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 503
        assert error_message(answer).startswith(f"no healthy {role} instance: {dead.url} (")
        assert answer.json()["error"]["code"] == 503
        health = client.get(proxy.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
    finally:
        dead.close()


@pytest.mark.parametrize(("role", "stream"), [("prefill", False), ("decode", False),
                                              ("decode", True)])
def test_upstream_5xx_without_retries_is_502_naming_stage_and_instance(
        role: str, stream: bool, stubs: dict[str, list[Stub]], start_proxy: StartProxy,
        client: httpx.Client) -> None:
    proxy = start_proxy(retries=0)
    for stub in stubs[role]:
        stub.behaviour.fail_status = 500
    answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": stream})
    assert answer.status_code == 502
    failed = only_call(stubs[role])
    url = next(s.url for s in stubs[role] if s.record.calls())
    message = error_message(answer)
    assert message.startswith(f"{role} instance {url} answered HTTP 500: stub {role} told to "
                              f"fail with HTTP 500")
    assert failed.finished
    if role == "decode":  # the prefill's lease is reported, not retried elsewhere
        assert "holds the KV of request" in message
        assert len(stubs["prefill"][0].record.calls("/v1/completions")
                   + stubs["prefill"][1].record.calls("/v1/completions")) == 1


def retries_counted(client: httpx.Client, proxy: ServerThread, role: str) -> float:
    samples = metric_samples(client.get(proxy.url + "/metrics").text)
    return samples.get(("kvxfer_proxy_retries_total", frozenset({("role", role)})), 0.0)


@pytest.mark.parametrize(("role", "stream"), [("prefill", False), ("decode", False),
                                              ("decode", True)])
def test_a_5xx_runs_the_request_again_on_the_other_instances(
        role: str, stream: bool, stubs: dict[str, list[Stub]], start_proxy: StartProxy,
        client: httpx.Client) -> None:
    """The first instance of ``role`` in the rotation fails every call: the request runs
    again, a new prefill and a decode, on instances other than the failed try's, and
    answers 200."""
    proxy = start_proxy()
    broken, working = stubs[role]  # the rotation's first request tries ``broken`` first
    broken.behaviour.fail_status = 500
    answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": stream})
    assert answer.status_code == 200, answer.text
    assert len(broken.record.calls("/v1/completions")) == 1
    assert len(working.record.calls("/v1/completions")) == 1
    first, second = (len(s.record.calls("/v1/completions")) for s in stubs["prefill"])
    assert (first, second) == (1, 1), "the retry prefills anew, on the other prefill"
    assert retries_counted(client, proxy, role) == 1.0


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_try_failing_answers_the_last_failure(
        role: str, stubs: dict[str, list[Stub]], start_proxy: StartProxy,
        client: httpx.Client) -> None:
    """Retries allowed for three tries, but there are two instances: each is tried once,
    and the client gets the second failure."""
    proxy = start_proxy(retries=2)
    for stub in stubs[role]:
        stub.behaviour.fail_status = 503
    answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 502
    assert [len(s.record.calls("/v1/completions")) for s in stubs[role]] == [1, 1], \
        "the retry went to the instance that had not failed, and no third try was made"
    second = stubs[role][1].url
    assert error_message(answer).startswith(f"{role} instance {second} answered HTTP 503")
    assert retries_counted(client, proxy, role) == 1.0


def test_no_retry_on_the_instances_that_failed(stubs: dict[str, list[Stub]],
                                               start_proxy: StartProxy,
                                               client: httpx.Client) -> None:
    """One prefill, failing: the same instance is not asked again."""
    broken = stubs["prefill"][0]
    proxy = start_proxy(prefill=[broken.url])
    broken.behaviour.fail_status = 500
    answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 502
    assert len(broken.record.calls("/v1/completions")) == 1
    assert retries_counted(client, proxy, "prefill") == 0.0


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_upstream_4xx_passes_through(role: str, stubs: dict[str, list[Stub]],
                                     start_proxy: StartProxy, client: httpx.Client) -> None:
    proxy = start_proxy()
    for stub in stubs[role]:
        stub.behaviour.fail_status = 422
    answer = client.post(proxy.url + "/v1/chat/completions", json={"messages": []})
    assert answer.status_code == 422
    assert answer.content == bytes(only_call(stubs[role]).sent)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_upstream_timeout_is_504_and_cancels_the_call(
        role: str, stubs: dict[str, list[Stub]], start_proxy: StartProxy,
        client: httpx.Client) -> None:
    """A decode's timeout is not retried (it may be slow, not broken); a prefill's is, on
    the other prefill: the client gets 504 when both time out."""
    proxy = start_proxy(request_timeout=0.3)
    for stub in stubs[role]:
        stub.behaviour.delay_s = 5.0
    answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 504
    calls = [(s.url, c) for s in stubs[role] for c in s.record.calls()]
    assert len(calls) == (2 if role == "prefill" else 1)
    assert any(error_message(answer).startswith(f"{role} instance {url} did not answer "
                                                f"within 0.3 s") for url, _ in calls)
    for _, call in calls:
        wait_until(lambda c=call: c.disconnected, WAIT_S,
                   f"the {role} stub to see the proxy leave")


@pytest.mark.parametrize(("failure", "status", "says"), [
    ("break", 502, "failed: RemoteProtocolError"),
    ("stall", 504, "did not answer within 0.5 s (ReadTimeout)")])
def test_stream_failing_midway_ends_with_an_error_event(
        failure: str, status: int, says: str, stubs: dict[str, list[Stub]],
        start_proxy: StartProxy, client: httpx.Client) -> None:
    proxy = start_proxy(request_timeout=0.5)
    for stub in stubs["decode"]:
        if failure == "break":
            stub.behaviour.break_after = 1
        else:
            stub.behaviour.hold = threading.Event()  # never set: the stream stalls
    answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": True})
    assert answer.status_code == 200  # the stream had started before it failed
    events = answer.content.split(b"\n\n")
    assert events[0].startswith(b"data: {") and events[-2:] == [b"data: [DONE]", b""]
    error = msgspec.json.decode(events[-3].removeprefix(b"data: "))["error"]
    url = next(s.url for s in stubs["decode"] if s.record.calls())
    assert error["code"] == status
    assert error["message"].startswith(f"decode instance {url} {says}")


def test_client_leaving_a_stream_cancels_the_decode(stubs: dict[str, list[Stub]],
                                                    start_proxy: StartProxy,
                                                    client: httpx.Client) -> None:
    proxy = start_proxy()
    for stub in stubs["decode"]:
        stub.behaviour.hold = threading.Event()  # never set: only a disconnect ends it
    with client.stream("POST", proxy.url + "/v1/completions",
                       json={"prompt": "x", "stream": True}) as answer:
        read_first_event(answer.iter_raw())
    # Leaving the block closed our connection mid-stream.
    call = only_call(stubs["decode"])
    wait_until(lambda: call.disconnected, WAIT_S, "the decode stub to see the proxy leave")
    assert not call.finished

    def outstanding() -> list[int]:
        return [i["outstanding"] for i in client.get(proxy.url + "/health").json()["instances"]]

    wait_until(lambda: outstanding() == [0, 0, 0, 0], WAIT_S, "outstanding calls to drop")
    samples = metric_samples(client.get(proxy.url + "/metrics").text)
    assert samples[("kvxfer_proxy_client_disconnects_total",
                    frozenset({"route": "/v1/completions"}.items()))] == 1.0


def test_client_leaving_before_the_answer_cancels_the_decode(
        stubs: dict[str, list[Stub]], start_proxy: StartProxy, client: httpx.Client) -> None:
    proxy = start_proxy()
    for stub in stubs["decode"]:
        stub.behaviour.hold = threading.Event()
    with pytest.raises(httpx.ReadTimeout):
        client.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=0.5)
    call = only_call(stubs["decode"])
    wait_until(lambda: call.disconnected, WAIT_S, "the decode stub to see the proxy leave")
    assert not call.finished

    def counted() -> float:
        samples = metric_samples(client.get(proxy.url + "/metrics").text)
        return samples.get(("kvxfer_proxy_requests_total", frozenset(
            {"route": "/v1/completions", "status": "499"}.items())), 0.0)

    wait_until(lambda: counted() == 1.0, WAIT_S, "the abandoned request to be counted as 499")


@pytest.mark.parametrize(("authorization", "says"), [
    (None, "missing Authorization header"),
    ("Basic czNjcmV0", "Authorization scheme 'Basic' is not supported"),
    ("Bearer wrong", "invalid API key")])
def test_api_key_is_required(authorization: str | None, says: str,
                             in_process: Callable[..., httpx.Client],
                             stubs: dict[str, list[Stub]]) -> None:
    client = in_process(api_key="s3cret")
    headers = {"Authorization": authorization} if authorization else {}
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/nowhere")):
        answer = client.request(method, path, json={"prompt": "x"}, headers=headers)
        assert answer.status_code == 401, (path, answer.text)
        assert error_message(answer).startswith(says)
        assert answer.json()["error"]["type"] == "authentication_error"
        assert "s3cret" not in answer.text
    assert client.get("/health", headers=headers).status_code == 200
    assert not any(s.record.calls() for s in stubs["prefill"] + stubs["decode"])


def test_api_key_accepted(start_proxy: StartProxy, client: httpx.Client) -> None:
    proxy = start_proxy(api_key="s3cret")
    headers = {"Authorization": "Bearer s3cret"}
    answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
    assert answer.status_code == 200, answer.text
    assert client.get(proxy.url + "/metrics", headers=headers).status_code == 200


def test_health_reports_every_instance(stubs: dict[str, list[Stub]], start_proxy: StartProxy,
                                       client: httpx.Client) -> None:
    proxy = start_proxy(health_interval=0.05)
    health = client.get(proxy.url + "/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "policy": "kv_aware", "instances": [
        {"url": s.url, "role": role, "healthy": True, "outstanding": 0, "tokens_in_flight": 0,
         "last_error": None, "retired": False}
        for role in ("prefill", "decode") for s in stubs[role]]}
    sick, well = stubs["decode"]
    sick.behaviour.healthy = False  # its /health answers 503 from now on

    def state(url: str) -> dict[str, Any]:
        instances = client.get(proxy.url + "/health").json()["instances"]
        return dict(next(i for i in instances if i["url"] == url))

    wait_until(lambda: not state(sick.url)["healthy"], WAIT_S, "the 503 decode to be marked down")
    assert state(sick.url)["last_error"] == "health check: GET /health answered HTTP 503"
    assert client.get(proxy.url + "/health").status_code == 200  # one decode is enough
    answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
    assert answer.status_code == 200 and len(well.record.calls()) == 1
    well.behaviour.healthy = False
    wait_until(lambda: client.get(proxy.url + "/health").status_code == 503, WAIT_S,
               "/health to answer 503 with no healthy decode")


def test_metrics_exposition(stubs: dict[str, list[Stub]], start_proxy: StartProxy,
                            client: httpx.Client) -> None:
    proxy = start_proxy()
    for stream in (False, True):
        answer = client.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": stream})
        assert answer.status_code == 200
    assert client.post(proxy.url + "/v1/completions", content=b"{").status_code == 400
    exposition = client.get(proxy.url + "/metrics")
    assert exposition.headers["content-type"].startswith("text/plain")
    samples = metric_samples(exposition.text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    route = "/v1/completions"
    assert value("kvxfer_proxy_requests_total", route=route, status="200") == 2.0
    assert value("kvxfer_proxy_requests_total", route=route, status="400") == 1.0
    assert value("kvxfer_proxy_time_to_first_byte_seconds_count", route=route) == 3.0
    assert value("kvxfer_proxy_in_flight_requests", route="/metrics") == 1.0  # this scrape
    assert value("kvxfer_proxy_in_flight_requests", route=route) == 0.0
    for role in ("prefill", "decode"):
        per_instance = [value("kvxfer_proxy_upstream_latency_seconds_count", role=role,
                              instance=s.url) for s in stubs[role]]
        assert sorted(per_instance) == [1.0, 1.0]
        for stub in stubs[role]:
            assert value("kvxfer_proxy_instance_healthy", role=role, instance=stub.url) == 1.0


def test_models_come_from_a_decode(start_proxy: StartProxy, client: httpx.Client) -> None:
    proxy = start_proxy()
    answer = client.get(proxy.url + "/v1/models", headers={"X-Request-Id": "m-1"})
    assert answer.status_code == 200
    assert answer.json()["data"][0]["root"] == "decode"
    assert answer.headers["x-request-id"] == "m-1"


@pytest.mark.parametrize(("content", "says"), [
    (b"{not json", "request body is not valid JSON: "),
    (b"[1, 2]", "request body must be a JSON object, got an array"),
    (b'{"prompt": "x", "stream": "yes"}', "'stream' must be true or false, got 'yes'")])
def test_malformed_client_body_is_400(content: bytes, says: str, stubs: dict[str, list[Stub]],
                                      in_process: Callable[..., httpx.Client]) -> None:
    answer = in_process().post("/v1/completions", content=content,
                               headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert error_message(answer).startswith(says)
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert not any(s.record.calls() for s in stubs["prefill"] + stubs["decode"])


@pytest.mark.parametrize(("answer", "says"), [
    (b"not json", "answered invalid JSON: "),
    (b'{"choices": []}', "answered without a kv_transfer_params object (found null)"),
    (b'{"kv_transfer_params": {"do_remote_prefill": true}}',
     "answered invalid kv_transfer_params: Object missing required field `do_remote_decode`")])
def test_prefill_answer_breaking_the_contract_is_502(
        answer: bytes, says: str, stubs: dict[str, list[Stub]], start_proxy: StartProxy,
        client: httpx.Client) -> None:
    proxy = start_proxy()
    for stub in stubs["prefill"]:
        stub.behaviour.answer = answer
    response = client.post(proxy.url + "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 502
    url = next(s.url for s in stubs["prefill"] if s.record.calls())
    assert error_message(response).startswith(f"prefill instance {url} {says}")
    assert not any(s.record.calls() for s in stubs["decode"])


def test_unknown_route_is_an_openai_style_404(in_process: Callable[..., httpx.Client]) -> None:
    answer = in_process().get("/v1/nowhere")
    assert answer.status_code == 404
    assert error_message(answer) == "GET /v1/nowhere: Not Found"
