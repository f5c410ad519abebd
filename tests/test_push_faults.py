"""Push mode under faults, with real processes: a reservation nobody writes into, a
prefill killed while it holds one, a decode killed while a prefill pushes to it, and the
prefill's link cut while it pushes (the two on two "hosts", network namespaces).

Each case ends with a clear outcome (an error that names the failed instance, or the
single instance's answer), every surviving sidecar with every block free and no lease
held, and nothing wrong served. The decodes reserve for 2 s (``--lease-ttl 2``), so an
unused reservation ends after those plus :data:`~kvxfer.wire.reservations.PUSH_GRACE_S`
(the writers' cut-off: a block may be written until then, so it is not freed before).
Only processes this module started are signalled, by PID; the namespaces and links the
link-cut case makes are removed, also when it fails. In the heavy tier: each case starts
its own processes and waits out a reservation (about a minute and a half in all).
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
from sidecars import (
    NsSpec,
    ProxyProcess,
    Sidecar,
    SidecarGroup,
    Spec,
    at,
    health_inside,
    prefill_body,
    start_proxies,
)

from kvxfer.harness.network import UCX_ENV, Network, why_not
from kvxfer.sidecar.roles.claimers import PROBE_EVERY_S
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


def test_a_prefill_gone_after_it_claimed_a_reservation_ends_its_quarantine(
        tmp_path: Path) -> None:
    """The decode loses every NIXL notification and side-channel "done" report
    (``KVXFER_DROP_MESSAGES``), so a push that landed is never said to have: the
    reservation is overdue at its deadline plus the grace, its request recomputes, and its
    blocks stay out of use (counted in /health and /metrics) while the prefill that claimed
    it runs (only the writer can say its WRITEs ended). Killed, it cannot: the decode finds
    nothing listening at its side channel and frees the blocks the grace later."""
    with SidecarGroup(tmp_path, env={"KVXFER_DROP_MESSAGES": "notification=1,done=1"}
                      ) as group:
        prefill, decode = group.start([
            Spec("prefill"), Spec("decode", policy="recompute", extra=PUSH_DECODE)])
        want = decode.post(COMPLETIONS, BODY)  # the decode computing the prompt itself
        assert want.status_code == 200, want.text
        answer = decode.post(COMPLETIONS, push_first(prefill, decode, BODY), timeout=ENDS_S)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"] == want.json()["choices"]
        assert decode.metric("kvxfer_kv_recomputes_total") == 1
        time.sleep(2 * PROBE_EVERY_S + 1)  # probed meanwhile: the prefill still runs
        held = decode.health()
        assert held["quarantined_blocks"] > 0 and held["reservations"] == 1, held
        assert decode.metric("kvxfer_kv_quarantined_blocks") == held["quarantined_blocks"]
        assert decode.metric("kvxfer_kv_reservations_held") == 1
        prefill.kill()
        killed = time.monotonic()
        decode.wait_for("the gone prefill's reservation freed", idle,
                        timeout=PUSH_GRACE_S + 3 * PROBE_EVERY_S + 10)
        assert time.monotonic() - killed >= PUSH_GRACE_S - 1, "freed before the grace"
        assert "no longer runs" in decode.log_tail(200), decode.log_tail(20)


def test_a_request_whose_writer_died_before_its_done_arrived_recomputes_long_before_the_deadline(
        tmp_path: Path) -> None:
    """The decode loses every "done" (notifications and reports), so a push that landed
    is never said to have; its request waits. The prefill that claimed the reservation is
    killed: the decode finds nothing listening at its side channel, gives the reservation
    up at once (its request recomputes, a few seconds after the kill, not at the deadline
    a minute away) and frees its quarantined blocks the grace later."""
    reserve_s = 60.0
    with SidecarGroup(tmp_path, env={"KVXFER_DROP_MESSAGES": "notification=1,done=1"}
                      ) as group:
        prefill, decode = group.start([Spec("prefill"), Spec(
            "decode", policy="recompute",
            extra=("--kv-transfer-mode", "push", "--lease-ttl", str(reserve_s)))])
        want = decode.post(COMPLETIONS, BODY)
        assert want.status_code == 200, want.text
        body = push_first(prefill, decode, BODY)
        answers: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answers.append(
            decode.post(COMPLETIONS, body, timeout=reserve_s + 30)), daemon=True)
        waiting.start()
        time.sleep(2 * PROBE_EVERY_S)  # it waits for a "done" that never comes
        assert not answers and decode.health()["reservations"] == 1
        prefill.kill()
        killed = time.monotonic()
        waiting.join(timeout=reserve_s)
        assert answers, "no answer"
        answered = time.monotonic() - killed
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["choices"] == want.json()["choices"]
        assert answered < 3 * PROBE_EVERY_S + 5, f"answered {answered:.1f} s after the kill"
        decode.wait_for("the gone writer's blocks freed", idle,
                        timeout=PUSH_GRACE_S + 3 * PROBE_EVERY_S + 10)
        assert time.monotonic() - killed >= PUSH_GRACE_S - 1, "freed before the grace"
        assert "no longer runs" in decode.log_tail(200), decode.log_tail(20)


# -- the prefill's link cut while it pushes ------------------------------------------------

CUT_RESERVE_S = 8.0  # the reservation outlives the slowed push; the cut ends it
CUT_PROMPT = ("The prefill host drops off the network while it pushes. " * 40)[:1800]
SLOW_RATE = "10mbit"  # kvxfer-tiny: 2 KiB of KV per token, ~3.6 MB: ~3 s slowed
CUT_ANSWER_S = CUT_RESERVE_S + PUSH_GRACE_S + 10.0  # the recomputed answer, after the cut
QUARANTINE_END_S = 90.0  # TCP retransmits within this once the link is back


@pytest.fixture
def hosts(tmp_path: Path, plain: Sidecar) -> Iterator[tuple[Network, Sidecar, Sidecar, Sidecar]]:
    """A prefill and a push-mode decode on two "hosts" (UCX over TCP between them, as in
    test_netns), and a single instance in the test's namespace to compare with (the run's
    shared one, see ``shared_servers.py``)."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    with Network(("prefill", "decode")) as network, \
            SidecarGroup(tmp_path, env=UCX_ENV) as group:
        def on(role: str) -> tuple[str, ...]:
            return ("--host", "0.0.0.0", "--side-channel-host", network.address(role))
        prefill, decode = group.start([
            NsSpec("prefill", netns=network.ns("prefill"),
                   extra=(*on("prefill"), "--no-host-reads")),
            NsSpec("decode", netns=network.ns("decode"), policy="recompute", extra=(
                *on("decode"), "--kv-transfer-mode", "push", "--lease-ttl",
                str(CUT_RESERVE_S))),
        ])
        at(prefill, network.address("prefill"))
        at(decode, network.address("decode"))
        try:
            yield network, plain, prefill, decode
        finally:  # the sidecars stop with their links up
            network.link("prefill", up=True)
            network.slow("prefill", None)


