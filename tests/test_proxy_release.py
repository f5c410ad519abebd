"""A lease nobody will read is released at once by whoever holds its params.

Real sidecar processes and a real proxy on 127.0.0.1. The prefill keeps the default
120 s lease TTL, so a lease that ends within seconds proves the release:

* ``POST /v1/kv/release`` on a prefill ends a lease it handed out and nobody claimed,
  for the caller that shows its params (200 ``{"released": true}``; again: ``false``);
  params that do not parse, or name another prefill, are a 400, and a decode refuses
  the route;
* the proxy uses it when no decode took a request it prefilled (its only decode died
  after the last health check): the client gets 503 and the prefill's blocks are free
  within seconds, not at the TTL.

Keyed prefills check the params' ticket first (``test_trust``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sidecars import ProxyProcess, Sidecar, SidecarGroup, Spec, prefill_body, start_proxies

from proxy.contract import parse_prefill_answer

COMPLETIONS, RELEASE = "/v1/completions", "/v1/kv/release"
BODY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
RELEASED = "kvxfer_kv_leases_released_total"
WITHIN_S = 10.0  # far below the 120 s TTL: only a release frees a lease this fast


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    log_dir = tmp_path_factory.mktemp("proxy-release")
    with SidecarGroup(log_dir) as group:
        prefill, decode = group.start([Spec("prefill", tp=2), Spec("decode", policy="fail")])
        proxy = ProxyProcess(log_dir, [prefill], [decode], ("--health-interval", "3600"))
        try:
            start_proxies([proxy])
            yield {"prefill": prefill, "decode": decode, "proxy": proxy}
        finally:
            proxy.stop()


def lease(prefill: Sidecar, prompt: str) -> dict[str, Any]:
    answer = prefill.post(COMPLETIONS, prefill_body({**BODY, "prompt": prompt}))
    assert answer.status_code == 200, answer.text
    return parse_prefill_answer(answer.content, prefill.url)


def leases_back_to(prefill: Sidecar, count: int) -> None:
    prefill.wait_for(f"{count} leases held", lambda h: h["leases"] == count, timeout=WITHIN_S)


def test_a_prefill_ends_an_unclaimed_lease_for_the_holder_of_its_params(
        rig: dict[str, Any]) -> None:
    prefill, decode = rig["prefill"], rig["decode"]
    before = prefill.metric(RELEASED, reason="abandoned")
    params = lease(prefill, "a prompt whose decode never comes")
    assert prefill.health()["leases"] == 1
    answer = prefill.post(RELEASE, {"kv_transfer_params": params})
    assert answer.status_code == 200 and answer.json() == {"released": True}, answer.text
    leases_back_to(prefill, 0)
    assert prefill.metric(RELEASED, reason="abandoned") == before + 1, "ended on both ranks"
    again = prefill.post(RELEASE, {"kv_transfer_params": params})
    assert again.status_code == 200 and again.json() == {"released": False}, again.text
    for body, says in (({"kv_transfer_params": {**params, "remote_engine_id": "prefill-x"}},
                        "this is prefill-"),
                       ({"kv_transfer_params": {"remote_request_id": "r"}}, "cannot release"),
                       ({"nothing": 1}, "cannot release")):
        refused = prefill.post(RELEASE, body)
        assert refused.status_code == 400 and says in refused.text, refused.text
    garbage = prefill.client.post(f"{prefill.url}{RELEASE}", content=b"\xff{")
    assert garbage.status_code == 400, garbage.text
    wrong_role = decode.post(RELEASE, {"kv_transfer_params": params})
    assert wrong_role.status_code == 400 and "no leases" in wrong_role.text, wrong_role.text


def test_the_proxy_releases_the_lease_of_a_request_no_decode_took(rig: dict[str, Any]) -> None:
    """LAST: kills the rig's only decode. The proxy checks health once an hour, so it
    still routes to it: the decode call finds nobody, the client gets 503, and the
    proxy releases the lease it had the prefill take."""
    prefill, decode, proxy = rig["prefill"], rig["decode"], rig["proxy"]
    leases_back_to(prefill, 0)
    before = prefill.metric(RELEASED, reason="abandoned")
    decode.kill()
    started = time.monotonic()
    answer = proxy.post(COMPLETIONS, {**BODY, "prompt": "a prompt no decode will read"})
    assert answer.status_code == 503, answer.text
    assert "no healthy decode" in answer.json()["error"]["message"], answer.text
    leases_back_to(prefill, 0)
    assert prefill.metric(RELEASED, reason="abandoned") == before + 1
    assert time.monotonic() - started < WITHIN_S
