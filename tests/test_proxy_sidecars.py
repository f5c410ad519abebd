"""The proxy as a real process in front of real ``kvxfer serve`` sidecars, over real HTTP.

One module-scoped fleet: a ``both`` reference sidecar, two prefill and two
decode sidecars (policy ``fail``), and a prefill serving other weights (seed 1,
leases of 2 s). Three ``python -m proxy`` processes stand in front of them:

* ``proxy``: both prefills and both decodes, no client key, health checks too
  rare to matter (so only the request path can mark an instance down);
* ``keyed``: the same instances behind ``--api-key``, health checks every second;

Every sidecar has its own HTTP key (``--api-key``), which each proxy passes on
(``--upstream-api-key``, from the environment): the fleet runs as deployed.
* ``mismatched``: the other-weights prefill and the second decode, whose KV
  transfers therefore fail at the handshake.

Checked: both routes, streamed and not, answer exactly what one instance
answers; round robin over 2 + 2 instances; the client's X-Request-Id reaches
both stages; a sidecar's 4xx passes through unchanged; a decode-stage transfer
failure is a 502 naming the decode; a client that leaves stops the decode; the
API key; a killed prefill is skipped. The kill is the LAST test: it leaves the
fleet with one prefill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecars import (
    ProxyProcess,
    Sidecar,
    SidecarGroup,
    Spec,
    events,
    new_api_key,
    prefill_body,
    start_proxies,
)

from proxy.contract import decode_request, parse_prefill_answer

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 6}
BODIES: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": "Through the proxy", "logprobs": 1, **GREEDY},
    CHAT: {"messages": [{"role": "user", "content": "Hello, proxy!"}], "logprobs": True,
           **GREEDY},
}
API_KEY = new_api_key()  # the keyed proxy's, for its clients
SIDECAR_KEY = new_api_key()  # every sidecar's; each proxy passes it as --upstream-api-key
LOGPROB_TOLERANCE = 1e-4
JSON_TYPE = "application/json"


@dataclass(frozen=True)
class Fleet:
    """The module's processes; ``prefills`` and ``decodes`` are what ``proxy`` and
    ``keyed`` route over, ``mismatched`` routes ``other_weights`` to ``decodes[1]``."""

    both: Sidecar
    prefills: list[Sidecar]
    decodes: list[Sidecar]
    other_weights: Sidecar  # a prefill with seed 1: its KV is refused by every decode
    proxy: ProxyProcess
    keyed: ProxyProcess
    mismatched: ProxyProcess
    spare_decode: Sidecar  # the only decode of ``lonely``; a test kills it
    lonely: ProxyProcess
    keyless: ProxyProcess  # prefills[0] and decodes[0], without the sidecars' key

    @property
    def workers(self) -> list[Sidecar]:
        return self.prefills + self.decodes


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("proxy-sidecars")
    with SidecarGroup(log_dir) as group, contextlib.ExitStack() as stack:
        key = SIDECAR_KEY
        both, p0, p1, d0, d1, other, spare = group.start([
            Spec("both", api_key=key), Spec("prefill", api_key=key),
            Spec("prefill", api_key=key), Spec("decode", policy="fail", api_key=key),
            Spec("decode", policy="fail", api_key=key),
            Spec("prefill", extra=("--seed", "1", "--lease-ttl", "2"), api_key=key),
            Spec("decode", policy="fail", api_key=key)])
        proxies = []
        for prefills, decodes, extra, client_key in (
                ([p0, p1], [d0, d1], ("--health-interval", "3600"), None),
                ([p0, p1], [d0, d1], ("--health-interval", "1"), API_KEY),
                ([other], [d1], ("--health-interval", "3600"), None),
                ([other], [spare], ("--health-interval", "0.5"), None)):
            proxy = ProxyProcess(log_dir, prefills, decodes, extra, api_key=client_key)
            stack.callback(proxy.stop)
            proxies.append(proxy)
        keyless = ProxyProcess(log_dir, [p0], [d0], ("--health-interval", "3600"),
                               pass_key=False)
        stack.callback(keyless.stop)
        start_proxies([*proxies, keyless])
        proxy, keyed, mismatched, lonely = proxies
        yield Fleet(both, [p0, p1], [d0, d1], other, proxy, keyed, mismatched, spare, lonely,
                    keyless)


# -- helpers ------------------------------------------------------------------------------

def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, f"{response.status_code}: {response.text}"
    return dict(response.json())


def text_and_logprobs(route: str, choices: list[dict[str, Any]]
                      ) -> tuple[str, list[str], list[float]]:
    """Text, tokens and their logprobs of a whole answer's or a stream's choices (in order)."""
    text, tokens, logprobs = "", [], []
    for choice in choices:
        if route == COMPLETIONS:
            text += choice["text"]
            tokens += (choice["logprobs"] or {}).get("tokens", [])
            logprobs += (choice["logprobs"] or {}).get("token_logprobs", [])
        else:
            text += (choice.get("message") or choice.get("delta") or {}).get("content") or ""
            content = (choice.get("logprobs") or {}).get("content") or []
            tokens += [c["token"] for c in content]
            logprobs += [c["logprob"] for c in content]
    return text, tokens, logprobs


def assert_same_answer(route: str, got: list[dict[str, Any]], want: list[dict[str, Any]]
                       ) -> None:
    got_text, got_tokens, got_logprobs = text_and_logprobs(route, got)
    want_text, want_tokens, want_logprobs = text_and_logprobs(route, want)
    assert len(want_tokens) == GREEDY["max_tokens"], want
    assert (got_text, got_tokens) == (want_text, want_tokens)
    for i, (a, b) in enumerate(zip(got_logprobs, want_logprobs, strict=True)):
        assert abs(a - b) < LOGPROB_TOLERANCE, f"token {i}: logprob {a} vs {b}"


def reference(fleet: Fleet, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return list(ok(fleet.both.post(route, body))["choices"])


def idle(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0
                and health["requests_in_flight"] == 0)


def wait_fleet_idle(fleet: Fleet) -> None:
    """Every prefill and decode: no request in flight, no lease, every block free."""
    for sidecar in [*fleet.workers, fleet.other_weights]:
        if sidecar.process is not None and sidecar.process.poll() is None:
            sidecar.wait_for("idle: no request, lease or used block", idle)


def served(sidecar: Sidecar, route: str = COMPLETIONS, status: str = "200") -> float:
    return sidecar.metric("kvxfer_http_requests_total", route=route, status=status)


def kv_reads(fleet: Fleet) -> float:
    """KV transfers the decodes completed."""
    return sum(d.metric("kvxfer_kv_transfers_total", outcome="ok") for d in fleet.decodes)


def completion_calls(sidecars: list[Sidecar]) -> float:
    """Completion requests the sidecars' handlers answered, both routes and every status
    together (401s never reach a handler: not counted)."""
    return sum(v for s in sidecars for (name, labels), v in s.metrics().items()
               if name == "kvxfer_http_requests_total"
               and dict(labels).get("route") in (COMPLETIONS, CHAT)
               and dict(labels).get("status") != "401")


# -- both routes, streamed and not --------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_answers_match_a_single_instance(fleet: Fleet, route: str, stream: bool) -> None:
    body = BODIES[route]
    want = reference(fleet, route, body)
    rid = f"match-{route.rsplit('/', 1)[1]}-{stream}"
    reads = kv_reads(fleet)
    response = fleet.proxy.post(route, {**body, "stream": stream},
                                headers={"x-request-id": rid})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == rid
    prefix = "cmpl" if route == COMPLETIONS else "chatcmpl"
    if stream:
        chunks = events(response)
        assert chunks[-1] == "[DONE]" and response.text.endswith("data: [DONE]\n\n")
        parts = chunks[:-1]
        assert len(parts) >= GREEDY["max_tokens"], f"{len(parts)} events relayed"
        assert {c["id"] for c in parts} == {f"{prefix}-{rid}"}, "the decode saw another id"
        assert parts[-1]["choices"][0]["finish_reason"] == "length"
        assert_same_answer(route, [c["choices"][0] for c in parts], want)
    else:
        answer = response.json()
        assert answer["id"] == f"{prefix}-{rid}", "the decode saw another request id"
        assert_same_answer(route, answer["choices"], want)
        assert answer["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert kv_reads(fleet) == reads + 1, "the decode did not read the prompt's KV"
    wait_fleet_idle(fleet)


# -- round robin --------------------------------------------------------------------------

def test_round_robin_over_two_prefills_and_two_decodes(fleet: Fleet) -> None:
    requests = 4
    prompts = [f"round robin {i}" for i in range(requests)]
    body = BODIES[COMPLETIONS]
    want = [reference(fleet, COMPLETIONS, {**body, "prompt": p}) for p in prompts]
    before = {s.url: served(s) for s in fleet.workers}
    reads = {d.url: d.metric("kvxfer_kv_transfers_total", outcome="ok") for d in fleet.decodes}
    done = {p.url: p.metric("kvxfer_kv_leases_released_total", reason="done")
            for p in fleet.prefills}
    for i, prompt in enumerate(prompts):
        response = fleet.proxy.post(COMPLETIONS, {**body, "prompt": prompt},
                                    headers={"x-request-id": f"rr-{i}"})
        answer = ok(response)
        assert response.headers["x-request-id"] == f"rr-{i}"
        assert answer["id"] == f"cmpl-rr-{i}", "the decode did not get the client's request id"
        assert_same_answer(COMPLETIONS, answer["choices"], want[i])
    wait_fleet_idle(fleet)
    share = requests // 2
    for sidecar in fleet.workers:
        got = served(sidecar) - before[sidecar.url]
        assert got == share, f"{sidecar.spec.role} {sidecar.url} served {got} of {requests}"
    for decode in fleet.decodes:
        got = decode.metric("kvxfer_kv_transfers_total", outcome="ok") - reads[decode.url]
        assert got == share, f"decode {decode.url} read the KV of {got} requests"
    for prefill in fleet.prefills:
        got = prefill.metric("kvxfer_kv_leases_released_total", reason="done") - done[
            prefill.url]
        assert got == share, f"prefill {prefill.url}: {got} leases released by 'done'"


# -- upstream errors ----------------------------------------------------------------------

def test_a_sidecar_rejection_passes_through_unchanged(fleet: Fleet) -> None:
    body = {**BODIES[COMPLETIONS], "prompt": [65] * 2100}  # over the 2048-token context
    decode_calls = completion_calls(fleet.decodes)
    rejected = sum(served(p, status="400") for p in fleet.prefills)
    response = fleet.proxy.post(COMPLETIONS, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == "prompt" and "2100 tokens" in error["message"], error
    # byte for byte what a prefill answers to the call the proxy makes
    direct = fleet.prefills[0].post(COMPLETIONS, prefill_body(body))
    assert (direct.status_code, direct.json()) == (400, response.json())
    assert sum(served(p, status="400") for p in fleet.prefills) == rejected + 2
    assert completion_calls(fleet.decodes) == decode_calls, "a rejected request reached a decode"
    # the proxy keeps serving
    want = reference(fleet, COMPLETIONS, BODIES[COMPLETIONS])
    assert_same_answer(COMPLETIONS, ok(fleet.proxy.post(COMPLETIONS, BODIES[COMPLETIONS]))[
        "choices"], want)
    wait_fleet_idle(fleet)


def test_a_failed_kv_transfer_is_a_502_naming_the_decode(fleet: Fleet) -> None:
    """The decode (policy fail) refuses KV from a prefill with other weights: the
    handshake's compatibility hashes differ. The decode then releases the unread lease
    over the prefill's side channel (reason "abandoned", well before its 2 s TTL)."""
    proxy, prefill, decode = fleet.mismatched, fleet.other_weights, fleet.decodes[1]
    engine_id = prefill.health()["engine_id"]
    failed = decode.metric("kvxfer_kv_transfers_total", outcome="failed")
    abandoned = prefill.metric("kvxfer_kv_leases_released_total", reason="abandoned")
    response = proxy.post(COMPLETIONS, BODIES[COMPLETIONS], headers={"x-request-id": "mm-1"})
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["type"] == "upstream_error" and error["code"] == 502
    message = error["message"]
    assert f"decode instance {decode.url} answered HTTP 502" in message, message
    assert engine_id in message and "not compatible" in message, message
    # the lease the prefill holds (a random id, not the client's X-Request-Id), named by
    # the proxy
    assert f"prefill instance {prefill.url} holds the KV of request '" in message, message
    assert "'mm-1" not in message, message
    # not retried: the proxy has no other prefill or decode, and the same pair fails alike
    assert decode.metric("kvxfer_kv_transfers_total", outcome="failed") == failed + 1
    assert proxy.metric("kvxfer_proxy_retries_total", role="decode") == 0
    decode.wait_for("the failed request's blocks free", idle)
    prefill.wait_for("the unread lease released", idle, timeout=20)
    assert prefill.metric("kvxfer_kv_leases_released_total", reason="abandoned") == abandoned + 1
    # a 502 is not an unreachable instance: the proxy keeps it and keeps serving
    health = proxy.health()
    assert health["status"] == "ok" and all(i["healthy"] for i in health["instances"]), health
    models = ok(proxy.get("/v1/models"))
    assert models["data"][0]["id"] == "kvxfer-tiny"


