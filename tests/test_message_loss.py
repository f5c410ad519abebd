"""Lost "done" messages are repaired long before a lease's TTL (``KVXFER_DROP_MESSAGES``).

A real TP 2 prefill with the default 120 s lease TTL loses every NIXL "done" notification
and half of the side-channel "done" reports it receives; a real decode reads from it.
Every lease must still end "done", within seconds, through the decode's resent reports:
nothing expires, nothing stays held. ``MessageLoss`` itself is checked as a unit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sidecars import Sidecar, SidecarGroup, Spec, disaggregated

from kvxfer.transfer.faults import ENV, MessageLoss

RELEASED = "kvxfer_kv_leases_released_total"
FAILED = "kvxfer_kv_notifications_failed_total"
FREED_WITHIN_S = 10.0  # a lease whose every notification was lost: far below the 120 s TTL
REQUESTS = 6


def test_a_share_is_parsed_checked_and_drawn() -> None:
    assert MessageLoss.parse("").shares == {}
    loss = MessageLoss.parse("notification=1, done=0", seed=3)
    assert loss.shares == {"notification": 1.0, "done": 0.0}
    assert all(loss.drop("notification") for _ in range(50))
    assert not any(loss.drop(kind) for kind in ("done", "release", "renew") for _ in range(50))
    half = MessageLoss.parse("renew=0.5", seed=7)
    drawn = sum(half.drop("renew") for _ in range(2000))
    assert 850 < drawn < 1150


@pytest.mark.parametrize(("text", "why"), [
    ("notification", "expected kind=share"),
    ("done=lots", "expected kind=share"),
    ("done=1.5", "within 0..1, got 1.5"),
    ("done=-0.1", "within 0..1"),
    ("metadata_request=0.5", "unknown message kind 'metadata_request'"),
])
def test_a_bad_setting_names_what_is_allowed(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        MessageLoss.parse(text)
    assert ENV in str(caught.value)


@pytest.fixture(scope="module")
def lossy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sidecar, Sidecar]]:
    """A TP 2 prefill (default TTL) losing every notification and half the reports; a
    decode (which receives no "done" messages, so the setting changes nothing there)."""
    env = {ENV: "notification=1,done=0.5", "KVXFER_DROP_SEED": "11"}
    with SidecarGroup(tmp_path_factory.mktemp("loss"), env=env) as group:
        prefill, decode = group.start([Spec("prefill", tp=2), Spec("decode", policy="fail")])
        yield prefill, decode


def test_every_lease_ends_done_within_seconds_though_its_notifications_were_lost(
        lossy: tuple[Sidecar, Sidecar]) -> None:
    prefill, decode = lossy
    dropped_before = prefill.metric(FAILED, reason="dropped")
    done_before = prefill.metric(RELEASED, reason="done")
    for i in range(REQUESTS):
        body = {"prompt": f"Lost notifications, round {i}: " + "tokens " * (20 + 9 * i),
                "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        _, answer = disaggregated(prefill, decode, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        ended = time.monotonic()
        prefill.wait_for("the lease ended", lambda h: h["leases"] == 0 and
                         h["used_blocks"] == 0, timeout=FREED_WITHIN_S)
        assert time.monotonic() - ended < FREED_WITHIN_S
    # every reader's notification was lost (one per prefill rank read), yet every lease
    # ended "done", none by expiry
    assert prefill.metric(FAILED, reason="dropped") - dropped_before >= REQUESTS * 2
    assert prefill.metric(RELEASED, reason="done") - done_before == REQUESTS
    assert prefill.metric(RELEASED, reason="expired") == 0
