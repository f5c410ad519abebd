"""The proxy's pure parts: configuration, the sidecar contract, the balancer policies."""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

import aiohttp
import msgspec
import pytest

from proxy.balancer import Balancer
from proxy.config import ConfigError, ProxyConfig, base_url, instance_urls
from proxy.contract import decode_request, parse_client_body, parse_prefill_answer, prefill_request
from proxy.errors import ProxyError
from proxy.metrics import ProxyMetrics
from proxy.middleware import ApiKeyMiddleware
from proxy.relay import ClientDisconnected, DisconnectWatch, unless_disconnected
from proxy.upstream import Upstream, error_excerpt, failure_name

URL = "http://127.0.0.1:9"
PARAMS: dict[str, Any] = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e0",
    "remote_host": "10.0.0.1", "remote_port": 5600, "remote_block_ids": [3, 1, 2],
    "remote_request_id": "r1", "remote_num_tokens": 40, "tp_size": 2,
    "lease_expires_at": 1.7e9}


def config(**overrides: Any) -> ProxyConfig:
    settings: dict[str, Any] = {"prefill_urls": ("http://p0", "http://p1", "http://p2"),
                                "decode_urls": ("http://d0",), **overrides}
    return ProxyConfig(**settings)


# -- config ----------------------------------------------------------------------------


def test_one_host_applies_to_every_port() -> None:
    assert instance_urls(["10.0.0.5"], [8100, 8101], "prefiller") == (
        "http://10.0.0.5:8100", "http://10.0.0.5:8101")
    assert instance_urls(["a", "b"], [1, 2], "decoder") == ("http://a:1", "http://b:2")
    assert base_url("::1", 80) == "http://[::1]:80"


def test_mismatched_host_and_port_counts_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"got 2 --prefiller-hosts \(a b\) for 3 "
                                          r"--prefiller-ports \(1 2 3\)"):
        instance_urls(["a", "b"], [1, 2, 3], "prefiller")