# -- client disconnect --------------------------------------------------------------------

def test_a_client_that_leaves_stops_the_decode(fleet: Fleet) -> None:
    wait_fleet_idle(fleet)
    max_tokens = 2000
    generated = sum(d.metric("kvxfer_generation_tokens_total") for d in fleet.decodes)
    # read ("done"), or released unread when the client left before the read began:
    # the first token, the prefill's, reaches the client before the decode reads any KV
    def ended() -> float:
        return sum(p.metric("kvxfer_kv_leases_released_total", reason=reason)
                   for p in fleet.prefills for reason in ("done", "abandoned"))

    before = ended()
    left = fleet.proxy.metric("kvxfer_proxy_client_disconnects_total", route=COMPLETIONS)
    body = {"prompt": "a long story", "stream": True, **GREEDY, "max_tokens": max_tokens}
    with httpx.Client(timeout=30, trust_env=False) as client, \
            client.stream("POST", f"{fleet.proxy.url}{COMPLETIONS}", json=body) as response:
        assert response.status_code == 200
        assert next(response.iter_lines()).startswith("data: {")
    for decode in fleet.decodes:
        decode.wait_for("the abandoned stream stopped and its blocks free", idle, timeout=30)
    tokens = sum(d.metric("kvxfer_generation_tokens_total") for d in fleet.decodes) - generated
    assert 1 <= tokens < max_tokens, (f"the stream should stop soon after the client left; "
                                      f"the decode generated {tokens} of {max_tokens} tokens")
    for prefill in fleet.prefills:
        prefill.wait_for("the lease released", idle)
    assert ended() == before + 1
    assert fleet.proxy.metric("kvxfer_proxy_client_disconnects_total",
                              route=COMPLETIONS) == left + 1
    assert all(i["outstanding"] == 0 for i in fleet.proxy.health()["instances"])


