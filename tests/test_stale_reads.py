"""A READ given up while NIXL still reports it in flight is not over: over TCP, once a cut
link is back, the prefill's kernel delivers what it held and UCX places it, even after the
peer was removed from the agent (measured between network namespaces; the full path is
``test_netns.py::test_link_cut_mid_read``). The decode rank keeps such a READ open, with
its peer's agent, reports the read failed at once but *quarantined* (its blocks must not
be used), and *settled* once NIXL says the READ ended.

Real prefill process, real NIXL agents and side channel; only the decode's READ is a
stand-in that NIXL "reports" in flight until the test lets it land.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvxfer.harness.loopback import CacheConfig, LoopbackInstance, PrefillProcess
from kvxfer.transfer.results import PollResult


class StuckRead:
    """A posted READ that stays in flight until :meth:`land` (a cut link's)."""

    span = None

    def __init__(self) -> None:
        self.landed = False
        self.released = False

    def state(self) -> str:
        return "DONE" if self.landed else "PROC"

    def release(self) -> None:
        self.released = True

    def land(self) -> None:
        self.landed = True


def poll_until(worker: Any, done: Callable[[PollResult], bool], timeout: float = 10.0
               ) -> PollResult:
    """Poll ``worker`` until a result satisfies ``done``; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = worker.poll()
        if done(result):
            return result
        time.sleep(0.01)
    raise AssertionError(f"no such poll result within {timeout} s")


def params(remote: dict[str, Any], rid: str, ids: list[int]) -> dict[str, Any]:
    return {"remote_engine_id": remote["engine_id"], "remote_host": "127.0.0.1",
            "remote_port": remote["port"], "remote_block_ids": ids,
            "remote_request_id": rid, "tp_size": 1}


def test_a_read_given_up_in_flight_is_held_until_its_read_ended(
        prefill: PrefillProcess, monkeypatch: Any) -> None:
    cfg = CacheConfig(num_blocks=8, host_reads=False)  # read over NIXL, not copied
    remote = prefill.create(cfg)
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel")
    try:
        worker = decode.workers[0]
        prefill.hold(remote["engine_id"], "warm", [1], ttl=30)
        decode.read("warm", params(remote, "warm", [1]), [5])  # handshake + connect
        assert decode.wait(["warm"])[1] == {}
        agents = set(worker._agent._remotes)
        assert agents, "the prefill's agent was never loaded"

        stuck = StuckRead()
        monkeypatch.setattr(worker._agent, "read", lambda *a, **k: stuck)
        worker.read_timeout = 0.5
        prefill.hold(remote["engine_id"], "cut", [2, 3], ttl=30)
        decode.read("cut", params(remote, "cut", [2, 3]), [2, 3])
        failed = poll_until(worker, lambda r: "cut" in r.failed)
        assert "READ still in progress" in failed.failed["cut"], failed.failed
        # failed at once, so that the request is recomputed or answered, but quarantined
        assert failed.quarantined == {"cut"}, failed
        assert not stuck.released, "a READ still in flight was released: it may still land"
        # the peer is taken for dead, yet its agent stays: only it says when the READ ended
        time.sleep(0.3)
        assert worker.poll().settled == []
        assert set(worker._agent._remotes) == agents

        stuck.land()  # the link is back: the bytes land
        settled = poll_until(worker, lambda r: bool(r.settled))
        assert settled.settled == ["cut"] and stuck.released
        monkeypatch.undo()
        # and only now the dead peer's agent is removed
        assert set(worker._agent._remotes) == set(), worker._agent._remotes
        assert worker._reads.held == []
    finally:
        decode.close()


def test_a_read_that_failed_outright_is_not_quarantined(
        prefill: PrefillProcess, monkeypatch: Any) -> None:
    """A READ NIXL reports failed has ended: nothing of it lands, nothing is held."""
    from kvxfer.transfer.nixl_agent import NixlTransferError

    class FailedRead(StuckRead):
        def state(self) -> str:
            raise NixlTransferError("READ", "prefill", "NIXL_ERR_REMOTE_DISCONNECT")

    cfg = CacheConfig(num_blocks=8, host_reads=False)
    remote = prefill.create(cfg)
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel")
    try:
        worker = decode.workers[0]
        prefill.hold(remote["engine_id"], "warm", [1], ttl=30)
        decode.read("warm", params(remote, "warm", [1]), [5])
        assert decode.wait(["warm"])[1] == {}
        failing = FailedRead()
        monkeypatch.setattr(worker._agent, "read", lambda *a, **k: failing)
        prefill.hold(remote["engine_id"], "lost", [2], ttl=30)
        decode.read("lost", params(remote, "lost", [2]), [2])
        failed = poll_until(worker, lambda r: "lost" in r.failed)
        assert failed.quarantined == set() and failing.released
        assert worker._reads.held == []
    finally:
        decode.close()
