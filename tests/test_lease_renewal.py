"""Claims and renewals, in this process.

The pull decode claims a lease before anything else and renews it while the
request waits for blocks: a granted renewal keeps the lease readable past its first
expiry; a refused one means the lease is never read (the request fails by policy, no
handshake, no release); a refused claim is a 400 for the request,
nothing read, nothing released (an unanswered one fails the request by policy, as a
failed read). There the prefill is a real side-channel listener
(another model: a handshake would be refused) whose ``on_renew`` the test controls.

The prefill side (real workers and listener, no key) grants a lease's claim to
one decode engine, renews it only for that one, never past the maximum lease age,
and ignores a release from another engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_release import compat_of_another_model, prompt, pulled

from kvxfer.engine import RequestOutput, SamplingParams
from kvxfer.sidecar.request_kinds import LeaseOut, PullIn
from kvxfer.sidecar.roles.composition import Roles
from kvxfer.transfer.results import PollResult, ReadStats
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.wire.messages import RenewRefused
from kvxfer.wire.params import RemoteParams

HOST = "127.0.0.1"
TTL = 0.4
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = [(7 * i) % 200 + 1 for i in range(20)]  # 2 blocks of 16


class Prefill:
    """A listener that grants (``ttl``) or refuses (None) renewals and records every call."""

    def __init__(self) -> None:
        self.ttl: float | None = TTL
        self.claim_ttl: float | str = TTL
        self.renewals: list[str] = []
        self.claims: list[str] = []
        self.releases: list[str] = []
        self.handshakes = 0
        self.listener = SideChannelListener(
            HOST, engine_id="prefill-renew", compat=compat_of_another_model(),
            metadata=self._metadata, on_release=self._on_release,
            on_renew=self._on_renew).start()

    def _metadata(self) -> list[object]:
        self.handshakes += 1
        return []

    def _on_renew(self, lease_id: str, _requester: str, claim: bool) -> float:
        (self.claims if claim else self.renewals).append(lease_id)
        answer = self.claim_ttl if claim else self.ttl
        if answer is None or isinstance(answer, str):  # refused: why, or "not held"
            raise RenewRefused(answer or "the prefill does not hold it")
        return answer

    def _on_release(self, lease_id: str, _requester: str, _reason: str, _outcome: str) -> bool:
        self.releases.append(lease_id)
        return True

    def params(self, lease_id: str) -> RemoteParams:
        return RemoteParams("prefill-renew", HOST, self.listener.port, (0, 1), lease_id, 1,
                            len(PROMPT), time.time() + TTL)


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    made = Prefill()
    yield made
    made.listener.close()


@pytest.fixture
def connector(connector: Roles) -> Roles:
    """The shared decode (8 blocks), 7 of whose blocks a filler holds."""
    connector.engine.add_awaiting_kv("filler", [1] * 100, PARAMS)
    return connector


def wait_for_blocks(connector: Roles, seconds: float) -> None:
    """Poll for ``seconds`` while the request waits for blocks, then free them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        connector.poll()
        assert connector.waiting and connector.engine.num_free_blocks == 1, \
            "it still waits for blocks"
        time.sleep(0.01)
    connector.engine.abort("filler")


def pull(connector: Roles, remote: RemoteParams) -> PullIn:
    """Submit decode request "r" reading ``remote``'s lease; its kind."""
    sub = pulled("r", PROMPT, PARAMS, remote)
    connector.admit(sub)
    assert isinstance(sub.kind, PullIn)
    return sub.kind


def error_after_admission(connector: Roles, kind: PullIn) -> str:
    for _ in range(1000):
        connector.poll()
        error = connector.transfer_error("r", kind)
        if error is not None:
            return error
        time.sleep(0.005)
    raise AssertionError("the request did not end within 5 s")


def rejection(connector: Roles) -> str:
    for _ in range(1000):
        events = connector.poll()
        if "r" in events.rejected:
            assert not connector.waiting and not connector.busy
            return events.rejected["r"]
        time.sleep(0.005)
    raise AssertionError("the request was not refused within 5 s")


def test_a_granted_renewal_keeps_the_lease_readable(connector: Roles,
                                                    prefill: Prefill) -> None:
    kind = pull(connector, prefill.params("lease-kept"))
    wait_for_blocks(connector, 3 * TTL)
    assert prefill.claims == ["lease-kept"], "claimed once, first"
    assert len(prefill.renewals) >= 3 and set(prefill.renewals) == {"lease-kept"}
    error = error_after_admission(connector, kind)
    # it went on to read: the handshake ran (and was refused: another model)
    assert "not compatible" in error and "was not read" not in error, error
    assert prefill.handshakes == 0, "refused before metadata was asked for"


def test_a_refused_renewal_means_the_lease_is_never_read(connector: Roles,
                                                         prefill: Prefill) -> None:
    prefill.ttl = None  # claimed, then the prefill no longer holds it
    kind = pull(connector, prefill.params("lease-lost"))
    wait_for_blocks(connector, 2 * TTL)
    assert prefill.claims == ["lease-lost"]
    assert prefill.renewals[:1] == ["lease-lost"]
    error = error_after_admission(connector, kind)
    assert "was not read" in error and "no longer holds it" in error, error
    assert prefill.releases == [], "an ended lease is not released"