# -- API key ------------------------------------------------------------------------------

@pytest.mark.parametrize(("authorization", "says"), [
    (None, "missing Authorization header"),
    ("Bearer sk-wrong", "invalid API key"),
    (f"Basic {API_KEY}", "scheme 'Basic' is not supported"),
], ids=["missing", "wrong key", "wrong scheme"])
def test_api_key_refused(fleet: Fleet, authorization: str | None, says: str) -> None:
    headers = {"authorization": authorization} if authorization else {}
    calls = completion_calls(fleet.workers)
    for method, path in (("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models"),
                         ("GET", "/metrics")):
        response = fleet.keyed.client.request(
            method, f"{fleet.keyed.url}{path}", headers=headers,
            json=BODIES.get(path) if method == "POST" else None)
        assert response.status_code == 401, f"{method} {path}: {response.text}"
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == 401
        assert says in error["message"], error["message"]
        assert API_KEY not in error["message"]
    assert completion_calls(fleet.workers) == calls, "a refused request reached a sidecar"


def test_api_key_accepted_and_health_is_open(fleet: Fleet) -> None:
    assert fleet.keyed.get("/health").status_code == 200  # no key
    headers = fleet.keyed.auth
    for route, body in BODIES.items():
        answer = ok(fleet.keyed.post(route, body, headers=headers))
        assert_same_answer(route, answer["choices"], reference(fleet, route, body))
    assert ok(fleet.keyed.get("/v1/models", headers=headers))["data"][0]["id"] == "kvxfer-tiny"
    assert fleet.keyed.metric("kvxfer_proxy_requests_total", headers=headers,
                              route=COMPLETIONS, status="200") >= 1
    wait_fleet_idle(fleet)


