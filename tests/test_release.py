"""A decode that will not read a prefill's lease releases it over the side channel.

Real sidecar processes (HTTP, NIXL, ZMQ) on 127.0.0.1; the prefill keeps the
default 120 s lease TTL, so blocks that come back within seconds prove the
release path, not the expiry. The prefill runs TP 2: a release must end the
lease on every rank. Cases:

* a decode request refused by validation (bad ``max_tokens``, or a body that
  does not even decode) releases the lease it names: ``reason="abandoned"``;
* a decode of another model (``--seed 1``) whose handshake is refused releases
  the lease, for a fresh handshake and for the cached failure alike, and counts
  the refused handshake (``kvxfer_kv_handshake_failures_total{reason="mismatch"}``);
* a normal disaggregated read ends its lease with ``reason="done"`` only, and a
  release of the ended lease changes nothing;
* a release naming a lease the prefill does not hold changes nothing.

The pull decode's own paths (refused at admission, aborted while waiting for
blocks, a refused handshake, shut down while waiting) run in this process
against a real engine, real NIXL workers and a real listener that records
what it is told.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from sidecars import Sidecar, SidecarGroup, Spec, disaggregated, prefill_body

from kvxfer.engine import SamplingParams
from kvxfer.sidecar.request_kinds import PullIn, Sample, Submission
from kvxfer.sidecar.roles.composition import Roles
from kvxfer.sidecar.roles.role import AbortOutcome
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.messages import DoneReport
from kvxfer.wire.params import RemoteParams
from kvxfer.wire.protocol_errors import SideChannelError
from proxy.contract import decode_request, parse_prefill_answer

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BODY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
RELEASED = "kvxfer_kv_leases_released_total"
HANDSHAKE_FAILURES = "kvxfer_kv_handshake_failures_total"
RELEASE_WITHIN_S = 10.0  # far below the 120 s TTL: only a release frees this fast
HOST = "127.0.0.1"


# -- real sidecars ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sidecar]]:
    """A TP-2 prefill (default lease TTL), a decode, and a decode of another model."""
    with SidecarGroup(tmp_path_factory.mktemp("release")) as group:
        prefill, decode, other = group.start([
            Spec("prefill", tp=2), Spec("decode", policy="fail"),
            Spec("decode", policy="recompute", extra=("--seed", "1"))])
        yield {"prefill": prefill, "decode": decode, "other": other}


def all_blocks_free(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0
                and health["free_blocks"] == health["num_blocks"])


def back_to(start: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    """/health shows the leases and used blocks of ``start`` again (so that one failing
    test's leftover lease, held for the 120 s TTL, does not fail the next ones)."""
    return lambda h: (h["leases"], h["used_blocks"]) == (start["leases"], start["used_blocks"])


def lease_counts(prefill: Sidecar) -> dict[str, float]:
    return {reason: prefill.metric(RELEASED, reason=reason)
            for reason in ("done", "abandoned", "expired")}


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {reason: after[reason] - before[reason] for reason in before}


def lease(prefill: Sidecar, path: str, body: dict[str, Any],
          start: dict[str, Any]) -> dict[str, Any]:
    """Prefill ``body`` the way the proxy does; the params of the lease it holds now,
    on top of what it held at ``start``."""
    answer = prefill.post(path, prefill_body(body))
    assert answer.status_code == 200, answer.text
    params = parse_prefill_answer(answer.content, prefill.url)
    held = start["used_blocks"] + len(params["remote_block_ids"])
    prefill.wait_for("the lease held", lambda h: (h["leases"], h["used_blocks"]) == (
        start["leases"] + 1, held))
    return params


REFUSED_BODIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "negative-max-tokens": (COMPLETIONS, {"max_tokens": -3}, "max_tokens must be at least 1, "
                                                             "got -3"),
    "max-tokens-not-a-number": (COMPLETIONS, {"max_tokens": "many"}, "max_tokens"),
    "chat-too-long": (CHAT, {"max_completion_tokens": 100_000}, "100000"),
}


