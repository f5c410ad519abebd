"""Push mode under faults, with real processes: a reservation nobody writes into, a
prefill killed while it holds one, a decode killed while a prefill pushes to it.

Each case ends with a clear outcome (an error that names the failed instance, or the
single instance's answer), every surviving sidecar with every block free and no lease
held, and nothing wrong served. The decodes reserve for 2 s (``--lease-ttl 2``), so an
unused reservation ends after those plus :data:`~kvxfer.wire.reservations.PUSH_GRACE_S`
(the writers' cut-off: a block may be written until then, so it is not freed before).
Only processes this module started are signalled, by PID. In the heavy tier: each case
starts its own processes and waits out a reservation (about a minute in all).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecars import ProxyProcess, SidecarGroup, Spec, prefill_body, start_proxies

from kvxfer.wire.reservations import PUSH_GRACE_S

COMPLETIONS = "/v1/completions"
BODY: dict[str, Any] = {"model": "kvxfer-tiny", "temperature": 0, "ignore_eos": True,
                        "max_tokens": 4, "prompt": "A push that meets a fault " * 4}
pytestmark = pytest.mark.heavy

RESERVE_S = 2.0
ENDS_S = RESERVE_S + PUSH_GRACE_S + 8.0  # an unused reservation is over by then
PUSH_DECODE = ("--kv-transfer-mode", "push", "--lease-ttl", str(RESERVE_S))


def idle(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0
                and health["reservations"] == 0 and health["requests_in_flight"] == 0)


def reserving(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] > 0 and health["reservations"] > 0)


class Pair:
    """A prefill, a push-mode decode and a push-mode proxy in front of them."""

    def __init__(self, log_dir: Path, policy: str = "fail") -> None:
        self.group = SidecarGroup(log_dir)
        self.prefill, self.decode = self.group.start([
            Spec("prefill"), Spec("decode", policy=policy, extra=PUSH_DECODE)])
        self.proxy = ProxyProcess(log_dir, [self.prefill], [self.decode],
                                  ("--health-interval", "3600", "--kv-transfer-mode", "push"))
        start_proxies([self.proxy])

    def close(self) -> None:
        try:
            self.proxy.stop()
        finally:
            self.group.close()

    def through_proxy(self) -> tuple[threading.Thread, list[httpx.Response]]:
        """Send BODY through the proxy on a thread; its answer lands in the list."""
        answers: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: answers.append(self.proxy.post(COMPLETIONS, BODY)), daemon=True)
        thread.start()
        return thread, answers


@pytest.fixture
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    pair = Pair(tmp_path, getattr(request, "param", "fail"))
    try:
        yield pair
    finally:
        pair.prefill.send_signal(signal.SIGCONT)  # never leave a stopped process behind
        pair.close()


@pytest.mark.parametrize("pair", ["fail", "recompute"], indirect=True)
def test_an_unused_reservation_frees_its_blocks_at_its_deadline_and_a_late_request_is_told(
        pair: Pair) -> None:
    """Its blocks free at the deadline plus the grace, not before; a prefill refuses to
    write into it (400, before computing anything); the generation request that names it
    late recomputes its prompt or is refused saying why, by the failure policy."""
    want = pair.proxy.post(COMPLETIONS, BODY)  # pushed: the answer to compare with
    assert want.status_code == 200, want.text
    reserved = pair.decode.post("/v1/kv/reserve", {"endpoint": COMPLETIONS, "body": BODY})
    assert reserved.status_code == 200, reserved.text
    reservation = reserved.json()["kv_reservation"]
    assert reserving(pair.decode.health())
    time.sleep(RESERVE_S + 1.0)
    assert reserving(pair.decode.health()), "freed while a writer may still write"
    pair.decode.wait_for("the unused reservation's blocks free", idle, timeout=ENDS_S)
    late = pair.prefill.post(COMPLETIONS, {**prefill_body(BODY), "kv_transfer_params": {
        "do_remote_decode": True, "kv_reservation": reservation}})
    assert late.status_code == 400 and "expired" in late.text, late.text
    params = {"do_remote_prefill": True, "kv_reservation_id": reservation["reservation_id"]}
    answer = pair.decode.post(COMPLETIONS, {**BODY, "kv_transfer_params": params})
    if pair.decode.spec.policy == "recompute":
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"] == want.json()["choices"]
        assert pair.decode.metric("kvxfer_kv_recomputes_total") == 1
    else:
        assert answer.status_code == 400 and "ended unused" in answer.text, answer.text
    for side in (pair.prefill, pair.decode):
        side.wait_for("every block free", idle)


def test_a_prefill_killed_holding_a_reservation_fails_the_request_and_strands_nothing(
        pair: Pair) -> None:
    pair.prefill.send_signal(signal.SIGSTOP)  # the proxy reserves, then waits on it
    thread, answers = pair.through_proxy()
    pair.decode.wait_for("the proxy's reservation", reserving)
    pair.prefill.kill()
    thread.join(timeout=60)
    assert answers, "the proxy never answered"
    assert answers[0].status_code in (502, 503), answers[0].text
    assert "prefill" in answers[0].text, answers[0].text
    pair.decode.wait_for("the reservation the dead prefill held ends", idle, timeout=ENDS_S)
    assert pair.decode.metric("kvxfer_kv_transfers_total", outcome="ok") == 0


def test_a_decode_killed_while_a_prefill_pushes_to_it_fails_the_request_and_frees_the_prefill(
        pair: Pair) -> None:
    pair.prefill.send_signal(signal.SIGSTOP)  # the request reaches it with the reservation
    thread, answers = pair.through_proxy()
    pair.decode.wait_for("the proxy's reservation", reserving)
    pair.decode.kill()
    pair.prefill.send_signal(signal.SIGCONT)  # it computes and pushes to a dead decode
    thread.join(timeout=60)
    assert answers, "the proxy never answered"
    assert answers[0].status_code in (502, 503), answers[0].text
    assert "decode" in answers[0].text, answers[0].text
    pair.prefill.wait_for("the failed push's blocks free", idle, timeout=ENDS_S)
