"""What the decode does when its own machinery fails, in this process.

Against a real engine, real NIXL workers, a real engine loop and a real
side-channel listener that records the releases it receives (``Recorder``
from ``test_release``; its handshakes are refused, so no READ ever starts):

* an exception other than ValueError while admitting a request fails that
  request (500), releases its lease, and does not leave it at the head of the
  queue, where every later request would wait behind it forever;
* a decode submission still queued for the engine loop when it shuts down
  releases its lease (instead of leaving it to the TTL);
* only a read whose prefill nobody could tell is released; a read whose NIXL "done"
  could not be sent still ends its lease by the "done" report the decode worker sends
  over the prefill's side channel (real prefill ranks answering their side channel as a
  prefill sidecar's do, NIXL notifications that fail).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from test_release import Recorder, poll_until, prompt, pulled

from kvxfer.engine import SamplingParams
from kvxfer.harness.loopback import CacheConfig, LoopbackInstance
from kvxfer.sidecar.engine_loop import EngineLoop, Sink
from kvxfer.sidecar.request_kinds import PullIn, Submission
from kvxfer.sidecar.roles.composition import Roles
from kvxfer.transfer.leases import LeaseAnswers
from kvxfer.transfer.results import PollResult, ReadStats
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.wire.params import RemoteParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def lease(recorder: Recorder, lease_id: str, tokens: int) -> RemoteParams:
    """Params naming one of the recorder's leases, as a prefill hands them out."""
    base = recorder.params(lease_id, tokens)
    return RemoteParams.parse({
        "remote_engine_id": base.remote_engine_id, "remote_host": base.remote_host,
        "remote_port": base.remote_port, "remote_block_ids": list(base.remote_block_ids),
        "remote_request_id": lease_id, "tp_size": 1, "remote_num_tokens": tokens,
        "lease_expires_at": time.time() + 60})