def test_health_without_the_key_says_only_ok(fleet: Fleet) -> None:
    """The instance URLs map the cluster: only a caller with the key sees them."""
    bare = fleet.keyed.client.get(f"{fleet.keyed.url}/health")
    assert (bare.status_code, bare.json()) == (200, {"status": "ok"})
    full = ok(fleet.keyed.get("/health", headers=fleet.keyed.auth))
    assert [i["url"] for i in full["instances"]] == fleet.keyed.prefill_urls + \
        fleet.keyed.decode_urls
    for sidecar in fleet.workers:  # the same on every sidecar, whose key the proxy has
        with httpx.Client(trust_env=False, timeout=10) as stranger:
            bare = stranger.get(f"{sidecar.url}/health")
        assert (bare.status_code, bare.json()) == (200, {"status": "ok"})
        assert sidecar.health()["engine_id"], "with the key /health has the details"


def unauthenticated(sidecar: Sidecar, method: str, path: str, body: Any = None,
                    authorization: str | None = None) -> httpx.Response:
    headers = {"authorization": authorization} if authorization else {}
    with httpx.Client(trust_env=False, timeout=30) as stranger:
        return stranger.request(method, f"{sidecar.url}{path}", json=body, headers=headers)


@pytest.mark.parametrize("authorization", [None, "Bearer sk-wrong", f"Bearer {API_KEY}"],
                         ids=["missing", "wrong", "the proxy's client key"])
