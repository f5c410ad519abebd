"""The transfer metrics a user of vLLM's NIXL connector expects, in this process.

A prefill's and a decode's :class:`~kvxfer.sidecar.roles.composition.Roles` on
kvxfer-tiny engines (real NIXL workers, a real side-channel listener, real
notifications); each test drives one path and reads the metric from the instance's
registry, as ``/metrics`` renders it:

* a read's size in bytes and in descriptors (histograms, next to its duration);
* failed handshakes, by reason (a listener of another model, one with a key, nothing
  listening, a socket that never answers);
* failed "done" notifications: one the decode could not send, ones the prefill could
  not verify or decode;
* late "done" notifications: for a lease that ended (read already, released,
  expired) or that the prefill never held.

Leases ended by their TTL are ``kvxfer_kv_leases_released_total{reason="expired"}``
(``test_server_failures.test_unread_lease_expires``, and the expired case here).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from sidecars import free_port
from test_release import Recorder, prompt, pulled

from kvxfer.engine import SamplingParams
from kvxfer.sidecar.request_kinds import LeaseOut
from kvxfer.sidecar.roles.composition import Roles, compat_info
from kvxfer.sidecar.roles.role import AbortOutcome
from kvxfer.sidecar.sidecar_metrics import HANDSHAKE_FAILURE_REASONS
from kvxfer.transfer.nixl_agent import NixlAgent
from kvxfer.transfer.side_channel.failures import FAILURE_REASONS
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.wire.notification import ReadDone, encode_notif
from kvxfer.wire.params import RemoteParams

HOST = "127.0.0.1"
PARAMS = SamplingParams(max_tokens=2, temperature=0.0)
TOKENS = 40  # 3 blocks of 16
KEY = b"k" * 32

Make = Callable[..., Roles]


def value(connector: Roles, name: str, **labels: str) -> float:
    """A sample of the instance's metrics; AssertionError when it is not exported."""
    got = connector.metrics.registry.get_sample_value(name, labels)
    assert got is not None, f"{name}{labels} is not exported"
    return got


