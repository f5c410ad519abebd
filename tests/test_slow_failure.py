"""A dead or frozen prefill costs a client a bounded wait, and every block comes back.

Real processes: prefills, a decode (policy ``fail``, ``--kv-read-timeout 2``) and a
proxy (``--prefill-timeout 3``), all with HTTP keys and a shared KV key. A prefill is frozen with
SIGSTOP (and thawed with SIGCONT) or killed; only processes this module started
are signalled, by PID. Each wait is bounded; a thaw happens in ``finally``.

* killed prefill, the decode's first contact: 502 in well under a second (the
  refused TCP connect is definitive, nothing is retried);
* frozen prefill, the decode's first contact: 502 within the read timeout (was
  3 x 5 s of handshake attempts), the decode's blocks free at once, the
  prefill's lease ends after the thaw;
* frozen prefill behind the proxy: 504 within the prefill timeout (was the
  600 s request timeout), and after the thaw the prefill holds nothing;
* a request that reached a frozen sidecar on a kept-alive connection is answered
  after the thaw, however long the freeze (uvicorn's 5 s default keep-alive timeout
  used to close that connection on waking, the request unread);
* no port scanning through a decode, even for a caller with its HTTP key: params
  naming any other address lack a valid lease ticket, are refused with a 400 at
  once, and the decode never connects there.
"""

from __future__ import annotations

import http.client
import os
import secrets
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sidecars import (
    ProxyProcess,
    Sidecar,
    SidecarGroup,
    Spec,
    new_api_key,
    prefill_body,
    start_proxies,
)

from proxy.contract import decode_request, parse_prefill_answer

COMPLETIONS = "/v1/completions"
BODY: dict[str, Any] = {"prompt": "frozen or dead", "max_tokens": 4, "temperature": 0}
KEY = new_api_key()
KV_READ_TIMEOUT_S = 2.0
PREFILL_TIMEOUT_S = 3.0
LEASE_TTL_S = 4.0
SLACK_S = 2.0  # two busy shared cores


@dataclass
class Rig:
    prefill: Sidecar      # behind the proxy; frozen by one test
    frozen: Sidecar       # frozen at the decode's first contact
    doomed: Sidecar       # killed
    decode: Sidecar
    proxy: ProxyProcess


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    log_dir = tmp_path_factory.mktemp("slow-failure")
    kv_key = log_dir / "kv.key"
    kv_key.write_text(secrets.token_hex(32))
    kv_key.chmod(0o600)
    ttl = ("--lease-ttl", str(LEASE_TTL_S), "--kv-key-file", str(kv_key))
    with SidecarGroup(log_dir) as group:
        prefill, frozen, doomed, decode = group.start([
            Spec("prefill", api_key=KEY, extra=ttl), Spec("prefill", api_key=KEY, extra=ttl),
            Spec("prefill", api_key=KEY, extra=ttl),
            Spec("decode", policy="fail", api_key=KEY,
                 extra=("--kv-read-timeout", str(KV_READ_TIMEOUT_S), "--kv-key-file",
                        str(kv_key)))])
        proxy = ProxyProcess(log_dir, [prefill], [decode],
                             ("--prefill-timeout", str(PREFILL_TIMEOUT_S),
                              "--health-interval", "3600"))
        try:
            start_proxies([proxy])
            yield Rig(prefill, frozen, doomed, decode, proxy)
        finally:
            proxy.stop()


def lease(prefill: Sidecar) -> dict[str, Any]:
    answer = prefill.post(COMPLETIONS, prefill_body(BODY))
    assert answer.status_code == 200, answer.text
    return parse_prefill_answer(answer.content, prefill.url)


def timed_decode(decode: Sidecar, params: dict[str, Any]) -> tuple[float, httpx.Response]:
    start = time.monotonic()
    response = decode.post(COMPLETIONS, decode_request(BODY, params), timeout=60)
    return time.monotonic() - start, response


def idle(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0
                and health["requests_in_flight"] == 0)