def broken_admission(connector: Roles, monkeypatch: pytest.MonkeyPatch,
                     victim: str) -> None:
    """``engine.add_awaiting_kv`` (how the decode parks a request) raises a RuntimeError
    (not a ValueError) for ``victim``."""
    real = connector.engine.add_awaiting_kv

    def add_awaiting_kv(request_id: str, *args: object, **kwargs: object) -> None:
        if request_id == victim:
            raise RuntimeError("the engine broke while admitting it")
        real(request_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(connector.engine, "add_awaiting_kv", add_awaiting_kv)


def failures(connector: Roles) -> dict[str, str]:
    """Poll until some admission failed (after the lease's claim was granted)."""
    for _ in range(1000):
        failed = connector.poll().failed
        if failed:
            return failed
        time.sleep(0.005)
    raise AssertionError("no admission failed within 5 s")


def test_an_admission_that_raises_fails_that_request_only(
        connector: Roles, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    broken_admission(connector, monkeypatch, "broken")
    connector.admit(pulled("broken", prompt(20), PARAMS, lease(recorder, "lease-broken", 20)))
    failed = failures(connector)
    assert list(failed) == ["broken"] and "broke" in failed["broken"]
    assert not connector.waiting, "the failed request still waits at the head of the queue"
    [(lease_id, _, reason)] = recorder.wait_for(1)
    assert lease_id == "lease-broken" and "could not admit" in reason
    # the next request is admitted (its READ starts, and fails at the refused handshake)
    nxt = pulled("next", prompt(20), PARAMS, lease(recorder, "lease-next", 20))
    connector.admit(nxt)
    poll_until(connector, lambda: connector.transfer_error("next", nxt.kind) is not None)
    assert connector.engine.num_used_blocks == 0


def test_a_waiting_request_whose_admission_raises_is_failed_by_poll(
        connector: Roles, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = connector.engine
    engine.add_awaiting_kv("filler", prompt(100), PARAMS)  # 7 of 8 blocks
    connector.admit(pulled("broken", prompt(40), PARAMS, lease(recorder, "lease-broken", 40)))
    behind = pulled("behind", prompt(40), PARAMS, lease(recorder, "lease-behind", 40))
    connector.admit(behind)
    assert connector.poll().failed == {} and connector.waiting
    broken_admission(connector, monkeypatch, "broken")
    engine.abort("filler")  # blocks free: the head is admitted on the next poll
    failed = failures(connector)  # raised out of poll (and stopped the engine loop) before
    assert list(failed) == ["broken"] and "RuntimeError" in failed["broken"]
    # admitted once its claim is answered (under load that may take another poll or two)
    poll_until(connector, lambda: not connector.waiting)
    poll_until(connector, lambda: connector.transfer_error("behind", behind.kind) is not None)
    assert ("lease-broken" in [c[0] for c in recorder.wait_for(2)])


def test_a_decode_queued_at_shutdown_releases_its_lease(
        connector: Roles, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop is inside a step when a decode submission arrives and the sidecar stops:
    the submission never reaches the decode's role, yet its lease is released."""
    engine, metrics = connector.engine, connector.metrics
    loop = EngineLoop(engine, connector, metrics)
    inside, go_on = threading.Event(), threading.Event()
    real_step = engine.step

    def step() -> list[object]:
        inside.set()
        go_on.wait(10)
        return real_step()  # type: ignore[return-value]

    monkeypatch.setattr(engine, "step", step)
    events = asyncio.new_event_loop()
    try:
        sink = Sink(events)
        loop.start()
        loop.submit([Submission("busy", 0, prompt(10), PARAMS)], sink)
        assert inside.wait(10), "the engine never stepped"
        loop.submit([Submission("queued", 0, prompt(20), PARAMS,
                                kind=PullIn(lease(recorder, "lease-queued", 20)))], sink)
        stopper = threading.Thread(target=loop.stop)
        stopper.start()
        time.sleep(0.2)  # stop() has asked; the step is still running
        go_on.set()
        stopper.join(15)
        assert not stopper.is_alive()
        calls = recorder.wait_for(1)
        assert [c[0] for c in calls] == ["lease-queued"] and "shut down" in calls[0][2]
    finally:
        go_on.set()
        loop.stop()
        events.close()


def test_a_read_releases_only_what_nobody_could_tell(
        connector: Roles, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker reports one read finished with its prefill told, and one finished
    after its prefill's connection was dropped (unnotified): nothing is released for the
    first; the second is released, saying why. (The first's "done" report is the
    worker's to send: the last test of this module.)"""
    worker = connector.ranks.workers[0]
    results: list[PollResult] = []  # once a read started (after its claim)
    deadlines: list[float] = []  # until when each read's "done" reports may be resent
    ends = {"told": PollResult(finished=["told"], stats={"told": ReadStats(64, 1, 0.001)}),
            "dropped": PollResult(finished=["dropped"],
                                  stats={"dropped": ReadStats(64, 1, 0.001)},
                                  unnotified={"dropped"})}

    def start_read(request_id: str, *_args: object, lease_ends: float) -> None:
        results.append(ends[request_id])
        deadlines.append(lease_ends)

    monkeypatch.setattr(worker, "start_read", start_read)
    monkeypatch.setattr(worker, "poll", lambda: results.pop() if results else PollResult())
    told = pulled("told", prompt(20), PARAMS, lease(recorder, "lease-told", 20))
    connector.admit(told)
    connector.admit(pulled("dropped", prompt(20), PARAMS, lease(recorder, "lease-dropped", 20)))
    poll_until(connector, lambda: len(recorder.calls) == 1 and not connector.busy)
    assert connector.transfer_error("told", told.kind) is None, "the read itself succeeded"
    # each read's reports are resent until its lease's deadline: the claim's grant (60 s)
    assert len(deadlines) == 2 and all(0 < d - time.monotonic() <= 60 for d in deadlines)
    connector.close()  # sends whatever release is still queued
    [(lease_id, _, reason)] = recorder.calls
    assert lease_id == "lease-dropped" and "connection to the prefill was dropped" in reason


def answering_prefill(cfg: CacheConfig) -> LoopbackInstance:
    """A loopback prefill whose side channel answers its leases' claims, releases and
    "done" reports as a prefill sidecar's does (``LeaseAnswers`` over its ranks)."""
    prefill = LoopbackInstance.create("prefill", cfg, listen=False)
    answers = LeaseAnswers(prefill.workers, ttl=30.0, max_age=120.0)
    prefill.listener = SideChannelListener(
        "127.0.0.1", 0, engine_id=prefill.engine_id, compat=cfg.compat(),
        metadata=lambda: [w.metadata() for w in prefill.workers],
        on_request=lambda _peer: [w.peer_connecting() for w in prefill.workers],
        on_release=answers.on_release, on_renew=answers.on_renew,
        on_done=answers.on_done).start()
    return prefill


def test_a_read_whose_done_could_not_be_sent_ends_its_lease_by_its_report(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lanes read (its "done" goes out after the copy, as its own notification) with
    every notification failing: finished, and the "done" report the decode worker sends
    over the prefill's side channel still ends the lease ("done"), long before its TTL."""
    cfg = CacheConfig(num_layers=8, num_blocks=40)
    prefill = answering_prefill(cfg)
    decode = LoopbackInstance.create("decode", CacheConfig(num_layers=8, num_blocks=40,
                                                           read_lanes=2), fill="sentinel")
    try:
        worker = decode.workers[0]

        def refuse(*_args: object) -> None:
            raise RuntimeError("the notification could not be sent")

        monkeypatch.setattr(worker._agent, "send_notif", refuse)
        ids, local = list(range(30)), list(range(29, -1, -1))  # reversed: no runs merge
        prefill.hold("quiet", ids, ttl=30)
        worker.start_read("quiet", {**prefill.params("quiet", ids),
                                    "lease_expires_at": time.time() + 30}, local)
        result = PollResult()
        deadline = time.monotonic() + 30
        while not (result.finished or result.failed) and time.monotonic() < deadline:
            time.sleep(0.005)
            result = worker.poll()
        assert result.finished == ["quiet"], result
        assert not result.unnotified, "its report tells the prefill: nothing to release"
        assert worker.take_counts().notifications_failed.get("unsent", 0) >= 1
        ended: dict[str, str] = {}
        deadline = time.monotonic() + 10  # the lease's TTL is 30 s
        while "quiet" not in ended and time.monotonic() < deadline:
            ended.update(prefill.released())
            time.sleep(0.01)
        assert ended == {"quiet": "done"}, "the decode's report did not end the lease"
    finally:
        decode.close()
        prefill.close()