def pump(*connectors: Roles, until: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``connectors`` as their engine loops would until ``until()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for connector in connectors:
            connector.poll()
        if until():
            return
        time.sleep(0.005)
    raise AssertionError(f"not reached within {timeout} s")


def held(prefill: Roles, request_id: str, tokens: int = TOKENS) -> dict[str, Any]:
    """Prefill a prompt as the engine loop does (a request of kind ``LeaseOut``) and lease
    its blocks: the answer's ``kv_transfer_params``."""
    engine = prefill.engine
    engine.add_held_request(request_id, prompt(tokens), SamplingParams(max_tokens=1))
    while engine.has_work():
        for output in engine.step():
            if output.finished:
                params = prefill.finished(output, LeaseOut())
                assert params is not None
                return params
    raise AssertionError("the prefill never finished")


def read_directly(decode: Roles, params: dict[str, Any], request_id: str) -> None:
    """READ ``params``' blocks with the decode's worker itself, bypassing the decode's
    lease checks (which would refuse an ended lease before any READ)."""
    count = len(params["remote_block_ids"])
    decode.ranks.workers[0].start_read(request_id, params, list(range(count)))


# -- sizes of a read ------------------------------------------------------------------------

def test_a_read_observes_its_bytes_and_descriptors(make: Make) -> None:
    prefill, decode = make("prefill"), make("decode", kv_load_failure_policy="fail")
    params = held(prefill, "p")
    decode.admit(pulled("d", prompt(TOKENS), PARAMS, RemoteParams.parse(params)))
    pump(prefill, decode, until=lambda: value(decode, "kvxfer_kv_transfers_total",
                                              outcome="ok") == 1)
    views = decode.engine.kv_caches[0].values()
    block_bytes = sum(v[0].numel() * v.element_size() for v in views)
    moved = len(params["remote_block_ids"]) * block_bytes
    assert value(decode, "kvxfer_kv_transfer_size_bytes_count") == 1
    assert value(decode, "kvxfer_kv_transfer_size_bytes_sum") == moved
    assert value(decode, "kvxfer_kv_transfer_bytes_total") == moved
    descriptors = value(decode, "kvxfer_kv_transfer_descriptors_total")
    assert descriptors >= 1
    assert value(decode, "kvxfer_kv_transfer_size_descriptors_count") == 1
    assert value(decode, "kvxfer_kv_transfer_size_descriptors_sum") == descriptors
    assert value(decode, "kvxfer_kv_transfer_duration_seconds_count") == 1


@pytest.mark.parametrize("path", ["mapped", "nixl"])
def test_a_read_exports_its_peers_path_rate_and_share_of_the_ceiling(
        make: Make, path: str) -> None:
    """A prefill whose cache lies in shared memory (as ``kvxfer serve`` allocates it) is
    read on this host from its mapped cache, one whose cache does not over NIXL: the
    path is a label of the prefill peer's bytes, seconds, achieved rate, ceiling (the
    rate its probe reached at connect) and the share of it achieved."""
    from kvxfer.engine import LLMEngine, tiny_config
    from kvxfer.sidecar.roles.composition import new_engine_id
    from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
    from kvxfer.transfer.converted.mapped_reads import shared_zeros
    from kvxfer.transfer.transfer_config import TransferConfig

    if path == "mapped":
        engine = LLMEngine(tiny_config(), None, block_size=16, num_blocks=8,
                           cache_zeros=shared_zeros)
        engine_id = new_engine_id("prefill")
        metrics = SidecarMetrics(role="prefill", engine_id=engine_id, model="tiny",
                                 layout=engine.layout.name, tp=1)
        prefill = Roles.start(engine, "prefill", metrics, TransferConfig(), engine_id, HOST)
    else:
        prefill = make("prefill")
    decode = make("decode", kv_load_failure_policy="fail")
    try:
        params = held(prefill, "p")
        decode.admit(pulled("d", prompt(TOKENS), PARAMS, RemoteParams.parse(params)))
        pump(prefill, decode, until=lambda: value(decode, "kvxfer_kv_transfers_total",
                                                  outcome="ok") == 1)
        peer = {"peer": params["remote_engine_id"], "path": path}
        moved = value(decode, "kvxfer_kv_path_bytes_total", **peer)
        assert moved == value(decode, "kvxfer_kv_transfer_bytes_total") > 0
        seconds = value(decode, "kvxfer_kv_path_seconds_total", **peer)
        rate = value(decode, "kvxfer_kv_path_bytes_per_second", **peer)
        assert seconds > 0 and rate == pytest.approx(moved / seconds)
        ceiling = value(decode, "kvxfer_kv_path_ceiling_bytes_per_second", **peer)
        assert ceiling > 0
        assert value(decode, "kvxfer_kv_path_ceiling_share", **peer) == \
            pytest.approx(rate / ceiling)
        other = "nixl" if path == "mapped" else "mapped"
        assert decode.metrics.registry.get_sample_value(
            "kvxfer_kv_path_bytes_total", {**peer, "path": other}) is None
    finally:
        if path == "mapped":
            prefill.close()


# -- failed handshakes ----------------------------------------------------------------------

def silent_port(ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[int, Any]:
    """A ROUTER that takes every request and never answers."""
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    return silent.bind_to_random_port(f"tcp://{HOST}"), silent


@pytest.mark.parametrize("reason", ["mismatch", "auth", "unreachable", "timeout"])
def test_a_failed_handshake_is_counted_by_reason(make: Make, reason: str) -> None:
    decode = make("decode", kv_load_failure_policy="fail")
    worker = decode.ranks.workers[0]
    worker.handshake_timeout, worker.handshake_retries = 0.2, 1  # the timeout case: ~0.5 s
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    closers: list[Any] = []
    try:
        if reason == "mismatch":  # another model's listener
            closers.append(Recorder().listener)
            port = closers[-1].port
        elif reason == "auth":  # this model, but the listener holds a key the decode lacks
            closers.append(SideChannelListener(HOST, engine_id="prefill-keyed",
                                             compat=compat_info(decode.engine),
                                             metadata=lambda: [], hmac_key=KEY).start())
            port = closers[-1].port
        elif reason == "unreachable":
            port = free_port()
        else:
            port, silent = silent_port(ctx)
            closers.append(silent)
        params = {"remote_engine_id": "prefill-x", "remote_host": HOST, "remote_port": port,
                  "remote_block_ids": [0, 1], "remote_request_id": "r", "tp_size": 1}
        read_directly(decode, params, "r")
        name = "kvxfer_kv_handshake_failures_total"
        pump(decode, until=lambda: value(decode, name, reason=reason) == 1)
        others = [r for r in HANDSHAKE_FAILURE_REASONS if r != reason]
        assert all(value(decode, name, reason=r) == 0 for r in others)
    finally:
        for closer in closers:
            closer.close()
        ctx.term()


def test_every_handshake_failure_reason_is_exported() -> None:
    assert set(HANDSHAKE_FAILURE_REASONS) == {*FAILURE_REASONS, "connect"}


# -- failed notifications -------------------------------------------------------------------

def test_a_done_the_decode_could_not_send_is_counted(make: Make,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ the decode gives up on after the handshake (block ids the prefill lacks)
    tells the prefill with an ``ok=False`` "done"; NIXL refuses to send it."""
    prefill, decode = make("prefill"), make("decode", kv_load_failure_policy="fail")

    def refuse(*_args: object) -> None:
        raise RuntimeError("the notification could not be sent")

    monkeypatch.setattr(decode.ranks.workers[0]._agent, "send_notif", refuse)
    params = held(prefill, "p")
    bad = {**params, "remote_block_ids": [1000 + b for b in params["remote_block_ids"]]}
    decode.admit(pulled("d", prompt(TOKENS), PARAMS, RemoteParams.parse(bad)))
    pump(prefill, decode, until=lambda: value(decode, "kvxfer_kv_transfers_total",
                                              outcome="failed") == 1)
    assert value(decode, "kvxfer_kv_notifications_failed_total", reason="unsent") == 1
    # unsent, so the decode's side-channel report of its ok=False "done" ends the lease,
    # as failed: the decode gave up
    pump(prefill, decode, until=lambda: value(prefill, "kvxfer_kv_leases_released_total",
                                              reason="failed") == 1)


def test_notifications_the_prefill_cannot_verify_are_counted(make: Make) -> None:
    """With a key, an unsigned or wrongly signed "done" and bytes that are no
    notification at all reach the prefill's agent; it ignores and counts each."""
    prefill = make("prefill", kv_key=KEY)
    params = held(prefill, "p")
    name = "kvxfer_kv_notifications_failed_total"
    with NixlAgent(f"stranger-{os.getpid()}") as agent:
        target = agent.add_remote(prefill.ranks.workers[0].metadata().agent_blob)
        agent.connect(target)
        done = ReadDone(params["remote_request_id"], "decode-stranger", 0, 1, True)
        for key in (None, b"guess" * 8):
            agent.send_notif(target, encode_notif(done, key))
        agent.send_notif(target, b"garbage, not a notification")

        def counted() -> bool:
            agent.progress()
            return (value(prefill, name, reason="bad_signature"),
                    value(prefill, name, reason="malformed")) == (2, 1)

        pump(prefill, until=counted)
    assert prefill.ranks.workers[0].holds_lease(params["remote_request_id"]), "no lease ended"
    assert value(prefill, "kvxfer_kv_notifications_late_total", reason="unknown") == 0


# -- late notifications ---------------------------------------------------------------------

def end_lease(prefill: Roles, params: dict[str, Any], how: str) -> None:
    """End the lease of ``params`` the way ``how`` says, before the READ whose "done"
    comes late."""
    if how == "abandoned":
        prefill.ranks.workers[0].end_lease(params["remote_request_id"])
    released = "kvxfer_kv_leases_released_total"
    pump(prefill, until=lambda: value(prefill, released, reason=how) == 1)


# Not "done": a reader's second copy of its "done" for a lease its first copy ended is
# expected since readers also report over the side channel (test_done_reports).
@pytest.mark.parametrize("how", ["abandoned", "expired", "unknown"])
def test_a_done_for_a_lease_no_longer_held_counts_as_late(make: Make, how: str) -> None:
    prefill = make("prefill", lease_ttl=0.3 if how == "expired" else 60.0)
    decode = make("decode", kv_load_failure_policy="fail")
    params = held(prefill, "p")
    if how == "unknown":  # a lease this prefill never handed out
        params = {**params, "remote_request_id": "never-held"}
    else:
        end_lease(prefill, params, how)
    late = "kvxfer_kv_notifications_late_total"
    read_directly(decode, params, "late")
    pump(prefill, decode, until=lambda: value(prefill, late, reason=how) == 1)
    assert sum(value(prefill, late, reason=r)
               for r in ("done", "abandoned", "expired", "unknown")) == 1
    assert value(prefill, "kvxfer_kv_notifications_failed_total", reason="malformed") == 0


def test_the_help_text_names_every_reason(make: Make) -> None:
    text = make("decode").metrics.render().decode()
    for line in ('kvxfer_kv_handshake_failures_total{reason="timeout"} 0.0',
                 'kvxfer_kv_notifications_failed_total{reason="unsent"} 0.0',
                 'kvxfer_kv_notifications_late_total{reason="expired"} 0.0',
                 "# TYPE kvxfer_kv_transfer_size_bytes histogram",
                 "# TYPE kvxfer_kv_transfer_size_descriptors histogram"):
        assert line in text, line


def test_a_lease_whose_client_left_before_the_answer_ends_at_once(make: Make) -> None:
    """The client of a finished prefill request left before its answer (the lease's
    params) reached it, as a proxy that gave up on a frozen prefill does: the abort ends
    the lease now (``abandoned``) instead of leaving its blocks to the TTL."""
    prefill = make("prefill")
    held(prefill, "p")
    assert prefill.abort("p") is AbortOutcome.LEASED
    pump(prefill, until=lambda: value(prefill, "kvxfer_kv_leases_released_total",
                                      reason="abandoned") == 1)
    assert prefill.ranks.workers[0].num_leases == 0 and prefill.engine.num_free_blocks == \
        prefill.engine.num_blocks
    assert prefill.abort("p") is AbortOutcome.NOT_MINE, "ended once"