@pytest.mark.parametrize(("overrides", "says"), [
    ({"policy": "random"}, "unknown policy 'random'"),
    ({"request_timeout": 0.0}, "--request-timeout must be positive, got 0.0"),
    ({"connect_timeout": -1.0}, "--connect-timeout must be positive, got -1.0"),
    ({"health_interval": 0}, "--health-interval must be positive, got 0"),
    ({"health_timeout": 0.0}, "--health-timeout must be positive, got 0.0"),
    ({"health_failures": 0}, "--health-failures must be at least 1, got 0"),
    ({"api_key": ""}, "--api-key is empty"),
    ({"decode_urls": ()}, "at least one decode instance is needed"),
    ({"prefill_urls": ("http://p", "http://p")}, "prefill instances repeat: http://p, http://p"),
])
def test_config_errors_name_the_value(overrides: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        config(**overrides)


def test_port_out_of_range() -> None:
    with pytest.raises(ConfigError, match=re.escape("port 70000 is outside 1..65535")):
        base_url("h", 70000)


# -- contract --------------------------------------------------------------------------


def test_prefill_request_computes_one_token_without_streaming() -> None:
    body = {"messages": [], "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    assert prefill_request(body) == {
        "messages": [], "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    assert body["stream"] is True  # the client's body is left alone
    assert "max_completion_tokens" not in prefill_request({"prompt": "x"})


def test_decode_request_is_the_original_plus_params() -> None:
    body = {"prompt": "x", "stream": True, "kv_transfer_params": {"stale": 1}}
    assert decode_request(body, PARAMS) == {"prompt": "x", "stream": True,
                                            "kv_transfer_params": PARAMS}


def test_prefill_answer_params_are_forwarded_as_sent() -> None:
    extended = {**PARAMS, "future_field": [1]}
    content = msgspec.json.encode({"choices": [], "kv_transfer_params": extended})
    assert parse_prefill_answer(content, URL) == extended


@pytest.mark.parametrize(("params", "says"), [
    ({k: v for k, v in PARAMS.items() if k != "remote_port"},
     "Object missing required field `remote_port`"),
    ({**PARAMS, "remote_port": "5600"}, "Expected `int`, got `str` - at `$.remote_port`"),
    ({**PARAMS, "do_remote_prefill": False}, "do_remote_prefill=False, do_remote_decode=False"),
    ([1], "without a kv_transfer_params object (found an array)"),
])
def test_prefill_answer_breaking_the_contract(params: Any, says: str) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_prefill_answer(msgspec.json.encode({"kv_transfer_params": params}), URL)
    assert caught.value.status == 502
    assert f"prefill instance {URL} " in caught.value.message
    assert says in caught.value.message


@pytest.mark.parametrize(("raw", "says"), [
    (b"", "request body is not valid JSON: Input data was truncated"),
    (b'"text"', "request body must be a JSON object, got a string"),
    (b'{"stream": 1}', "'stream' must be true or false, got 1"),
])
def test_client_body_errors(raw: bytes, says: str) -> None:
    with pytest.raises(ProxyError) as caught:
        parse_client_body(raw)
    assert caught.value.status == 400 and caught.value.message.startswith(says)


def test_error_excerpt_prefers_the_openai_message() -> None:
    assert error_excerpt(b'{"error": {"message": "model overloaded"}}') == "model overloaded"
    assert error_excerpt(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert error_excerpt(b"") == "(empty body)"


# -- upstream failures -----------------------------------------------------------------


def connector_error() -> aiohttp.ClientConnectorError:
    key = aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 9, False, True, None, None, None)
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connect call failed"))


@pytest.mark.parametrize(("exc", "name"), [
    (connector_error(), "ConnectError"),
    (aiohttp.ConnectionTimeoutError("connect timed out"), "ConnectTimeout"),
    (aiohttp.SocketTimeoutError("no data"), "ReadTimeout"),
    (asyncio.TimeoutError(), "ReadTimeout"),
    (aiohttp.ClientOSError(104, "Connection reset by peer"), "ReadError"),
    (aiohttp.ServerDisconnectedError(), "RemoteProtocolError"),
    (aiohttp.ClientPayloadError("Response payload is not completed"), "RemoteProtocolError"),
])
def test_failures_are_named_by_what_happened(exc: BaseException, name: str) -> None:
    assert failure_name(exc) == name


def upstream() -> tuple[Upstream, Balancer]:
    settings = config(request_timeout=2.5)
    balancer = Balancer(settings)
    return Upstream(None, settings, ProxyMetrics(balancer, ())), balancer  # type: ignore[arg-type]


def test_failure_reports_name_the_stage_instance_and_cause() -> None:
    calls, balancer = upstream()
    decode = balancer.instances("decode")[0]
    reset = calls.failure(decode, aiohttp.ClientOSError(104, "Connection reset by peer"))
    assert isinstance(reset, ProxyError) and reset.status == 502
    assert reset.message == ("decode instance http://d0 failed: ReadError: [Errno 104] "
                             "Connection reset by peer")
    stalled = calls.failure(decode, aiohttp.SocketTimeoutError("no data"))
    assert isinstance(stalled, ProxyError) and stalled.status == 504
    assert stalled.message == "decode instance http://d0 did not answer within 2.5 s (ReadTimeout)"
    refused = calls.failure(balancer.instances("prefill")[1], connector_error())
    assert str(refused).startswith("prefill instance http://p1: ConnectError: Cannot connect to "
                                   "host 127.0.0.1:9")
    assert decode.last_error == "no answer within 2.5 s"


@pytest.mark.parametrize("call", ["fetch", "open_stream"])
def test_an_instance_that_never_answers_is_a_504(call: str) -> None:
    """A real listening socket that never answers: no headers within request_timeout."""
    import socket

    from proxy.upstream import new_client

    async def scenario(url: str) -> ProxyError:
        settings = ProxyConfig((url,), ("http://127.0.0.1:9",), request_timeout=0.2,
                               prefill_timeout=0.2)
        balancer = Balancer(settings)
        async with new_client(settings) as session:
            calls = Upstream(session, settings, ProxyMetrics(balancer, ()))
            prefill = balancer.instances("prefill")[0]
            with pytest.raises(ProxyError) as caught:
                if call == "fetch":
                    await calls.fetch(prefill, "POST", "/v1/completions", "r1", b"{}")
                else:
                    await calls.open_stream(prefill, "/v1/completions", "r1", b"{}")
            return caught.value

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel completes connections; nobody ever reads or answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        error = asyncio.run(scenario(url))
    assert error.status == 504
    assert error.message == f"prefill instance {url} did not answer within 0.2 s (ReadTimeout)"


# -- client disconnects ----------------------------------------------------------------


def test_disconnect_watch_needs_a_task() -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        refused: asyncio.Future[str] = loop.create_future()

        def outside_any_task() -> None:  # a loop callback: a loop is running, no task is
            try:
                DisconnectWatch(receive)
            except RuntimeError as exc:
                refused.set_result(str(exc))

        loop.call_soon(outside_any_task)
        return await refused

    assert asyncio.run(scenario()) == "DisconnectWatch needs a running task"


class Client:
    """An ASGI ``receive`` that answers ``http.disconnect`` once ``leave()`` is called."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.waiting = 0

    async def receive(self) -> dict[str, Any]:
        self.waiting += 1
        try:
            await self.gone.wait()
        finally:
            self.waiting -= 1
        return {"type": "http.disconnect"}


def test_a_client_leaving_cancels_the_work() -> None:
    async def scenario() -> None:
        client, cancelled = Client(), asyncio.Event()

        async def work() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return "late"

        asyncio.get_running_loop().call_later(0.01, client.gone.set)
        with pytest.raises(ClientDisconnected):
            await unless_disconnected(client.receive, work())
        assert cancelled.is_set()
        task = asyncio.current_task()
        assert task is not None
        if sys.version_info >= (3, 11):
            assert task.cancelling() == 0  # the watch took back its cancellation
        await asyncio.sleep(0)  # still runnable: nothing cancels us later

    asyncio.run(scenario())


def test_finished_work_wins_and_stops_the_watch() -> None:
    async def scenario() -> None:
        client = Client()

        async def work() -> str:
            await asyncio.sleep(0)
            return "answer"

        assert await unless_disconnected(client.receive, work()) == "answer"
        await asyncio.sleep(0)
        assert client.waiting == 0  # the pending receive() was cancelled
        client.gone.set()
        await asyncio.sleep(0.01)  # a disconnect now must not cancel this task

    asyncio.run(scenario())


def test_cancellation_from_elsewhere_is_not_a_disconnect() -> None:
    async def scenario() -> None:
        client = Client()
        request = asyncio.ensure_future(unless_disconnected(client.receive, asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        request.cancel()  # as the server does at shutdown
        with pytest.raises(asyncio.CancelledError):
            await request

    asyncio.run(scenario())


# -- server --------------------------------------------------------------------------------


def test_server_uses_uvloop_and_httptools_when_importable(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from proxy.server import server_options

    assert server_options() == {"loop": "uvloop", "http": "httptools"}
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert server_options() == {"loop": "asyncio", "http": "h11"}


# -- balancer --------------------------------------------------------------------------


def urls(instances: list[Any]) -> list[str]:
    return [i.url for i in instances]


def healthy_balancer(policy: str) -> Balancer:
    balancer = Balancer(config(policy=policy))
    for instance in balancer.instances():
        balancer.mark_up(instance)
    return balancer


def test_round_robin_rotates_over_healthy_instances() -> None:
    balancer = healthy_balancer("round_robin")
    firsts = [balancer.candidates("prefill")[0].url for _ in range(4)]
    assert firsts == ["http://p0", "http://p1", "http://p2", "http://p0"]
    p1 = balancer.instances("prefill")[1]
    balancer.mark_down(p1, "gone")
    orders = [urls(balancer.candidates("prefill")) for _ in range(2)]
    assert sorted(orders) == [["http://p0", "http://p2"], ["http://p2", "http://p0"]]
    assert p1.last_error == "gone"


def test_least_outstanding_prefers_idle_and_rotates_ties() -> None:
    balancer = healthy_balancer("least_outstanding")
    p0, p1, _ = balancer.instances("prefill")
    with balancer.busy(p0), balancer.busy(p0), balancer.busy(p1):
        assert urls(balancer.candidates("prefill")) == ["http://p2", "http://p1", "http://p0"]
    assert p0.outstanding == p1.outstanding == 0
    firsts = {balancer.candidates("prefill")[0].url for _ in range(3)}
    assert firsts == {"http://p0", "http://p1", "http://p2"}


def test_no_candidates_when_none_is_healthy() -> None:
    balancer = Balancer(config())  # nothing checked yet
    assert balancer.candidates("decode") == [] and not balancer.has_healthy("decode")


# -- API key ---------------------------------------------------------------------------


@pytest.mark.parametrize(("header", "problem"), [
    (None, "missing Authorization header; send 'Authorization: Bearer <api key>'"),
    ("Token k", "Authorization scheme 'Token' is not supported; use 'Bearer <api key>'"),
    ("Bearer k2", "invalid API key in the Authorization header"),
    ("Bearer k", None), ("bearer  k", None)])
def test_api_key_problems(header: str | None, problem: str | None) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    assert ApiKeyMiddleware(app, "k").problem(header) == problem


# -- app and stub construction ---------------------------------------------------------


def test_router_needs_a_running_app() -> None:
    from proxy.app import create_app

    service = create_app(config()).state.service
    with pytest.raises(RuntimeError, match=re.escape("not running (lifespan not started)")):
        service.router  # noqa: B018 (the property access is the test)


def test_stub_role_is_checked() -> None:
    from proxy.stub import create_stub_app

    with pytest.raises(ValueError, match="stub role must be 'prefill' or 'decode', got 'both'"):
        create_stub_app("both")