@pytest.mark.parametrize("case", list(REFUSED_BODIES))
def test_a_refused_decode_request_releases_the_lease(rig: dict[str, Sidecar], case: str) -> None:
    prefill, decode = rig["prefill"], rig["decode"]
    path, change, named = REFUSED_BODIES[case]
    prompt = {"prompt": f"refused {case}"} if path == COMPLETIONS \
        else {"messages": [{"role": "user", "content": f"refused {case}"}]}
    body = {**BODY, **prompt}
    start, before = prefill.health(), lease_counts(prefill)
    params = lease(prefill, path, body, start)
    refused = decode.post(path, decode_request({**body, **change}, params))
    assert refused.status_code == 400, refused.text
    assert named in refused.json()["error"]["message"]
    prefill.wait_for("the refused request's lease released", back_to(start),
                     timeout=RELEASE_WITHIN_S)
    assert grew(before, lease_counts(prefill)) == {"done": 0, "abandoned": 1, "expired": 0}
    decode.wait_for("every block free", all_blocks_free)


def test_a_decode_of_another_model_releases_the_lease(rig: dict[str, Sidecar]) -> None:
    """The first request's handshake is refused (hash mismatch); the second fails fast
    on the cached failure. Neither ever connects NIXL, yet both leases end at once."""
    prefill, other = rig["prefill"], rig["other"]
    recomputes = other.metric("kvxfer_kv_recomputes_total")
    mismatches = other.metric(HANDSHAKE_FAILURES, reason="mismatch")
    for i in range(2):
        start, before = prefill.health(), lease_counts(prefill)
        body = {**BODY, "prompt": f"another model reads this, attempt {i}"}
        params = lease(prefill, COMPLETIONS, body, start)
        answer = other.post(COMPLETIONS, decode_request(body, params))
        assert answer.status_code == 200, answer.text  # policy recompute
        prefill.wait_for(f"attempt {i}: the lease released", back_to(start),
                         timeout=RELEASE_WITHIN_S)
        assert grew(before, lease_counts(prefill)) == {"done": 0, "abandoned": 1,
                                                       "expired": 0}, f"attempt {i}"
    assert other.metric("kvxfer_kv_recomputes_total") == recomputes + 2
    # one refused handshake, and one more only if the cached failure was 5 s old already
    assert other.metric(HANDSHAKE_FAILURES, reason="mismatch") - mismatches in (1, 2)
    other.wait_for("every block free", all_blocks_free)


def test_a_normal_read_ends_its_lease_as_done_only(rig: dict[str, Sidecar]) -> None:
    prefill, decode = rig["prefill"], rig["decode"]
    start, before = prefill.health(), lease_counts(prefill)
    first, second = disaggregated(prefill, decode, COMPLETIONS,
                                  {**BODY, "prompt": "an ordinary request"})
    assert second.status_code == 200, second.text
    prefill.wait_for("the lease released", back_to(start), timeout=RELEASE_WITHIN_S)
    assert grew(before, lease_counts(prefill)) == {"done": 1, "abandoned": 0, "expired": 0}
    # Releasing the ended lease afterwards is answered "not held" and changes nothing.
    params = first.json()["kv_transfer_params"]
    with SideChannelClient("decode-late", compat_of_another_model()) as client:
        assert client.release(params["remote_host"], params["remote_port"],
                              params["remote_request_id"], "late") is False
    settle(prefill)
    assert grew(before, lease_counts(prefill)) == {"done": 1, "abandoned": 0, "expired": 0}


def compat_of_another_model() -> CompatInfo:
    """Any CompatInfo: releases are not checked against the prefill's model."""
    return CompatInfo(model="someone-else", dtype="bfloat16", cache_dtype="bfloat16",
                      head_size=64, total_kv_heads=8, num_layers=2)


def settle(prefill: Sidecar) -> None:
    """Make sure the prefill's engine loop acted on the releases it acknowledged.

    The listener queues a release before it answers, and the loop takes queued
    releases at the start of every iteration; a plain request is answered only
    after several iterations, so once it is, a release wrongly honoured shows."""
    answer = prefill.post(COMPLETIONS, {"prompt": "barrier", "max_tokens": 1})
    assert answer.status_code == 200, answer.text


