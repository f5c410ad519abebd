"""A decode reader's "done" over the side channel (``DoneReport``): sent by the reader for
each prefill rank at the port serving it, counted as its NIXL notification would be,
acknowledged, and resent while unanswered for as long as its lease may be held.

The prefill's lease table is the real one (pure, no NIXL); the listener, client and
sender are real ZMQ sockets on 127.0.0.1; the reader's unit has stand-ins for its rank,
peer and the instance's ``Reports``. Real NIXL reads whose notifications are lost are in
``test_vllm_tp`` (rank by rank), ``test_pull_decode_faults`` and ``test_transfer``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxfer.transfer.leases import LeaseAnswers, LeaseTable
from kvxfer.transfer.local_rank import Deadlines
from kvxfer.transfer.reads.path import LANDED, Progress, ReadPath
from kvxfer.transfer.reads.read import Read
from kvxfer.transfer.reads.reader import Reader
from kvxfer.transfer.results import ReadResults, Tally
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.failures import PeerRefused
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.transfer.side_channel.reports import Reports
from kvxfer.transfer.side_channel.sender import (
    DONE_RESEND_FOR_S,
    DONE_RESENDS_S,
    SideChannelSender,
)
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.messages import DoneReport, ReleaseOutcome
from kvxfer.wire.notification import ReadDone
from kvxfer.wire.params import RemoteParams

HOST = "127.0.0.1"
COMPAT = CompatInfo(model="done-reports", dtype="float32", cache_dtype="float32",
                    head_size=8, total_kv_heads=2, num_layers=2)
KEY = b"k" * 32


class Rank:
    """A prefill rank's real lease table under the name ``LeaseAnswers`` asks for."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tally = Tally()
        self.table = LeaseTable(None, self.tally)

    def count_done(self, note: ReadDone, sender: str) -> bool:
        return self.table.count_done(note, sender, report=True)

    def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
              max_age: float = float("inf")) -> float:
        return self.table.renew(request_id, ttl, requester, claim=claim, max_age=max_age)

    def may_end(self, request_id: str, requester: str) -> bool:
        return self.table.may_end(request_id, requester)

    def holds_lease(self, request_id: str) -> bool:
        return self.table.holds(request_id)

    def end_lease(self, request_id: str, reason: str = "abandoned", *,
                  claimers: tuple[str | None, ...] | None = None) -> bool:
        return self.table.end(request_id, reason, claimers=claimers)


def done(lease: str, reader: str = "decode-a", rank: int = 0, readers: int = 1,
         ok: bool = True) -> ReadDone:
    return ReadDone(lease, reader, rank, readers, ok)


# -- the lease table ----------------------------------------------------------------------------

def test_each_reader_counts_once_whichever_way_its_done_came() -> None:
    table = LeaseTable(None, Tally())
    table.hold("L", [1, 2], readers=2, ttl=60)
    assert table.count_done(done("L", rank=0, readers=2), "agent a")  # NIXL
    assert table.count_done(done("L", rank=0, readers=2), "side channel", report=True)
    assert table.holds("L"), "the same reader twice is one reader"
    assert table.count_done(done("L", rank=1, readers=2), "side channel", report=True)
    assert not table.holds("L")
    assert [(r.request_id, r.reason) for r in table.take_released()] == [("L", "done")]


def test_only_a_notification_for_a_lease_that_ended_otherwise_counts_late() -> None:
    """A report's notification is counted too, and a reader's second copy of its "done"
    is expected now: late means a notification for a lease that expired (or was
    released) before it came."""
    tally = Tally()
    table = LeaseTable(None, tally)
    for lease in ("done-first", "gave-up-first", "expired"):
        table.hold(lease, [1], readers=1, ttl=0.01 if lease == "expired" else 60)
    table.count_done(done("done-first"), "side channel", report=True)
    table.count_done(done("gave-up-first", ok=False), "side channel", report=True)
    time.sleep(0.02)
    table.expire()
    assert not table.count_done(done("done-first"), "agent a"), "its report came first"
    assert not table.count_done(done("gave-up-first", ok=False), "agent a")
    assert not table.count_done(done("expired"), "side channel", report=True)
    assert not table.count_done(done("expired"), "agent a")
    assert dict(tally.take().notifications_late) == {"expired": 1}
    assert {r.request_id: r.reason for r in table.take_released()} == {
        "done-first": "done", "gave-up-first": "failed", "expired": "expired"}