def test_a_sidecar_refuses_every_route_without_its_key(fleet: Fleet,
                                                       authorization: str | None) -> None:
    """The proxy's key does not open a sidecar: the sidecars have a key of their own."""
    calls = completion_calls(fleet.workers)
    for sidecar in [fleet.both, *fleet.workers]:
        for method, path in (("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models"),
                             ("GET", "/metrics")):
            response = unauthenticated(sidecar, method, path, BODIES.get(path), authorization)
            assert response.status_code == 401, f"{method} {path}: {response.text}"
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("authentication_error", 401), error
            assert SIDECAR_KEY not in response.text
    assert completion_calls(fleet.workers) == calls, "a refused call reached a handler"


def test_a_proxy_without_the_sidecars_key_says_so(fleet: Fleet) -> None:
    """The sidecars' 401 is the proxy's misconfiguration, not the client's: a 502 that
    names the flag, and nothing is prefilled."""
    calls = completion_calls(fleet.workers)
    response = fleet.keyless.post(COMPLETIONS, BODIES[COMPLETIONS])
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["type"] == "upstream_error" and "--upstream-api-key" in error["message"], error
    assert f"prefill instance {fleet.prefills[0].url} refused the proxy" in error["message"]
    assert completion_calls(fleet.workers) == calls
    assert fleet.keyless.health()["status"] == "ok", "a 401 does not mark the instance down"