def test_a_release_of_a_lease_not_held_changes_nothing(rig: dict[str, Sidecar]) -> None:
    prefill, decode = rig["prefill"], rig["decode"]
    start, before = prefill.health(), lease_counts(prefill)
    body = {**BODY, "prompt": "nobody else's lease"}
    params = lease(prefill, COMPLETIONS, body, start)
    held = prefill.health()
    lease_id = params["remote_request_id"]
    strangers = ["no-such-lease", lease_id[:-1], f"{lease_id}@1", f"x{lease_id}",
                 lease_id.upper() if lease_id.upper() != lease_id else f"{lease_id}x"]
    with SideChannelClient("decode-stranger", compat_of_another_model()) as client:
        for stranger in strangers:
            assert client.release(HOST, params["remote_port"], stranger, "wrong id") is False, \
                stranger
    settle(prefill)
    # (waited for, not read once: the barrier's own blocks may still show for a moment)
    prefill.wait_for("the lease still held, its blocks untouched", back_to(held))
    answer = decode.post(COMPLETIONS, decode_request(body, params))
    assert answer.status_code == 200, answer.text  # its blocks were intact and still leased
    prefill.wait_for("the lease released", back_to(start), timeout=RELEASE_WITHIN_S)
    assert grew(before, lease_counts(prefill)) == {"done": 1, "abandoned": 0, "expired": 0}


def test_a_kept_connection_serves_every_later_call(rig: dict[str, Sidecar]) -> None:
    """A sender's client keeps the connection of an answered call for the next calls to
    that side channel, and never keeps one that went unanswered (a late reply could be
    taken for the next call's)."""
    port = rig["prefill"].health()["side_channel_port"]
    with SideChannelClient("decode-kept", compat_of_another_model(),
                         keep_connections=True) as client, socket.socket() as mute:
        for attempt in range(3):
            assert client.release(HOST, port, f"no-such-lease-{attempt}", "kept") is False
            assert client.connections == 1
        mute.bind((HOST, 0))
        mute.listen()  # accepts TCP, never speaks ZMTP: no answer
        with pytest.raises(SideChannelError, match="no answer"):
            client.release(HOST, mute.getsockname()[1], "lease", "mute", timeout=0.3)
        assert client.connections == 1
        assert client.release(HOST, port, "no-such-lease", "kept") is False
    with SideChannelClient("decode-fresh", compat_of_another_model()) as plain:
        assert plain.release(HOST, port, "no-such-lease", "fresh") is False
        assert plain.connections == 0


def test_the_release_shows_in_the_prefill_metrics_help(rig: dict[str, Sidecar]) -> None:
    text = rig["prefill"].get("/metrics").text
    assert f'{RELEASED}{{reason="abandoned"}}' in text
    assert "abandoned: the decode released it unread" in text


def test_in_the_end_no_block_is_held_anywhere(rig: dict[str, Sidecar]) -> None:
    for sidecar in rig.values():
        sidecar.wait_for("every block free", all_blocks_free, timeout=RELEASE_WITHIN_S)


# -- the pull decode's own paths, in this process -------------------------------------------