def test_a_done_from_another_engine_than_the_claimer_ends_nothing() -> None:
    table = LeaseTable(None, Tally())
    table.hold("L", [1], readers=None, ttl=60)
    table.renew("L", 60, "decode-a", claim=True)
    assert not table.count_done(done("L", reader="decode-b"), "side channel", report=True)
    assert not table.count_done(done("L", reader="decode-b"), "agent b")
    assert table.holds("L")
    assert table.count_done(done("L", reader="decode-a"), "side channel", report=True)
    assert not table.holds("L")


def test_a_report_is_counted_on_the_rank_it_names_only() -> None:
    ranks = [Rank(0), Rank(1)]
    for rank in ranks:
        rank.table.hold("L", [3], readers=1, ttl=60)
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    assert answers.on_done(DoneReport(1, done("L")), "decode-a")
    assert ranks[0].table.holds("L") and not ranks[1].table.holds("L")
    with pytest.raises(ValueError, match=r"serves ranks \[0, 1\], not 2"):
        answers.on_done(DoneReport(2, done("L")), "decode-a")


def test_a_report_is_validated() -> None:
    with pytest.raises(ValueError, match="prefill_rank must not be negative"):
        DoneReport(-1, done("L"))
    with pytest.raises(ValueError, match="lease id has 1025 characters"):
        DoneReport(0, done("x" * 1025))


# -- over real sockets ------------------------------------------------------------------------

@pytest.fixture
def prefill() -> Iterator[tuple[SideChannelListener, list[Rank]]]:
    ranks = [Rank(0), Rank(1)]
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    with SideChannelListener(HOST, engine_id="prefill-r", compat=COMPAT, metadata=lambda: [],
                           hmac_key=KEY, on_release=answers.on_release,
                           on_renew=answers.on_renew, on_done=answers.on_done) as listener:
        yield listener, ranks


def test_a_report_is_acknowledged_with_whether_the_lease_was_held(
        prefill: tuple[SideChannelListener, list[Rank]]) -> None:
    listener, ranks = prefill
    ranks[0].table.hold("L", [3], readers=1, ttl=60)
    with SideChannelClient("decode-a", COMPAT, KEY) as client:
        assert client.report_done(HOST, listener.port, DoneReport(0, done("L")))
        assert not ranks[0].table.holds("L")
        assert not client.report_done(HOST, listener.port, DoneReport(0, done("L"))), \
            "ended already: acknowledged, nothing changed"
        with pytest.raises(PeerRefused, match=r"unknown_rank.*not 5"):
            client.report_done(HOST, listener.port, DoneReport(5, done("L")))


def test_an_unsigned_report_ends_no_lease(prefill: tuple[SideChannelListener, list[Rank]]) -> None:
    listener, ranks = prefill
    ranks[0].table.hold("L", [3], readers=1, ttl=60)
    with SideChannelClient("decode-a", COMPAT, None) as client, \
            pytest.raises(PeerRefused, match="authentication failed"):
        client.report_done(HOST, listener.port, DoneReport(0, done("L")))
    assert ranks[0].table.holds("L")


def test_a_listener_without_leases_refuses_reports() -> None:
    with SideChannelListener(HOST, engine_id="no-leases", compat=COMPAT,
                           metadata=lambda: []) as listener, \
            SideChannelClient("decode-a", COMPAT) as client, \
            pytest.raises(PeerRefused, match="holds no leases"):
        client.report_done(HOST, listener.port, DoneReport(0, done("L")))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _wait_for_answer(sender: SideChannelSender, timeout: float = 5.0) -> None:
    """The listener ends the lease before its answer reaches the sender: wait for that."""
    deadline = time.monotonic() + timeout
    while not (sender.sent or sender.failed) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_an_unanswered_report_is_resent_until_the_prefill_answers() -> None:
    """Nothing listens when the report is first sent; the listener comes up before the
    second resend, and the lease ends by the resent report."""
    port = free_port()
    rank = Rank(0)
    rank.table.hold("L", [3], readers=1, ttl=60)
    answers = LeaseAnswers([rank], ttl=10.0, max_age=40.0)
    sender = SideChannelSender(SideChannelClient("decode-a", COMPAT))
    try:
        assert sender.submit_done(HOST, port, DoneReport(0, done("L")))
        time.sleep(DONE_RESENDS_S[0] / 2)  # the first attempt found nobody
        assert rank.table.holds("L")
        with SideChannelListener(HOST, port, engine_id="late", compat=COMPAT,
                               metadata=lambda: [], on_done=answers.on_done):
            deadline = time.monotonic() + sum(DONE_RESENDS_S)
            while rank.table.holds("L") and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not rank.table.holds("L"), "the resent report did not end the lease"
            _wait_for_answer(sender)  # the lease ends before the sender reads the answer
        assert sender.sent == 1 and sender.failed == 0
    finally:
        sender.close()