def lease(prefill: Sidecar, body: dict[str, Any]) -> dict[str, Any]:
    """A lease, taken the way the proxy takes one (with the sidecars' key)."""
    answer = prefill.post(COMPLETIONS, prefill_body(body))
    return parse_prefill_answer(answer.content, prefill.url)


def test_an_unauthenticated_decode_call_releases_and_reads_nothing(fleet: Fleet) -> None:
    """A victim's lease named in a refused (bad body) call without the key: 401, the
    lease stays held, and the victim's own decode still reads it and answers right."""
    wait_fleet_idle(fleet)
    prefill, decode = fleet.prefills[0], fleet.decodes[0]
    body = BODIES[COMPLETIONS]
    victim = lease(prefill, body)
    reads = kv_reads_of(decode)
    for bad in ({**body, "max_tokens": -1}, {"prompt": "other", "max_tokens": 1}):
        response = unauthenticated(decode, "POST", COMPLETIONS, decode_request(bad, victim))
        assert response.status_code == 401, response.text
    time.sleep(1.0)  # a release, had one been sent, lands within milliseconds
    assert prefill.health()["leases"] == 1, "an unauthenticated call released the lease"
    assert kv_reads_of(decode) == reads
    answer = ok(decode.post(COMPLETIONS, decode_request(body, victim)))
    assert_same_answer(COMPLETIONS, answer["choices"], reference(fleet, COMPLETIONS, body))
    wait_fleet_idle(fleet)


def kv_reads_of(decode: Sidecar) -> float:
    return decode.metric("kvxfer_kv_transfers_total", outcome="ok")


def test_an_unauthenticated_decode_call_connects_nowhere(fleet: Fleet) -> None:
    """No port-scan oracle: without the key the decode never contacts the address a
    call names (a listening socket of the test's sees no connection)."""
    decode = fleet.decodes[0]
    with socket.socket() as target:
        target.bind(("127.0.0.1", 0))
        target.listen(8)
        target.settimeout(1.5)
        params = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_engine_id": "prefill-000000000000", "remote_host": "127.0.0.1",
                  "remote_port": target.getsockname()[1], "remote_block_ids": [0],
                  "remote_request_id": "scan@1", "remote_num_tokens": 4, "tp_size": 1}
        start = time.monotonic()
        response = unauthenticated(decode, "POST", COMPLETIONS,
                                   {"prompt": "a b c d", "max_tokens": 1,
                                    "kv_transfer_params": params})
        assert response.status_code == 401 and time.monotonic() - start < 1.0, response.text
        with pytest.raises(TimeoutError):
            target.accept()


def test_deeply_nested_json_is_a_400(fleet: Fleet) -> None:
    """100,000 nested arrays: an OpenAI 400, from the proxy and from every sidecar."""
    raw = b'{"prompt": ' + b"[" * 100_000
    targets = [(fleet.keyed, fleet.keyed.auth), (fleet.proxy, {})] + \
        [(s, {}) for s in [fleet.both, *fleet.workers]]  # sidecars' clients send their key
    for target, headers in targets:
        for route in (COMPLETIONS, CHAT):
            response = target.client.post(f"{target.url}{route}", content=raw,
                                          headers={**headers, "content-type": JSON_TYPE})
            assert response.status_code == 400, f"{target.url}{route}: {response.text[:300]}"
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", 400), error
            assert "nested too deeply" in error["message"], error
    assert fleet.proxy.health()["status"] == "ok"
    wait_fleet_idle(fleet)