def test_an_unanswered_claim_means_the_lease_is_never_read(connector: Roles,
                                                            prefill: Prefill) -> None:
    prefill.listener.close()  # claims fail: nobody listens
    started = time.monotonic()
    kind = pull(connector, prefill.params("lease-gone"))
    connector.engine.abort("filler")  # blocks are free: only the claim holds it back
    error = error_after_admission(connector, kind)  # failed by policy, as a failed read
    assert time.monotonic() - started < 1.0, "a refused connection is reported at once"
    assert "was not read" in error and "did not answer this decode's claim" in error, error
    assert "cannot connect" in error, error
    assert connector.engine.num_free_blocks == connector.engine.num_blocks


def test_a_refused_claim_is_a_rejection_and_nothing_is_read(connector: Roles,
                                                            prefill: Prefill) -> None:
    prefill.claim_ttl = "another decode claimed it first: a lease is read by one decode"
    pull(connector, prefill.params("lease-taken"))
    connector.engine.abort("filler")
    error = rejection(connector)
    assert "refused this decode's claim" in error and "another decode" in error, error
    assert prefill.claims == ["lease-taken"] and prefill.renewals == []
    assert prefill.handshakes == 0 and prefill.releases == [], "nothing read or released"
    assert connector.engine.num_free_blocks == connector.engine.num_blocks


# -- the prefill's side ------------------------------------------------------------------------

@pytest.fixture
def prefill_side(make: Callable[..., Roles]) -> Roles:
    """A prefill leasing for TTL s, renewed at most until 3 TTL."""
    return make("prefill", lease_ttl=TTL, lease_max_age=3 * TTL)


def computed(prefill: Roles, request_id: str) -> RequestOutput:
    """A prefill request of ``len(PROMPT)`` tokens computed, its blocks held, not leased yet."""
    engine = prefill.engine
    engine.add_held_request(request_id, prompt(len(PROMPT)), SamplingParams(max_tokens=1))
    while engine.has_work():
        for output in engine.step():
            if output.finished:
                return output
    raise AssertionError("the prefill never finished")


def lease_out(prefill: Roles, output: RequestOutput) -> dict[str, Any]:
    """Lease a computed request's blocks, as the engine loop does once it finished."""
    params = prefill.finished(output, LeaseOut())
    assert params is not None
    return params


def test_the_prefill_grants_one_claim_and_renews_only_for_its_claimer(
        prefill_side: Roles) -> None:
    params = lease_out(prefill_side, computed(prefill_side, "r"))
    port, lease = params["remote_port"], params["remote_request_id"]
    compat = compat_of_another_model()
    with SideChannelClient("decode-a", compat) as a, SideChannelClient("decode-b", compat) as b:
        unclaimed = a.renew(HOST, port, lease)
        assert not unclaimed.found and "before it was claimed" in unclaimed.reason
        claimed = a.renew(HOST, port, lease, claim=True)
        # (now + ttl) - now may exceed ttl by a rounding step: allow that, nothing more
        assert claimed.found and 0 < claimed.expires_in <= TTL + 1e-9
        assert a.renew(HOST, port, lease, claim=True).found, "a retried claim"
        for second in (b.renew(HOST, port, lease, claim=True), b.renew(HOST, port, lease)):
            assert not second.found and "another decode claimed it" in second.reason
        assert not b.release(HOST, port, lease, "not mine"), "only the claimer releases"
        assert prefill_side.ranks.workers[0].holds_lease(lease)
        assert a.renew(HOST, port, lease).found


def test_no_renewal_past_the_maximum_lease_age(prefill_side: Roles) -> None:
    output = computed(prefill_side, "r")
    held_at = time.monotonic()
    params = lease_out(prefill_side, output)
    port, lease = params["remote_port"], params["remote_request_id"]
    with SideChannelClient("decode-a", compat_of_another_model()) as a:
        ack = a.renew(HOST, port, lease, claim=True)
        while ack.found:
            assert ack.expires_in <= held_at + 3 * TTL - time.monotonic() + 0.05
            assert time.monotonic() - held_at < 3 * TTL + 0.2, "renewed past its maximum age"
            time.sleep(0.02)
            ack = a.renew(HOST, port, lease)
    assert time.monotonic() - held_at > 3 * TTL - 0.1, "renewed until its maximum age"
    assert "maximum lease age" in ack.reason or "no longer holds it" in ack.reason, ack


def test_a_read_in_flight_is_renewed_and_not_used_once_its_lease_ended(
        connector: Roles, prefill: Prefill, monkeypatch: pytest.MonkeyPatch) -> None:
    """The READ (a stand-in that the test ends) runs for longer than the lease TTL: the
    decode renews the lease meanwhile; once renewals are refused and the lease ran out,
    the READ's result is not used, though the worker says it finished."""
    worker = connector.ranks.workers[0]
    results: list[PollResult] = []
    monkeypatch.setattr(worker, "start_read", lambda *_args, **_kwargs: None)
    monkeypatch.setattr(worker, "poll", lambda: results.pop() if results else PollResult())
    connector.engine.abort("filler")
    kind = pull(connector, prefill.params("lease-reading"))
    poll_for(connector, 3 * TTL)
    assert connector.busy, "the READ is still in flight"
    assert len(prefill.renewals) >= 3, "renewed while it reads"
    prefill.ttl = None  # the prefill ends it: no more renewals
    poll_for(connector, 2 * TTL)
    results.append(PollResult(finished=["r"], stats={"r": ReadStats(64, 1, 0.001)}))
    error = error_after_admission(connector, kind)
    assert "its KV is not used" in error and "lease ended" in error, error


def poll_for(connector: Roles, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        connector.poll()
        time.sleep(0.01)