def test_a_refused_report_is_not_resent() -> None:
    calls: list[DoneReport] = []

    def refuse(report: DoneReport, _requester: str) -> bool:
        calls.append(report)
        raise ValueError("not served here")

    with SideChannelListener(HOST, engine_id="refuses", compat=COMPAT, metadata=lambda: [],
                           on_done=refuse) as listener:
        sender = SideChannelSender(SideChannelClient("decode-a", COMPAT))
        try:
            sender.submit_done(HOST, listener.port, DoneReport(0, done("L")))
            deadline = time.monotonic() + 5
            while not sender.failed and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(DONE_RESENDS_S[0] * 2)
            assert sender.failed == 1 and len(calls) == 1
        finally:
            sender.close()


def test_a_release_ends_the_lease_as_its_outcome_says() -> None:
    """A decode whose prefix cache held the whole prompt releases with ``cached``; the
    prefill's owner thread ends the lease so (``leases_released{reason="cached"}``), not
    as abandoned; any other release is ``abandoned``."""
    ranks = [Rank(0), Rank(1)]
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    for rank in ranks:
        rank.table.hold("hit", [3], readers=1, ttl=60)
        rank.table.hold("refused", [4], readers=1, ttl=60)
    with SideChannelListener(HOST, engine_id="prefill-r", compat=COMPAT, metadata=lambda: [],
                           hmac_key=KEY, on_release=answers.on_release) as listener, \
            SideChannelClient("decode-a", COMPAT, KEY) as client:
        assert client.release(HOST, listener.port, "hit", "its prefix cache holds it",
                              outcome=ReleaseOutcome.CACHED)
        assert client.release(HOST, listener.port, "refused", "the request was refused")
    assert [r.outcome for r in answers.take_releases()] == [ReleaseOutcome.CACHED,
                                                           ReleaseOutcome.ABANDONED]
    for rank in ranks:
        assert {r.request_id: r.reason for r in rank.table.take_released()} == {
            "hit": "cached", "refused": "abandoned"}


def test_a_release_queued_before_a_decode_claimed_the_lease_keeps_it() -> None:
    """The holder of the params releases an unclaimed lease; before the owner's thread
    carries it out a decode claims it: the lease is that decode's now, and stays."""
    ranks = [Rank(0), Rank(1)]
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    for rank in ranks:
        rank.table.hold("L", [3], readers=1, ttl=60)
    assert answers.on_release("L", "params-holder", "no decode took it")
    assert answers.on_renew("L", "decode-a", True) > 0
    assert answers.take_releases() == []
    assert all(rank.table.holds("L") for rank in ranks)


class _LosesFirst:
    """Stands in for the listener process's :data:`~kvxfer.transfer.faults.LOSS`: loses the
    first ``count`` messages of ``kind`` it receives."""

    def __init__(self, kind: str, count: int) -> None:
        self.kind, self.left = kind, count

    def drop(self, kind: str) -> bool:
        if kind != self.kind or self.left <= 0:
            return False
        self.left -= 1
        return True


def test_a_report_lost_again_and_again_is_resent_until_it_ends_the_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More losses in a row than there are distinct pauses: the last pause repeats while
    the lease could still be held, so the lease ends by the report, not by its TTL."""
    from kvxfer.transfer.side_channel import listener as listener_module

    lost = _LosesFirst("done", len(DONE_RESENDS_S) + 2)
    monkeypatch.setattr(listener_module, "LOSS", lost)
    rank = Rank(0)
    rank.table.hold("L", [3], readers=1, ttl=60)
    answers = LeaseAnswers([rank], ttl=10.0, max_age=40.0)
    with SideChannelListener(HOST, engine_id="lossy", compat=COMPAT, metadata=lambda: [],
                           on_done=answers.on_done) as listener:
        sender = SideChannelSender(SideChannelClient("decode-a", COMPAT))
        try:
            assert sender.submit_done(HOST, listener.port, DoneReport(0, done("L")),
                                      expires_in=60.0)
            deadline = time.monotonic() + 20
            while rank.table.holds("L") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not rank.table.holds("L"), "the resent report did not end the lease"
            _wait_for_answer(sender)
            assert lost.left == 0 and sender.sent == 1 and sender.failed == 0
        finally:
            sender.close()


def test_an_unanswered_report_is_given_up_when_its_lease_would_have_ended() -> None:
    port = free_port()  # nothing listens there
    sender = SideChannelSender(SideChannelClient("decode-a", COMPAT))
    try:
        assert sender.submit_done(HOST, port, DoneReport(0, done("L")), expires_in=0.4)
        deadline = time.monotonic() + 10
        while not sender.failed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sender.failed == 1 and sender.sent == 0
    finally:
        sender.close()


# -- who sends them: the decode's reader, through the instance's reports -------------------

class Landed(ReadPath):
    """A read path whose bytes are all in place (its READ carried no notification)."""

    def post(self) -> None:
        pass

    def progress(self) -> Progress:
        return LANDED

    def finish(self) -> None:
        pass

    def abandon(self, reason: str) -> None:
        pass


class Queued:
    """The instance's ``Reports`` as the reader sees it: records each "done" queued."""

    def __init__(self) -> None:
        self.done_calls: list[tuple[str, int, DoneReport, float]] = []

    def done(self, host: str, port: int, report: DoneReport, lease_ends: float) -> bool:
        self.done_calls.append((host, port, report, lease_ends))
        return True