def push_first(prefill: Sidecar, decode: Sidecar, body: dict[str, Any]) -> dict[str, Any]:
    """Reserve at the decode and prefill into the reservation, as the proxy does; the
    decode request's body (with the prefill's kv_transfer_params)."""
    reserved = decode.post("/v1/kv/reserve", {"endpoint": COMPLETIONS, "body": body})
    assert reserved.status_code == 200, reserved.text
    first = prefill.post(COMPLETIONS, {**prefill_body(body), "kv_transfer_params": {
        "do_remote_decode": True, "kv_reservation": reserved.json()["kv_reservation"]}})
    assert first.status_code == 200, first.text
    return {**body, "kv_transfer_params": first.json()["kv_transfer_params"]}


def same_answer(got: httpx.Response, want: httpx.Response) -> None:
    assert got.status_code == 200, got.text
    answer, expected = got.json()["choices"][0], want.json()["choices"][0]
    assert answer["text"] == expected["text"]
    assert answer["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
    for a, b in zip(answer["logprobs"]["token_logprobs"],
                    expected["logprobs"]["token_logprobs"], strict=True):
        assert abs(a - b) <= 1e-4


def test_a_link_cut_while_a_prefill_pushes_recomputes_and_strands_nothing(
        hosts: tuple[Network, Sidecar, Sidecar, Sidecar]) -> None:
    """UCX over TCP notices nothing of the cut; the prefill gives its push up at the
    reservation's deadline, the decode recomputes the prompt once the grace after it
    passed, and the client gets the one-instance answer. The prefill frees its blocks;
    the decode keeps the reservation's out of use while the link is down (the bytes of
    the WRITE the prefill's kernel still holds land once it is back). Once it is back,
    the WRITE ends, the prefill says so, and the decode frees them
    (``test_link_return.py`` checks that no other request is served wrong meanwhile)."""
    network, reference, prefill, decode = hosts
    body = {**BODY, "logprobs": 1}
    warm = decode.post(COMPLETIONS, push_first(prefill, decode, body))  # connects the pair
    same_answer(warm, reference.post(COMPLETIONS, body))
    cut_body = {**body, "prompt": CUT_PROMPT}
    want = reference.post(COMPLETIONS, cut_body)
    network.slow("prefill", SLOW_RATE)
    before = network.sent_bytes("prefill")
    began = time.monotonic()
    decode_body = push_first(prefill, decode, cut_body)
    answers: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answers.append(
        decode.post(COMPLETIONS, decode_body, timeout=CUT_ANSWER_S + 30)), daemon=True)
    client.start()
    while (sent := network.sent_bytes("prefill") - before) < 256 * 1024:
        assert time.monotonic() - began < 20, f"only {sent} bytes left the prefill"
        time.sleep(0.02)
    inside = health_inside(network, "prefill", prefill)
    assert inside["leases"] == 1, f"the push is not under way any more: {inside}"
    network.link("prefill", up=False)
    cut_at = time.monotonic()
    client.join(CUT_ANSWER_S + 30)
    assert answers, f"no answer {time.monotonic() - cut_at:.0f} s after the cut"
    print(f"link cut: the decode answered {time.monotonic() - cut_at:.1f} s after the cut")
    same_answer(answers[0], want)
    assert decode.metric("kvxfer_kv_recomputes_total") == 1
    deadline = time.monotonic() + CUT_RESERVE_S + 10
    while (inside := health_inside(network, "prefill", prefill))["leases"] or \
            inside["used_blocks"]:
        assert time.monotonic() < deadline, f"the cut-off prefill still holds: {inside}"
        time.sleep(0.2)
    assert "expired before the push finished" in prefill.log_tail(400), prefill.log_tail(20)
    held = decode.health()
    assert held["quarantined_blocks"] > 0 and held["reservations"] == 1, held
    network.link("prefill", up=True)
    decode.wait_for("the WRITE ended and the decode told: every block free", idle,
                    timeout=QUARANTINE_END_S)
    assert "no longer runs" not in decode.log_tail(2000), "freed as gone, not by the word"