def test_no_healthy_decode_is_a_503_before_any_prefill(fleet: Fleet) -> None:
    """``lonely`` has one decode; killed, the proxy answers 503 without prefilling, so
    no prefill block is leased for nobody."""
    proxy, prefill = fleet.lonely, fleet.other_weights
    prefill.wait_for("idle", idle)
    fleet.spare_decode.kill()
    deadline = time.monotonic() + 15
    while proxy.health()["status"] == "ok" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proxy.health()["status"] == "unavailable"
    calls = completion_calls([prefill])
    for i in range(4):
        response = proxy.post(COMPLETIONS, {**BODIES[COMPLETIONS], "prompt": f"nobody {i}"})
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and "no healthy decode" in error[
            "message"], error
    stream = proxy.post(COMPLETIONS, {**BODIES[COMPLETIONS], "stream": True,
                                      "prompt": ["two", "prompts"]})
    assert stream.status_code == 503, stream.text
    assert completion_calls([prefill]) == calls, "the proxy prefilled for no decode"
    assert prefill.health()["leases"] == 0


def test_a_frozen_prefill_is_retried_on_the_other(fleet: Fleet, tmp_path: Path) -> None:
    """A prefill frozen (SIGSTOP) behind a proxy with a 1.5 s prefill timeout: the request
    runs again on the other prefill and answers what one instance answers. Resumed, the
    frozen prefill computes the request the proxy gave up on, sees nobody waiting and ends
    that lease at once: no block is held till the lease's TTL (120 s)."""
    frozen, alive = fleet.prefills
    wait_fleet_idle(fleet)
    want = reference(fleet, COMPLETIONS, BODIES[COMPLETIONS])
    proxy = ProxyProcess(tmp_path, [frozen, alive], fleet.decodes,
                         ("--health-interval", "3600", "--prefill-timeout", "1.5"))
    try:
        start_proxies([proxy])
        before = served(alive)
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            response = proxy.post(COMPLETIONS, BODIES[COMPLETIONS])  # the rotation's first
            assert_same_answer(COMPLETIONS, ok(response)["choices"], want)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        assert served(alive) == before + 1
        assert proxy.metric("kvxfer_proxy_retries_total", role="prefill") == 1
        assert proxy.metric("kvxfer_proxy_upstream_errors_total", role="prefill",
                            instance=frozen.url, kind="timeout") == 1
        frozen.wait_for("the lease of the request nobody waits for ended", idle, timeout=15)
        wait_fleet_idle(fleet)
    finally:
        proxy.stop()


# -- an instance down (LAST: kills a prefill of the shared fleet) -------------------------

def test_a_killed_prefill_is_skipped(fleet: Fleet) -> None:
    alive, victim = fleet.prefills
    wait_fleet_idle(fleet)
    victim.kill()
    requests = 4
    before = {s.url: served(s) for s in [alive, *fleet.decodes]}
    want = reference(fleet, COMPLETIONS, BODIES[COMPLETIONS])
    for i in range(requests):
        response = fleet.proxy.post(COMPLETIONS, BODIES[COMPLETIONS],
                                    headers={"x-request-id": f"down-{i}"})
        assert_same_answer(COMPLETIONS, ok(response)["choices"], want)
    assert served(alive) - before[alive.url] == requests
    for decode in fleet.decodes:
        assert served(decode) - before[decode.url] == requests // 2
    # the request path found it dead (health checks of this proxy are an hour apart)
    health = fleet.proxy.health()
    assert health["status"] == "ok", health
    state = fleet.proxy.instance(victim.url)
    assert not state["healthy"] and "ConnectError" in (state["last_error"] or ""), state
    assert fleet.proxy.metric("kvxfer_proxy_upstream_errors_total", role="prefill",
                              instance=victim.url, kind="unreachable") >= 1
    # the keyed proxy's health checker finds it dead without any request
    deadline = time.monotonic() + 15
    while fleet.keyed.instance(victim.url)["healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    state = fleet.keyed.instance(victim.url)
    assert not state["healthy"] and "health check" in (state["last_error"] or ""), state
    wait_fleet_idle(fleet)