def finished_read(remote: RemoteParams, lease_ends: float) -> tuple[Queued, Any]:
    """A read of ``remote``'s lease from every prefill rank finished by one decode rank's
    reader: the reports it queued, and what it told its caller."""
    local = SimpleNamespace(rank=0, engine_id="decode-a", deadlines=Deadlines(1.0, 0, 30.0),
                            wake=threading.Event(), tally=Tally())
    ranks = range(remote.tp_size)
    peer = SimpleNamespace(
        agents=dict.fromkeys(ranks, b"agent"), engine_id=remote.remote_engine_id,
        tell=lambda *_a, **_k: True,
        reports=lambda _local, lease, ok: tuple(DoneReport(rank, done(lease, ok=ok))
                                                for rank in ranks))
    peers = SimpleNamespace(get=lambda _engine: peer, dead=lambda _engine: None,
                            drop_forgotten=lambda: None, finished=lambda: [],
                            forget_dead=lambda *_a: None)
    queued, results = Queued(), ReadResults()
    reader = Reader(local, peers, results, queued)  # type: ignore[arg-type]
    now = time.monotonic()
    reader.inflight.append(Read("r", remote, np.array([5]), started=now, posted=now,
                                paths=[Landed(list(ranks))], lease_ends=lease_ends))
    reader.step()
    return queued, results.take()


def ranks_apart() -> RemoteParams:
    """A TP 2 prefill whose ranks listen apart (a vLLM instance: a process per rank)."""
    return RemoteParams("prefill-x", HOST, 5600, (0, 1), "lease-1", 2, 20, time.time() + 60.0,
                        remote_rank_ports=(5600, 5611))


def test_each_done_report_goes_to_the_port_serving_its_prefill_rank() -> None:
    """Ranks listening apart: rank 1's report goes to rank 1's port only; one port for
    every rank: both go there. Nothing is released."""
    ends = time.monotonic() + 42.0
    queued, result = finished_read(ranks_apart(), ends)
    assert result.finished == ["r"] and not result.unnotified
    assert [(port, report.prefill_rank) for _, port, report, _ in queued.done_calls] == \
        [(5600, 0), (5611, 1)]
    assert all(report.done.ok and report.done.request_id == "lease-1"
               for *_, report, _ in queued.done_calls)
    # resent while unanswered for as long as the lease may be held (the read's lease end)
    assert [lease_ends for *_, lease_ends in queued.done_calls] == [ends, ends]
    one_port = RemoteParams("prefill-x", HOST, 5600, (0, 1), "lease-1", 2, 20,
                            time.time() + 60.0)
    queued, _ = finished_read(one_port, ends)
    assert [(port, report.prefill_rank) for _, port, report, _ in queued.done_calls] == \
        [(5600, 0), (5600, 1)]


class Submitted:
    """A sender that records each "done" submitted and its resend window."""

    def __init__(self) -> None:
        self.windows: list[float | None] = []

    def submit_done(self, host: str, port: int, report: DoneReport,
                    expires_in: float | None = None) -> bool:
        self.windows.append(expires_in)
        return True


def test_a_report_is_resent_while_its_lease_may_be_held_and_not_queued_once_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reports = Reports("decode-a", COMPAT, None)
    sender = Submitted()
    monkeypatch.setattr(reports, "_sender", lambda _lease: sender)  # the lease's sender
    report = DoneReport(0, done("L"))
    assert reports.done(HOST, 5600, report, time.monotonic() + 42.0)
    assert reports.done(HOST, 5600, report, time.monotonic() + 1.0)
    long, short = sender.windows
    assert long is not None and 41.0 < long <= 42.0, "as long as the lease's deadline says"
    assert short == DONE_RESEND_FOR_S, "and at least this long"
    closed = Reports("decode-a", COMPAT, None)
    closed.close()
    assert not closed.done(HOST, 5600, report, time.monotonic() + 42.0), \
        "a report not queued is said"