class Frozen:
    """SIGSTOP a sidecar this module started; SIGCONT on exit, whatever happened."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.pid = sidecar.pid

    def __enter__(self) -> Frozen:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


def test_a_killed_prefill_is_a_502_at_once(rig: Rig) -> None:
    params = lease(rig.doomed)
    rig.doomed.kill()
    seconds, response = timed_decode(rig.decode, params)
    print(f"killed prefill: {response.status_code} after {seconds:.3f} s")
    assert response.status_code == 502, response.text
    assert "cannot connect" in response.json()["error"]["message"]
    assert seconds < 1.0, f"a refused connection took {seconds:.1f} s to report"
    rig.decode.wait_for("the failed request's blocks free", idle)


def test_a_frozen_prefill_is_a_502_within_the_read_timeout(rig: Rig) -> None:
    params = lease(rig.frozen)
    with Frozen(rig.frozen):
        seconds, response = timed_decode(rig.decode, params)
        print(f"frozen prefill, first contact: {response.status_code} after {seconds:.3f} s")
        assert response.status_code == 502, response.text
        assert seconds < KV_READ_TIMEOUT_S + SLACK_S, f"502 after {seconds:.1f} s"
        rig.decode.wait_for("the failed request's blocks free", idle, timeout=5)
    # thawed: the unread lease ends (released, or at its TTL), every block comes back
    rig.frozen.wait_for("the unread lease ended", idle, timeout=LEASE_TTL_S + 10)


def test_a_frozen_prefill_behind_the_proxy_is_a_504_within_the_prefill_timeout(
        rig: Rig) -> None:
    with Frozen(rig.prefill):
        start = time.monotonic()
        response = rig.proxy.post(COMPLETIONS, BODY, timeout=PREFILL_TIMEOUT_S + 30)
        seconds = time.monotonic() - start
        print(f"frozen prefill behind the proxy: {response.status_code} after {seconds:.3f} s")
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["type"] == "upstream_timeout" and rig.prefill.url in error["message"], error
    assert seconds < PREFILL_TIMEOUT_S + SLACK_S, f"504 after {seconds:.1f} s"
    # thawed: the prefill sees its caller gone (or leases for nobody until the TTL)
    rig.prefill.wait_for("nothing held for the timed-out call", idle, timeout=LEASE_TTL_S + 10)
    rig.decode.wait_for("idle", idle)
    # and the next request goes through
    answer = rig.proxy.post(COMPLETIONS, BODY)
    assert answer.status_code == 200, answer.text


def test_a_request_sent_to_a_frozen_sidecar_on_a_kept_alive_connection_is_answered(
        rig: Rig) -> None:
    frozen = rig.frozen
    with httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=30,
                      trust_env=False) as client:
        assert client.get(f"{frozen.url}/health").status_code == 200  # the connection opens
        result: dict[str, Any] = {}

        def ask() -> None:
            try:
                result["status"] = client.get(f"{frozen.url}/health").status_code
            except httpx.HTTPError as exc:
                result["status"] = repr(exc)

        with Frozen(frozen):
            asker = threading.Thread(target=ask, daemon=True)
            asker.start()  # on the kept-alive connection, idle for well under 4 s
            time.sleep(6.5)  # past uvicorn's default 5 s keep-alive timeout
        asker.join(20)
    assert result.get("status") == 200, result


def test_the_proxy_keeps_a_connection_open_as_long_as_its_clients_reuse_it(rig: Rig) -> None:
    """httpx and the openai client reuse a connection idle for up to 5 s; a proxy that
    closed it at 5 s (uvicorn's default) lost a request now and then."""
    where = urllib.parse.urlsplit(rig.proxy.url)
    connection = http.client.HTTPConnection(where.hostname or "", where.port, timeout=10)
    try:
        for pause in (0.0, 5.5):  # the connection opens, then idles past 5 s
            time.sleep(pause)
            connection.request("GET", "/health", headers=dict(rig.proxy.client.headers))
            answer = connection.getresponse()
            assert answer.status == 200, answer.read()
            answer.read()
    finally:
        connection.close()


@pytest.mark.parametrize("ticket", ["none", "forged", "another lease's"])
def test_the_decode_is_no_port_scanner(rig: Rig, ticket: str) -> None:
    with socket.socket() as target:
        target.bind(("127.0.0.1", 0))
        target.listen(8)
        target.settimeout(1.0)
        real = lease(rig.prefill)
        params = {**real, "remote_port": target.getsockname()[1]}
        if ticket == "none":
            params.pop("lease_ticket", None)
        elif ticket == "forged":
            params["lease_ticket"] = "v1." + secrets.token_urlsafe(32)
        seconds, response = timed_decode(rig.decode, params)
        assert response.status_code == 400, response.text
        assert seconds < 1.0, f"refused after {seconds:.1f} s"
        with pytest.raises(TimeoutError):
            target.accept()
    # the real lease, untouched by the refused call, is still read as it is, then ends
    seconds, response = timed_decode(rig.decode, real)
    assert response.status_code == 200, response.text
    rig.prefill.wait_for("the lease ended", idle, timeout=LEASE_TTL_S + 10)
