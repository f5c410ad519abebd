"""The pull decode's ``n > 1`` groups: admitted whole, one READ, never a block left.

In this process against a real engine, real NIXL workers and a real side-channel
listener of another model (from ``test_release``), so every READ fails at its
handshake, off the loop thread, while the test acts on the group: what waits for
blocks, what is aborted while its READ is in flight, and how a failed READ ends
every member.
"""

from __future__ import annotations

import time

from test_release import Recorder, pulled

from kvxfer.engine import RequestOutput, SamplingParams
from kvxfer.sidecar.request_kinds import Submission
from kvxfer.sidecar.roles.composition import Roles
from kvxfer.sidecar.roles.role import AbortOutcome

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = [(7 * i) % 200 + 1 for i in range(20)]  # 2 blocks of 16
SIBLINGS = [("s1", PARAMS), ("s2", PARAMS)]


def settle(connector: Roles) -> list[RequestOutput]:
    """Poll until no READ is in flight, then step the engine until idle: every output."""
    for _ in range(1000):
        connector.poll()
        if not connector.busy:
            break
        time.sleep(0.005)
    else:
        raise AssertionError("a READ still in flight after 5 s")
    outputs: list[RequestOutput] = []
    while connector.engine.has_work():
        outputs += connector.engine.step()
    return outputs


def granted(connector: Roles) -> None:
    """Poll until the prefill granted the claims (then the group is admitted if it fits)."""
    for _ in range(1000):
        connector.poll()
        if not connector.claiming:
            return
        time.sleep(0.005)
    raise AssertionError("a claim still unanswered after 5 s")


def ended(outputs: list[RequestOutput]) -> dict[str, str | None]:
    return {o.request_id: o.finish_reason for o in outputs if o.finished}


def group(recorder: Recorder) -> Submission:
    """Request s0 and its further samples s1 and s2, reading lease-s0@1 once."""
    return pulled("s0", PROMPT, PARAMS, recorder.params("lease-s0@1", 20), SIBLINGS)


def test_a_failed_read_fails_every_member_and_frees_all_blocks(
        connector: Roles, recorder: Recorder) -> None:
    sub = group(recorder)
    connector.admit(sub)
    granted(connector)
    assert connector.engine.num_used_blocks == 6, "every member parked with its own blocks"
    assert ended(settle(connector)) == {"s0": "error", "s1": "error", "s2": "error"}
    for member in ("s0", "s1", "s2"):
        message = connector.transfer_error(member, sub.kind)
        assert message is not None and "is not compatible" in message
    assert connector.engine.num_used_blocks == 0
    assert [lease for lease, _, _ in recorder.wait_for(1)] == ["lease-s0@1"], "one release"


def test_aborting_the_first_member_while_reading_aborts_the_group(
        connector: Roles, recorder: Recorder) -> None:
    connector.admit(group(recorder))
    granted(connector)
    assert connector.busy, "the READ is in flight"
    assert connector.abort("s0") is AbortOutcome.DEFERRED
    assert ended(settle(connector)) == {"s0": "abort", "s1": "abort", "s2": "abort"}
    assert connector.engine.num_used_blocks == 0


def test_an_aborted_sibling_is_the_engines_to_end_while_the_read_goes_on(
        connector: Roles, recorder: Recorder) -> None:
    sub = group(recorder)
    connector.admit(sub)
    granted(connector)
    assert connector.abort("s1") is AbortOutcome.NOT_MINE
    assert connector.engine.abort("s1") is True  # what the engine loop does next
    assert ended(settle(connector)) == {"s1": "abort", "s0": "error", "s2": "error"}
    assert connector.transfer_error("s1", sub.kind) is None, "no longer part of the read"
    assert connector.engine.num_used_blocks == 0


def test_a_group_waits_for_blocks_for_all_of_it(connector: Roles,
                                                recorder: Recorder) -> None:
    engine = connector.engine
    engine.add_awaiting_kv("filler", PROMPT * 3, PARAMS)  # 4 of 8 blocks
    connector.admit(group(recorder))
    granted(connector)
    assert connector.waiting and not connector.busy, "6 blocks needed, 4 free: it waits"
    assert engine.num_used_blocks == 4, "no member parked alone"
    assert connector.abort("s2") is AbortOutcome.DROPPED  # only that one leaves the group
    connector.poll()  # 4 blocks for the remaining two: admitted, its READ starts
    assert connector.busy and engine.num_used_blocks == 8
    assert ended(settle(connector)) == {"s0": "error", "s1": "error"}
    engine.abort("filler")
    settle(connector)
    assert engine.num_used_blocks == 0


def test_dropping_a_waiting_group_releases_its_lease_once(connector: Roles,
                                                          recorder: Recorder) -> None:
    engine = connector.engine
    engine.add_awaiting_kv("filler", PROMPT * 3, PARAMS)
    connector.admit(group(recorder))
    granted(connector)
    assert connector.abort("s0") is AbortOutcome.DROPPED
    assert not connector.waiting
    assert [lease for lease, _, _ in recorder.wait_for(1)] == ["lease-s0@1"]
    engine.abort("filler")
    settle(connector)
    assert engine.num_used_blocks == 0 and not engine._requests
