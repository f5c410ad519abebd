"""The decode's lease client (:mod:`kvxfer.transfer.lease_client`), one module alone.

Its renewer and the instance's reports (which send its releases) are stand-ins that
record what would go on the side channel and let the test answer each claim or renewal
as the prefill would (granted, refused, none); the real senders and listeners are
covered by the pull decode's and WorkerSide's tests. A read's "done" reports are no
longer the lease client's to send (the worker's reader sends them: test_done_reports).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kvxfer.transfer.lease_client import (
    Answer,
    LeaseAnswer,
    LeaseClient,
    LeaseEnded,
    Readiness,
)
from kvxfer.wire.lease_book import HeldLease, LeaseBook, LeaseRefused
from kvxfer.wire.messages import ReleaseOutcome, RenewAck
from kvxfer.wire.params import RemoteParams

Done = Callable[[RenewAck | None, float, str], None]
READ_TIMEOUT = 1.0


@dataclass
class Sender:
    """Records renewals (``SideChannelSender``'s queueing API) and releases (the queueing
    API of the instance's ``Reports``); ``accept`` False refuses to queue, as a full or
    closed sender does. One stand-in may play both."""

    accept: bool = True
    releases: list[tuple[str, str]] = field(default_factory=list)
    renewals: list[tuple[str, bool, Done]] = field(default_factory=list)
    closed: int = 0
    ports: list[int] = field(default_factory=list)  # where each queued one goes

    def release(self, host: str, port: int, lease_id: str, reason: str,
                outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        if self.accept:
            self.releases.append((lease_id, reason))
            self.ports.append(port)
        return self.accept

    def submit_renew(self, host: str, port: int, lease_id: str, done: Done, *,
                     claim: bool = False) -> bool:
        if self.accept:
            self.renewals.append((lease_id, claim, done))
            self.ports.append(port)
        return self.accept

    def close(self) -> None:
        self.closed += 1

    def answer(self, ack: RenewAck | None, why: str = "", sent_at: float | None = None) -> None:
        """Answer the oldest claim or renewal not answered yet."""
        *_, done = self.renewals.pop(0)
        done(ack, time.monotonic() if sent_at is None else sent_at, why)


def params(lease_id: str = "lease-1", expires_in: float = 60.0) -> RemoteParams:
    return RemoteParams("prefill-x", "127.0.0.1", 5600, (0, 1), lease_id, 1, 20,
                        time.time() + expires_in)


def client(sender: Sender, renewer: Sender | None = None) -> LeaseClient:
    """A lease client releasing through ``sender`` and claiming and renewing through
    ``renewer`` (``sender`` too when None)."""
    return LeaseClient(LeaseBook(None, max_age=600.0), sender,  # type: ignore[arg-type]
                       renewer or sender, read_timeout=READ_TIMEOUT)  # type: ignore[arg-type]


def granted(seconds: float, lease_id: str = "lease-1") -> RenewAck:
    return RenewAck(lease_id, True, seconds)


def refused(why: str, lease_id: str = "lease-1") -> RenewAck:
    return RenewAck(lease_id, False, 0.0, why)


def claimed(leases: LeaseClient, sender: Sender, remote: RemoteParams,
            seconds: float = 30.0) -> HeldLease:
    lease = leases.check(remote)
    assert leases.claim(remote, lease)
    sender.answer(granted(seconds, remote.remote_request_id))
    leases.take_answers()
    return lease


def test_check_marks_a_lease_used_and_refuses_it_again() -> None:
    leases = client(Sender())
    remote = params()
    lease = leases.check(remote)
    assert not lease.claimed and lease.ttl == pytest.approx(60.0, abs=1.0)
    with pytest.raises(LeaseRefused, match="already used"):
        leases.check(remote)
    with pytest.raises(LeaseRefused, match="in the past"):
        leases.check(params("lease-old", expires_in=-1.0))


def test_a_granted_claim_takes_its_deadline_from_the_answer() -> None:
    sender = Sender()
    leases, remote = client(sender), params()
    lease = leases.check(remote)
    assert leases.readiness(lease) is Readiness.WAIT, "not read before the claim is granted"
    assert leases.claim(remote, lease)
    assert [(lid, claim) for lid, claim, _ in sender.renewals] == [("lease-1", True)]
    sent_at = time.monotonic()
    sender.answer(granted(30.0), sent_at=sent_at)
    assert leases.wait_for_answer(0.0), "an answer is queued"
    [answer] = leases.take_answers()
    assert answer == LeaseAnswer("lease-1", True, Answer.GRANTED, sent_at, expires_in=30.0)
    assert lease.claimed and not lease.renewing and lease.lost is None
    assert lease.deadline == sent_at + 30.0 and lease.ttl == 30.0
    assert leases.readiness(lease) is Readiness.READ
    assert not leases.wait_for_answer(0.0), "taken"


def test_a_refused_claim_loses_the_lease_and_says_it_was_the_claim() -> None:
    sender = Sender()
    leases, remote = client(sender), params()
    lease = leases.check(remote)
    leases.claim(remote, lease)
    sender.answer(refused("another decode claimed it first"),
                  why="another decode claimed it first")
    [answer] = leases.take_answers()
    assert answer.answer is Answer.REFUSED and answer.claim
    assert lease.refused and not lease.claimed
    assert lease.lost == ("the prefill no longer holds it for this decode (another decode "
                          "claimed it first)")
    assert leases.readiness(lease) is Readiness.ENDED
    leases.renew_due([(remote, lease)])
    assert sender.renewals == [], "a lost lease is never claimed again"


def test_an_unanswered_claim_is_lost_and_not_retried() -> None:
    sender = Sender()
    leases, remote = client(sender), params()
    lease = leases.check(remote)
    leases.claim(remote, lease)
    sender.answer(None, why="cannot connect")
    [answer] = leases.take_answers()
    assert answer.answer is Answer.UNANSWERED
    assert lease.lost == "the prefill did not answer this decode's claim: cannot connect"
    assert not lease.refused, "unanswered is not refused: the request fails as a failed read"
    leases.renew_due([(remote, lease)])
    assert sender.renewals == []


def test_renewals_are_due_under_half_the_ttl_and_one_at_a_time() -> None:
    sender = Sender()
    leases, remote = client(sender), params()
    lease = claimed(leases, sender, remote, seconds=10.0)
    now = time.monotonic()
    leases.renew_due([(remote, lease)], now=now)
    assert sender.renewals == [], "10 s of 10 left: not due"
    leases.renew_due([(remote, lease)], now=now + 6.0)
    leases.renew_due([(remote, lease)], now=now + 6.0)
    assert [(lid, claim) for lid, claim, _ in sender.renewals] == [("lease-1", False)], \
        "one renewal, not a claim, and only one in flight"
    sender.answer(granted(10.0), sent_at=now + 6.0)
    leases.take_answers()
    assert lease.deadline == pytest.approx(now + 16.0) and not lease.renewing


def test_an_unanswered_renewal_is_retried_and_a_refused_one_loses_the_lease() -> None:
    sender = Sender()
    leases, remote = client(sender), params()
    lease = claimed(leases, sender, remote, seconds=10.0)
    later = time.monotonic() + 6.0
    leases.renew_due([(remote, lease)], now=later)
    sender.answer(None, why="timed out")
    leases.take_answers()
    assert lease.lost is None and lease.claimed, "a failed renewal is retried"
    leases.renew_due([(remote, lease)], now=later)
    sender.answer(refused("it reached the maximum lease age"),
                  why="it reached the maximum lease age")
    [answer] = leases.take_answers()
    assert answer.answer is Answer.REFUSED and not answer.claim
    assert "maximum lease age" in str(lease.lost)
    assert not lease.refused, "a refused renewal is not a refused claim"


def test_a_claim_that_could_not_be_queued_is_sent_by_renew_due() -> None:
    sender = Sender(accept=False)
    leases, remote = client(sender), params()
    lease = leases.check(remote)
    assert not leases.claim(remote, lease), "the queue is full"
    assert not lease.renewing
    sender.accept = True
    leases.renew_due([(remote, lease)])
    assert [(lid, claim) for lid, claim, _ in sender.renewals] == [("lease-1", True)]
    assert leases.claim(remote, lease), "one is on its way already"
    assert len(sender.renewals) == 1


def test_claims_and_renewals_go_to_the_renewer_releases_to_the_reports() -> None:
    reports, renewer = Sender(), Sender()
    leases, remote = client(reports, renewer), params()
    leases.claim(remote, leases.check(remote))
    assert leases.release(remote, "not needed")
    assert reports.renewals == [] and len(renewer.renewals) == 1
    assert reports.releases == [("lease-1", "not needed")] and renewer.releases == []
    leases.close()
    leases.close()
    assert (reports.closed, renewer.closed) == (0, 1), \
        "the renewer closed once; the reports are the instance's to close"
    assert not leases.release(remote, "too late") and not leases.claim(remote, HeldLease(0, 1))


def test_a_lease_needs_enough_left_for_a_read_and_ends_at_its_deadline() -> None:
    sender = Sender()
    leases, remote = client(sender), params()
    lease = claimed(leases, sender, remote, seconds=30.0)
    end = lease.deadline
    assert leases.readiness(lease, now=end - READ_TIMEOUT - 0.2) is Readiness.READ
    assert leases.readiness(lease, now=end - READ_TIMEOUT) is Readiness.WAIT, \
        "less than the read timeout left: renew first"
    assert leases.readiness(lease, now=end) is Readiness.ENDED


def test_a_lease_that_ended_is_not_read_and_a_read_that_outlived_it_is_not_used() -> None:
    sender = Sender()
    leases, remote = client(sender), params()
    lease = claimed(leases, sender, remote, seconds=30.0)
    leases.check_unread(remote, lease)
    leases.check_in_time(remote, lease)
    with pytest.raises(LeaseEnded, match="lease lease-1 of prefill prefill-x was not read: "
                                         "the lease expired"):
        leases.check_unread(remote, lease, now=lease.deadline + 1.0)
    with pytest.raises(LeaseEnded, match=r"its KV is not used: the lease ended 2\.000 s before "
                                         r"the read did") as ended:
        leases.check_in_time(remote, lease, now=lease.deadline + 2.0)
    assert ended.value.lease_id == "lease-1"
    lease.lost = "the prefill no longer holds it for this decode (gone)"
    with pytest.raises(LeaseEnded, match=r"was not read: the prefill no longer holds it"):
        leases.check_unread(remote, lease)


def test_a_named_lease_is_released_only_when_this_decode_may_claim_it() -> None:
    sender = Sender()
    leases = client(sender)
    assert not leases.release_named(params("lease-old", expires_in=-1.0), "refused")
    assert leases.release_named(params("lease-new"), "refused")
    assert not leases.release_named(params("lease-new"), "refused again"), "used once"
    assert sender.releases == [("lease-new", "refused")]


def test_the_release_after_a_failed_read_says_why() -> None:
    sender = Sender()
    leases, remote = client(sender), params()
    leases.release_after_failed_read(remote, "rank 0 could not start its READ")
    assert [reason for _, reason in sender.releases] == [
        "the decode's KV read failed: rank 0 could not start its READ"]


def ranks_apart(lease_id: str = "lease-1") -> RemoteParams:
    """A TP 2 prefill whose ranks listen apart (a vLLM instance: a process per rank)."""
    return RemoteParams("prefill-x", "127.0.0.1", 5600, (0, 1), lease_id, 2, 20,
                        time.time() + 60.0, remote_rank_ports=(5600, 5611))


def test_a_lease_of_ranks_listening_apart_is_claimed_at_each_for_the_least_time() -> None:
    sender = Sender()
    leases, remote = client(sender), ranks_apart()
    lease = leases.check(remote)
    assert leases.claim(remote, lease)
    assert sender.ports == [5600, 5611] and [c for _, c, _ in sender.renewals] == [True, True]
    sent_at = time.monotonic()
    sender.answer(granted(30.0), sent_at=sent_at)
    assert leases.take_answers() == [] and not lease.claimed, "rank 1 has not answered"
    sender.answer(granted(20.0), sent_at=sent_at + 0.5)
    [answer] = leases.take_answers()
    assert answer.answer is Answer.GRANTED and answer.expires_in == 20.0
    assert lease.claimed and lease.deadline == sent_at + 20.0, "the earliest send, least time"


@pytest.mark.parametrize("second", [refused("it ended"), None])
def test_a_lease_one_rank_refuses_or_leaves_unanswered_is_lost(second: RenewAck | None) -> None:
    sender = Sender()
    leases, remote = client(sender), ranks_apart()
    lease = leases.check(remote)
    leases.claim(remote, lease)
    sender.answer(granted(30.0))
    sender.answer(second, why="it ended" if second else "timed out")
    [answer] = leases.take_answers()
    assert answer.answer is (Answer.REFUSED if second else Answer.UNANSWERED)
    assert "port 5611" in answer.why and not lease.claimed and lease.lost is not None
    assert leases.readiness(lease) is Readiness.ENDED
    # rank 0 holds it for this decode: released at every port, not left to its TTL
    assert sender.ports[2:] == [5600, 5611]
    assert [reason for _, reason in sender.releases] == [
        f"the claim was refused by another prefill rank: {answer.why}"] * 2


def test_a_claim_every_rank_refuses_is_not_released() -> None:
    sender = Sender()
    leases, remote = client(sender), ranks_apart()
    leases.claim(remote, leases.check(remote))
    sender.answer(refused("another decode claimed it first"))
    sender.answer(refused("another decode claimed it first"))
    [answer] = leases.take_answers()
    assert answer.answer is Answer.REFUSED and sender.releases == [], "maybe another's"


def test_a_lease_of_ranks_listening_apart_is_released_at_each() -> None:
    sender = Sender()
    leases = client(sender)
    assert leases.release(ranks_apart(), "the decode shut down")
    assert sender.ports == [5600, 5611]
    assert sender.releases == [("lease-1", "the decode shut down")] * 2
