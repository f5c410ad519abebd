"""The prefill's side-channel lease answers (:mod:`kvxfer.transfer.leases`), alone.

Its ranks are stand-ins with the lease methods of ``TransferWorker`` (the real
workers answer in ``test_connector_renewal`` and ``test_vllm_worker_side``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvxfer.transfer.leases import LeaseAnswers, Release
from kvxfer.wire.messages import RenewRefused


@dataclass
class Rank:
    """One rank's leases: lease id -> claimer (None: unclaimed); ``answer`` is what
    ``renew`` returns (seconds) or, a str, the refusal it raises."""

    leases: dict[str, str | None] = field(default_factory=dict)
    answer: float | str = 5.0
    renewed: list[tuple[str, float, str, bool, float]] = field(default_factory=list)
    ended: list[tuple[str, str]] = field(default_factory=list)

    def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
              max_age: float = float("inf")) -> float:
        self.renewed.append((request_id, ttl, requester, claim, max_age))
        if isinstance(self.answer, str):
            raise RenewRefused(self.answer)
        return self.answer

    def may_end(self, request_id: str, requester: str) -> bool:
        return self.leases.get(request_id) in (None, requester)

    def holds_lease(self, request_id: str) -> bool:
        return request_id in self.leases

    def end_lease(self, request_id: str, reason: str = "abandoned", *,
                  claimers: tuple[str | None, ...] | None = None) -> bool:
        if request_id not in self.leases or \
                (claimers is not None and self.leases[request_id] not in claimers):
            return False
        del self.leases[request_id]
        self.ended.append((request_id, reason))
        return True


def test_a_renewal_asks_every_rank_and_answers_the_least_time_left() -> None:
    ranks = [Rank(answer=5.0), Rank(answer=3.5)]
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    assert answers.on_renew("L", "decode-a", True) == 3.5
    assert [r.renewed for r in ranks] == [[("L", 10.0, "decode-a", True, 40.0)]] * 2


def test_a_renewal_any_rank_refuses_is_refused_with_its_reason() -> None:
    ranks = [Rank(answer=5.0), Rank(answer="another decode claimed it first"), Rank(answer="x")]
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    with pytest.raises(RenewRefused, match=r"^another decode claimed it first$"):
        answers.on_renew("L", "decode-b", False)


def test_a_release_from_another_than_the_claimer_is_ignored() -> None:
    ranks = [Rank({"L": "decode-a"}), Rank({"L": "decode-b"})]
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    assert not answers.on_release("L", "decode-a", "not mine on rank 1")
    assert answers.take_releases() == []
    assert all(r.ended == [] for r in ranks)


def test_a_release_ends_the_lease_on_every_rank_still_holding_it() -> None:
    ranks = [Rank({"L": "decode-a"}), Rank()]  # rank 1 ended it already
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    assert answers.on_release("L", "decode-a", "the request was aborted"), "held"
    assert ranks[0].ended == [], "the listener's thread only queues it"
    assert answers.take_releases() == [Release("L", "decode-a", "the request was aborted")]
    assert ranks[0].ended == [("L", "abandoned")] and ranks[1].ended == []


def test_a_release_of_a_lease_nobody_holds_changes_nothing() -> None:
    ranks = [Rank(), Rank()]
    answers = LeaseAnswers(ranks, ttl=10.0, max_age=40.0)
    assert not answers.on_release("never-held", "decode-a", "why not"), "not held"
    assert answers.take_releases() == []
    ranks[0].leases["unclaimed"] = None
    assert answers.on_release("unclaimed", "decode-b", "anyone may end an unclaimed lease")
    assert [(r.lease_id, r.requester) for r in answers.take_releases()] == [
        ("unclaimed", "decode-b")]
    assert ranks[0].ended == [("unclaimed", "abandoned")]


def test_a_claim_that_lands_as_a_release_of_an_unclaimed_lease_is_taken_keeps_the_lease() -> None:
    """Real lease tables. A release of an unclaimed lease is queued; a decode claims the
    lease just as the owner's thread takes the release (here: on its first look at the
    lease). The claimer keeps it: the release checks the claimer in the same step as it
    ends the lease, never in a step before, or the claimer would read freed blocks."""
    from kvxfer.transfer.leases import LeaseTable
    from kvxfer.transfer.results import Tally

    class Racing:
        """A worker's lease methods over a real table; decode-b's claim lands as soon as
        anything but the listener looks at the lease."""

        rank = 0

        def __init__(self) -> None:
            self.table = LeaseTable(None, Tally())
            self.table.hold("L", [3], readers=1, ttl=60)
            self.racing = False

        def _claim(self) -> None:
            if self.racing:
                self.racing = False
                self.table.renew("L", 10.0, "decode-b", claim=True)

        def may_end(self, request_id: str, requester: str) -> bool:
            answer = self.table.may_end(request_id, requester)
            self._claim()
            return answer

        def holds_lease(self, request_id: str) -> bool:
            return self.table.holds(request_id)

        def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
                  max_age: float = float("inf")) -> float:
            return self.table.renew(request_id, ttl, requester, claim=claim, max_age=max_age)

        def end_lease(self, request_id: str, reason: str = "abandoned", *,
                      claimers: tuple[str | None, ...] | None = None) -> bool:
            self._claim()
            return self.table.end(request_id, reason, claimers=claimers)

    rank = Racing()
    answers = LeaseAnswers([rank], ttl=10.0, max_age=40.0)  # type: ignore[list-item]
    assert answers.on_release("L", "decode-a", "the holder of its params gave up"), "held"
    rank.racing = True
    assert answers.take_releases() == []
    assert rank.table.holds("L") and rank.table.claimer("L") == "decode-b"
