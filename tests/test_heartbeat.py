"""A prefill that falls silent while a READ from it is in flight is noticed within a bound.

* :class:`~kvxfer.transfer.liveness.Liveness` as a unit: a channel is silent since its
  oldest unanswered heartbeat, only watched channels get heartbeats, idle ones are
  forgotten.
* :class:`~kvxfer.transfer.reads.reader.Reader` as a unit (its read path, peer and peers
  are stand-ins): a read still in flight when its peer's side channel has been silent
  for the heartbeat timeout fails through the reader's one failure path, naming the peer
  and how long it was silent; a read that lands is finished however silent its peer; a
  peer that answers keeps its read going past the bound, until the read timeout.
* Real processes and sockets: a prefill OS process (:class:`~kvxfer.harness.loopback.
  PrefillProcess`, UCX over TCP) frozen with SIGSTOP, read by real decode workers whose
  :class:`~kvxfer.transfer.side_channel.heartbeats.Heartbeats` thread asks its real
  listener. A NIXL READ from it is in flight until the bound fails it (30 s read
  timeout), also one split over read lanes (they copy inside the post); a copy from its
  mapped cache on this host completes, frozen or not; after
  SIGCONT its side channel answers again. Only the process this module started is
  signalled, by PID, and it is thawed in ``finally``.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxfer.harness.loopback import CacheConfig, LoopbackInstance, PrefillProcess
from kvxfer.transfer.liveness import LINGER_S, MAX_UNANSWERED, Liveness
from kvxfer.transfer.local_rank import Deadlines
from kvxfer.transfer.reads.path import LANDED, Progress, ReadPath, Waiting
from kvxfer.transfer.reads.read import Read
from kvxfer.transfer.reads.reader import Reader
from kvxfer.transfer.results import ReadResults, Tally
from kvxfer.transfer.side_channel.heartbeats import Heartbeats
from kvxfer.wire.params import RemoteParams

CHANNEL = ("10.0.0.7", 5600)
OTHER = ("10.0.0.8", 5600)
TIMEOUT_S = 0.4         # the heartbeat timeout of these tests (a heartbeat every 0.1 s)
BOUND_S = 0.5           # Liveness(TIMEOUT_S).bound
READ_TIMEOUT_S = 30.0   # far above the bound: a read failing near the bound failed by it
SLACK_S = 1.0           # two busy shared cores


# -- Liveness, pure ---------------------------------------------------------------------------

def test_a_channel_is_silent_since_its_oldest_unanswered_heartbeat() -> None:
    live = Liveness(TIMEOUT_S)
    assert (live.interval, live.bound) == (0.1, BOUND_S)
    assert live.beats_due(0.0) == [], "nothing watched, nothing sent"
    live.watch("rank0", [CHANNEL], now=0.0)
    assert live.beats_due(0.0) == [(CHANNEL, 0)]
    assert live.beats_due(0.05) == [], "one per interval"
    assert live.silent_since([CHANNEL]) == 0.0
    assert live.answered(CHANNEL, 0)
    assert live.silent_since([CHANNEL]) is None
    assert live.beats_due(0.1) == [(CHANNEL, 1)]
    assert live.beats_due(0.2) == [(CHANNEL, 2)]
    assert live.silent_since([CHANNEL, OTHER]) == 0.1, "the oldest unanswered"
    assert live.answered(CHANNEL, 2), "an answer answers every earlier heartbeat too"
    assert live.silent_since([CHANNEL]) is None
    assert not live.answered(CHANNEL, 1) and not live.answered(CHANNEL, 9)
    assert not live.answered(OTHER, 0), "never sent there"


def test_only_watched_channels_get_heartbeats_and_idle_ones_are_forgotten() -> None:
    live = Liveness(TIMEOUT_S)
    live.watch("rank0", [CHANNEL], now=0.0)
    live.watch("rank1", [CHANNEL, OTHER], now=0.0)
    assert sorted(live.beats_due(0.0)) == [(CHANNEL, 0), (OTHER, 0)]
    live.watch("rank1", [], now=1.0)
    assert live.beats_due(1.0) == [(CHANNEL, 1)], "rank 0 still reads from it"
    assert live.next_due() == pytest.approx(1.1)
    live.watch("rank0", [], now=2.0)
    assert live.beats_due(5.0) == [] and live.next_due() is None
    assert live.silent_since([OTHER]) == 0.0, "what went unanswered stays so"
    assert sorted(live.channels()) == sorted([CHANNEL, OTHER]), "connections kept a while"
    assert live.forget_idle(1.0 + LINGER_S - 0.01) == []
    assert live.forget_idle(1.0 + LINGER_S) == [OTHER]
    assert live.forget_idle(2.0 + LINGER_S) == [CHANNEL]
    assert live.channels() == [] and live.silent_since([CHANNEL, OTHER]) is None


def test_a_peer_that_never_answers_gets_a_bounded_number_of_heartbeats() -> None:
    live = Liveness(TIMEOUT_S)
    live.watch("rank0", [CHANNEL], now=0.0)
    sent = [seq for step in range(2 * MAX_UNANSWERED)
            for _, seq in live.beats_due(step * live.interval)]
    assert sent == list(range(MAX_UNANSWERED))
    assert live.silent_since([CHANNEL]) == 0.0
    last = (2 * MAX_UNANSWERED - 1) * live.interval
    assert live.next_due() == pytest.approx(last + live.interval), "no busy loop meanwhile"


def test_once_stopped_nothing_is_silent_nor_watched() -> None:
    """The heartbeat thread ended: what it left unanswered must fail no read."""
    live = Liveness(TIMEOUT_S)
    live.watch("rank0", [CHANNEL], now=0.0)
    live.beats_due(0.0)
    live.stop()
    assert live.silent_since([CHANNEL]) is None
    live.watch("rank0", [CHANNEL, OTHER], now=1.0)
    assert live.beats_due(1.0) == [] and live.channels() == []


def test_a_channel_nobody_watched_wakes_the_heartbeat_thread() -> None:
    """The heartbeat thread sleeps in its poll while nothing is due: a reader that starts
    watching a channel must wake it (its first heartbeat goes out at once)."""
    live, woken = Liveness(TIMEOUT_S), []
    live.on_new_channel(lambda: woken.append(1))
    live.watch("rank0", [CHANNEL], now=0.0)
    assert len(woken) == 1
    live.watch("rank1", [CHANNEL], now=0.0)
    live.watch("rank0", [], now=0.0)
    assert len(woken) == 1, "watched already: nothing new for the thread"
    live.watch("rank1", [CHANNEL, OTHER], now=0.0)
    assert len(woken) == 2


def test_an_idle_heartbeat_thread_sends_at_once_when_a_channel_is_watched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real listener and heartbeat thread: with the idle wait a minute long, the first
    heartbeat to a newly watched channel is still answered within the slack (the watch
    wakes the thread), and close() stops both threads at once (it wakes their polls)."""
    import kvxfer.transfer.side_channel.heartbeats as heartbeats_module
    from kvxfer.transfer.side_channel.listener import SideChannelListener
    from kvxfer.wire.compat import CompatInfo

    monkeypatch.setattr(heartbeats_module, "IDLE_WAIT_S", 60.0)
    compat = CompatInfo(model="m", dtype="float32", cache_dtype="float32", head_size=8,
                        total_kv_heads=2, num_layers=1)
    listener = SideChannelListener("127.0.0.1", engine_id="P", compat=compat,
                                 metadata=lambda: []).start()
    live = Liveness(TIMEOUT_S)
    beats = Heartbeats(live, "D", compat)
    try:
        time.sleep(0.3)  # the thread is in its (minute-long) idle poll by now
        channel = ("127.0.0.1", listener.port)
        live.watch("rank0", [channel], now=time.monotonic())
        end = time.monotonic() + SLACK_S + TIMEOUT_S
        while live.last_answered([channel]) is None:
            assert time.monotonic() < end, "the watch did not wake the heartbeat thread"
            time.sleep(0.01)
        live.watch("rank0", [], now=time.monotonic())
        time.sleep(0.2)
        used = thread_cpu_s(beats._thread)
        time.sleep(1.0)
        assert thread_cpu_s(beats._thread) - used < 0.3, "the idle heartbeat thread spins"
    finally:
        threads = [beats._thread, listener._thread]
        beats.close()
        listener.close()
    assert not any(thread is not None and thread.is_alive() for thread in threads)


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` (of this process) has used."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_a_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(ValueError, match="heartbeat timeout must be a positive"):
        Liveness(timeout)


# -- the Reader's deadline, a unit ----------------------------------------------------------

class Path(ReadPath):
    """A read path whose bytes the peer owes until the test lands it."""

    def __init__(self) -> None:
        super().__init__([0])
        self.landed_now = threading.Event()
        self.abandoned: str | None = None

    def post(self) -> None:
        pass

    def progress(self) -> Progress:
        if self.landed_now.is_set():
            return LANDED
        return Waiting("READ still in progress after {timeout} s", peer="prefill P at here")

    def finish(self) -> None:
        pass

    def abandon(self, reason: str) -> None:
        self.abandoned = reason


@dataclass
class Rig:
    reader: Reader
    results: ReadResults
    live: Liveness
    read: Read
    path: Path
    dead: dict[str, str]


@pytest.fixture
def rig() -> Rig:
    live = Liveness(TIMEOUT_S)
    local = SimpleNamespace(rank=0, deadlines=Deadlines(1.0, 0, READ_TIMEOUT_S, live),
                            wake=threading.Event(), tally=Tally())
    peer = SimpleNamespace(agents={0: b"agent"}, engine_id="P",
                           tell=lambda *_a, **_k: None, reports=lambda *_a, **_k: ())
    dead: dict[str, str] = {}
    peers = SimpleNamespace(get=lambda engine: None if engine in dead else peer,
                            dead=lambda _engine: None, drop_forgotten=lambda: None,
                            finished=lambda: [], forget_dead=dead.__setitem__)
    results = ReadResults()
    reports = SimpleNamespace(done=lambda *_a: True)  # the peer reports nothing here
    reader = Reader(local, peers, results, reports)  # type: ignore[arg-type]
    path = Path()
    now = time.monotonic()
    remote = RemoteParams("P", CHANNEL[0], CHANNEL[1], (3,), "lease-1", 1, 16, time.time() + 60)
    read = Read("r", remote, np.array([5]), started=now, posted=now, paths=[path])
    reader.inflight.append(read)
    return Rig(reader, results, live, read, path, dead)


def heartbeats(rig: Rig, seconds: float, *, answer: bool) -> Any:
    """Step the reader for ``seconds`` (or until the read ended) while a heartbeat goes out
    each interval, answered or not (what the heartbeat thread would record)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for channel, seq in rig.live.beats_due(time.monotonic()):
            if answer:
                rig.live.answered(channel, seq)
        rig.reader.step()
        if not rig.reader.inflight:
            break
        time.sleep(0.002)
    return rig.results.take()


def test_a_read_in_flight_from_a_silent_peer_fails_within_the_bound(rig: Rig) -> None:
    result = heartbeats(rig, BOUND_S + SLACK_S, answer=False)
    took = time.monotonic() - rig.read.started
    assert list(result.failed) == ["r"] and not result.finished
    assert TIMEOUT_S <= took <= BOUND_S + SLACK_S < READ_TIMEOUT_S
    why = result.failed["r"]
    assert re.fullmatch(r"prefill P at here: READ still in progress after 0\.\d s: its side "
                        r"channel has answered no heartbeat for 0\.\d s \(heartbeat timeout "
                        r"0\.4 s\)", why), why
    # the one failure path: the path was abandoned, the peer taken for dead for a moment
    assert rig.path.abandoned == why and rig.dead == {"P": why.split(": ", 1)[1]}
    rig.reader.step()
    assert rig.live.beats_due(time.monotonic() + 1) == [], "no read in flight: no heartbeat"


def test_a_read_that_lands_is_finished_however_silent_its_peer(rig: Rig) -> None:
    rig.live.watch("other rank", [CHANNEL], now=time.monotonic())
    rig.live.beats_due(time.monotonic())  # unanswered from here on
    time.sleep(TIMEOUT_S + 0.1)  # silent past the timeout before the reader looks again
    rig.path.landed_now.set()
    result = heartbeats(rig, SLACK_S, answer=False)
    assert result.finished == ["r"] and not result.failed
    assert rig.live.silent_since([CHANNEL]) is not None and rig.dead == {}


def test_a_peer_that_answers_keeps_its_read_going_past_the_bound(rig: Rig) -> None:
    result = heartbeats(rig, 3 * BOUND_S, answer=True)
    assert not result.failed and not result.finished and rig.reader.inflight == [rig.read]
    rig.path.landed_now.set()
    assert heartbeats(rig, SLACK_S, answer=True).finished == ["r"]


def test_a_read_timeout_from_a_peer_that_answers_says_the_peer_is_up(rig: Rig) -> None:
    """A READ that outlives its read timeout while its prefill answers heartbeats is not a
    dead or cut peer: the failure says so (what tells a stalled READ from a lost peer)."""
    rig.read.posted = time.monotonic() - READ_TIMEOUT_S + 3 * BOUND_S  # due after 1.5 s
    result = heartbeats(rig, 3 * BOUND_S + SLACK_S, answer=True)
    why = result.failed["r"]
    assert re.fullmatch(r"prefill P at here: READ still in progress after 30 s \(its side "
                        r"channel answered a heartbeat 0\.\d s before: the prefill is up, the "
                        r"READ did not complete\)", why), why


def test_a_read_timeout_while_a_heartbeat_waits_says_so_not_that_the_peer_is_up(
        rig: Rig) -> None:
    """The read timeout comes before the heartbeat timeout does (a link cut shortly before
    it): the failure must not call the peer up, though it answered earlier heartbeats."""
    rig.read.posted = time.monotonic() - READ_TIMEOUT_S + 0.6
    heartbeats(rig, 0.3, answer=True)
    result = heartbeats(rig, 0.3 + SLACK_S, answer=False)  # timed out before the bound
    why = result.failed["r"]
    assert re.fullmatch(r"prefill P at here: READ still in progress after 30 s \(its side "
                        r"channel has left a heartbeat unanswered for 0\.\d s\)", why), why


def test_a_read_timeout_with_no_heartbeat_sent_says_nothing_of_the_peer(rig: Rig) -> None:
    rig.read.posted = time.monotonic() - READ_TIMEOUT_S + 0.2
    end = time.monotonic() + 0.2 + SLACK_S
    while rig.reader.inflight and time.monotonic() < end:  # no heartbeat goes out
        rig.reader.step()
        time.sleep(0.002)
    assert rig.results.take().failed["r"] == \
        "prefill P at here: READ still in progress after 30 s"


def test_silence_does_not_move_the_deadline_of_a_wait_the_peer_does_not_owe(rig: Rig) -> None:
    own = Waiting("placing the read took longer than {timeout} s")  # this side's copy
    rig.path.progress = lambda: own  # type: ignore[method-assign]
    result = heartbeats(rig, BOUND_S + 0.3, answer=False)
    assert not result.failed and rig.reader.inflight == [rig.read]


# -- real processes and sockets ---------------------------------------------------------------

# 64 blocks, the decode with read lanes: a read of every other block (96 descriptors) is
# split over the lanes, one of 3 blocks is not (kvxfer.transfer.lanes.LANE_MIN_DESCRIPTORS)
CFG_NIXL = CacheConfig(num_blocks=64, host_reads=False, shared_memory=False)  # NIXL READs
CFG_MAPPED = CacheConfig(num_blocks=64)  # a decode on this host copies from its mapped cache
CFG_DECODE = CacheConfig(num_blocks=64, read_lanes=2)
FEW, MANY = [1, 2, 3], list(range(0, 64, 2))


@dataclass
class Frozen:
    """A prefill process (UCX over TCP), two of its instances and a decode reading them."""

    process: PrefillProcess
    nixl: dict[str, Any]    # engine_id, port: read over NIXL
    mapped: dict[str, Any]  # read from its mapped cache
    decode: LoopbackInstance
    live: Liveness
    beats: Heartbeats

    def lease(self, target: dict[str, Any], request_id: str, blocks: list[int] = FEW
              ) -> None:
        """Lease ``blocks`` there (before it freezes: the process is driven over a pipe)."""
        self.process.hold(target["engine_id"], request_id, blocks, ttl=60)

    def read(self, target: dict[str, Any], request_id: str, blocks: list[int] = FEW
             ) -> tuple[float, dict[str, Any], dict[str, str]]:
        """Read the ``blocks`` of lease ``request_id``; (seconds, finished, failed)."""
        params = {"remote_engine_id": target["engine_id"], "remote_host": "127.0.0.1",
                  "remote_port": target["port"], "remote_block_ids": blocks,
                  "remote_request_id": request_id, "tp_size": 1}
        start = time.monotonic()
        self.decode.read(request_id, params, blocks)
        finished, failed = self.decode.wait([request_id], timeout=READ_TIMEOUT_S + 5)
        return time.monotonic() - start, finished, failed

    def freeze(self) -> None:
        os.kill(self.process.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.process.process.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def frozen() -> Iterator[Frozen]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("UCX_TLS", "tcp")  # the child's NIXL: no cma, READs need its progress
        process = PrefillProcess()
    decode: LoopbackInstance | None = None
    beats: Heartbeats | None = None
    try:
        nixl, mapped = process.create(CFG_NIXL), process.create(CFG_MAPPED)
        decode = LoopbackInstance.create("decode", CFG_DECODE, fill="sentinel")
        live = Liveness(TIMEOUT_S)
        beats = Heartbeats(live, decode.engine_id, CFG_DECODE.compat())
        for worker in decode.workers:
            worker.liveness, worker.read_timeout = live, READ_TIMEOUT_S
        made = Frozen(process, nixl, mapped, decode, live, beats)
        for target in (nixl, mapped):  # handshaken and connected before anything freezes
            made.lease(target, f"warm-{target['port']}")
            _, finished, failed = made.read(target, f"warm-{target['port']}")
            assert finished and not failed, failed
        yield made
    finally:
        os.kill(process.process.pid, signal.SIGCONT)
        if beats is not None:
            beats.close()
        if decode is not None:
            decode.close()
        process.close()


def test_a_nixl_read_in_flight_from_a_frozen_prefill_fails_within_the_bound(
        frozen: Frozen) -> None:
    """The READ's notification waits for the frozen prefill to progress, so the READ
    stays in flight; now and then UCX sends it without (cma copies from a stopped process
    too) and the READ lands at once (seen once in CI): that try exercised nothing, and
    the next lease is read (at most three)."""
    for attempt in range(3):
        lease = f"in-flight-{attempt}"
        frozen.lease(frozen.nixl, lease)
        frozen.freeze()
        try:
            took, finished, failed = frozen.read(frozen.nixl, lease)
        finally:
            frozen.thaw()
        if not finished:
            break
        print(f"frozen prefill, try {attempt}: the READ landed at once ({took:.3f} s)")
    print(f"frozen prefill, NIXL READ in flight: failed after {took:.3f} s")
    assert not finished and list(failed) == [lease], "the READ landed in every try"
    assert took < BOUND_S + SLACK_S, f"failed after {took:.1f} s, at the read timeout"
    why = failed[lease]
    assert f"prefill {frozen.nixl['engine_id']} at tcp://127.0.0.1:{frozen.nixl['port']}" \
        in why and "answered no heartbeat for" in why and "READ still in progress" in why, why


def test_a_read_split_over_lanes_from_a_frozen_prefill_fails_within_the_bound(
        frozen: Frozen) -> None:
    """The lanes copy while the READs are posted, on their own threads: they give up at
    the read's deadline as the reader does."""
    target = frozen.process.create(CFG_NIXL)  # not the peer an earlier test failed
    frozen.lease(target, "lanes-warm", MANY)
    _, finished, failed = frozen.read(target, "lanes-warm", MANY)
    assert not failed and finished["lanes-warm"][0].lanes == 2, "split over the lanes"
    frozen.lease(target, "lanes", MANY)
    frozen.freeze()
    try:
        took, finished, failed = frozen.read(target, "lanes", MANY)
    finally:
        frozen.thaw()
    print(f"frozen prefill, READ split over lanes: failed after {took:.3f} s")
    assert not finished and list(failed) == ["lanes"]
    assert took < BOUND_S + SLACK_S, f"failed after {took:.1f} s, at the read timeout"
    assert "answered no heartbeat for" in failed["lanes"], failed


def test_a_copy_from_a_frozen_prefill_on_this_host_completes(frozen: Frozen) -> None:
    channel = ("127.0.0.1", frozen.mapped["port"])
    leases = [f"mapped-{i}" for i in range(20)]
    for lease in leases:
        frozen.lease(frozen.mapped, lease)
    # as if another rank's READ from it were in flight: heartbeats go out all along (a
    # copy lands while it is posted, before its own reader would ask for them)
    frozen.live.watch("another rank", [channel], now=time.monotonic())
    frozen.freeze()
    try:
        reads = []
        for lease in leases:  # one after another for 2 bounds, the peer long silent
            reads.append(frozen.read(frozen.mapped, lease))
            time.sleep(2 * BOUND_S / len(leases))
        silent = frozen.live.silent_since([channel])
    finally:
        frozen.thaw()
        frozen.live.watch("another rank", [], now=time.monotonic())
    assert all(finished and not failed for _, finished, failed in reads), reads
    assert silent is not None and time.monotonic() - silent > TIMEOUT_S, \
        "its heartbeats went unanswered all along"


def test_heartbeats_are_answered_until_the_prefill_freezes_and_again_after(
        frozen: Frozen) -> None:
    channel = ("127.0.0.1", frozen.nixl["port"])

    def longest_silence(seconds: float) -> float:
        longest, end = 0.0, time.monotonic() + seconds
        while time.monotonic() < end:
            silent = frozen.live.silent_since([channel])
            longest = max(longest, 0.0 if silent is None else time.monotonic() - silent)
            time.sleep(0.01)
        return longest

    frozen.live.watch("test", [channel], now=time.monotonic())
    try:
        answered = frozen.beats.answered
        assert longest_silence(3 * BOUND_S) < TIMEOUT_S / 2
        assert frozen.beats.answered - answered >= 3 * BOUND_S / frozen.live.interval - 3
        frozen.freeze()
        try:
            assert longest_silence(BOUND_S + 0.2) >= TIMEOUT_S
        finally:
            frozen.thaw()
        end = time.monotonic() + SLACK_S + BOUND_S
        while frozen.live.silent_since([channel]) is not None:
            assert time.monotonic() < end, "no answer after the thaw"
            time.sleep(0.01)
    finally:
        frozen.live.watch("test", [], now=time.monotonic())