class Recorder:
    """A real side-channel listener of another model (so every handshake is refused
    with a hash mismatch, before any NIXL connection) that records the releases it
    receives, and the "done" reports."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.reports: list[DoneReport] = []
        self.listener = SideChannelListener(
            HOST, engine_id="prefill-recorder", compat=compat_of_another_model(),
            metadata=lambda: [], on_release=self._on_release,
            on_renew=lambda _lease, _requester, _claim: 60.0,  # claims granted
            on_done=lambda report, _requester: self.reports.append(report) is None).start()

    def _on_release(self, lease_id: str, requester: str, reason: str, _outcome: str) -> bool:
        self.calls.append((lease_id, requester, reason))
        return True

    def params(self, lease_id: str, num_tokens: int) -> RemoteParams:
        return RemoteParams("prefill-recorder", HOST, self.listener.port,
                            tuple(range(-(-num_tokens // 16))), lease_id, 1, num_tokens,
                            time.time() + 60)

    def wait_for(self, count: int) -> list[tuple[str, str, str]]:
        for _ in range(500):
            if len(self.calls) >= count:
                return self.calls
            time.sleep(0.01)
        raise AssertionError(f"{count} releases expected within 5 s, got {self.calls}")


PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def prompt(tokens: int) -> list[int]:
    return [(7 * i) % 200 + 1 for i in range(tokens)]


def pulled(request_id: str, tokens: list[int], params: SamplingParams, remote: RemoteParams,
           samples: Sequence[tuple[str, SamplingParams]] = ()) -> Submission:
    """A decode request that reads its KV from ``remote``'s lease (kind ``PullIn``), as the
    HTTP layer submits it; ``samples``: (id, params) of its further samples, choices 1..."""
    kind = PullIn(remote, tuple(Sample(sample_id, index, sample_params) for index,
                                (sample_id, sample_params) in enumerate(samples, start=1)))
    return Submission(request_id, 0, tokens, params, kind)


def poll_until(connector: Roles, done: Callable[[], bool]) -> None:
    for _ in range(1000):
        connector.poll()
        if done():
            return
        time.sleep(0.005)
    raise AssertionError("the roles did not get there within 5 s")


def test_the_decode_releases_a_request_refused_at_admission(connector: Roles,
                                                            recorder: Recorder) -> None:
    """100 prompt tokens + 100 new ones do not fit 128 tokens of cache."""
    with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        connector.admit(pulled("too-long", prompt(100), SamplingParams(max_tokens=100),
                               recorder.params("lease-too-long@1", 100)))
    [(lease_id, requester, reason)] = recorder.wait_for(1)
    assert (lease_id, requester) == ("lease-too-long@1", connector.ranks.engine_id)
    assert reason.startswith("the decode refused the request: ") and "exceeds" in reason


def test_the_decode_releases_after_a_refused_handshake(connector: Roles,
                                                       recorder: Recorder) -> None:
    sub = pulled("refused", prompt(20), PARAMS, recorder.params("lease-refused@1", 20))
    connector.admit(sub)
    poll_until(connector, lambda: connector.transfer_error("refused", sub.kind) is not None)
    [(lease_id, _, reason)] = recorder.wait_for(1)
    assert lease_id == "lease-refused@1"
    assert reason.startswith("the decode's KV read failed: prefill prefill-recorder")
    assert "is not compatible" in reason


def test_the_decode_releases_a_request_aborted_while_waiting_for_blocks(
        connector: Roles, recorder: Recorder) -> None:
    engine = connector.engine
    engine.add_awaiting_kv("filler", prompt(100), PARAMS)  # 7 of 8 blocks
    connector.admit(pulled("waiting", prompt(40), PARAMS, recorder.params("lease-waiting@1", 40)))
    poll_until(connector, lambda: not connector.busy)  # claimed
    assert connector.waiting and not connector.busy, "it waits for blocks, nothing is read"
    assert connector.abort("waiting") is AbortOutcome.DROPPED
    [(lease_id, _, reason)] = recorder.wait_for(1)
    assert lease_id == "lease-waiting@1"
    assert reason == "the request was aborted before its KV read started"
    engine.abort("filler")


def test_the_decode_releases_what_still_waits_when_it_closes(connector: Roles,
                                                             recorder: Recorder) -> None:
    connector.engine.add_awaiting_kv("filler", prompt(100), PARAMS)
    connector.admit(pulled("left", prompt(40), PARAMS, recorder.params("lease-left@1", 40)))
    reports = connector.ranks.reports  # the instance's sender of releases
    connector.close()
    senders = list(reports._senders.values())
    assert senders and not any(sender._thread.is_alive() for sender in senders), \
        "close() stops the sender threads"
    [(lease_id, _, reason)] = recorder.calls  # sent before close() returned
    assert lease_id == "lease-left@1" and "shut down" in reason


def test_a_dead_prefill_does_not_hold_up_the_decode(
        connector: Roles, caplog: pytest.LogCaptureFixture) -> None:
    """A release to a side channel nobody listens on fails in the background, logged
    with the lease and the address; the decode carries on."""
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    dead = RemoteParams("prefill-gone", HOST, port, (0, 1), "lease-gone@1", 1, 20,
                        time.time() + 60)
    reports = connector.ranks.reports  # the instance's sender of releases

    def outcomes() -> tuple[int, int]:
        senders = list(reports._senders.values())
        return sum(s.failed for s in senders), sum(s.sent for s in senders)

    with caplog.at_level(logging.WARNING, logger="kvxfer.transfer.side_channel.sender"):
        with pytest.raises(ValueError, match="exceeds"):
            connector.admit(pulled("gone", prompt(100), SamplingParams(max_tokens=100), dead))
        for _ in range(500):
            if outcomes()[0]:
                break
            time.sleep(0.01)
    assert outcomes() == (1, 0)
    assert any(f"could not release lease lease-gone@1: cannot connect to tcp://{HOST}:{port}"
               in r.getMessage() for r in caplog.records), [r.getMessage()
                                                            for r in caplog.records]

