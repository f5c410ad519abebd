"""``Claimers`` (:mod:`kvxfer.sidecar.roles.claimers`) against real side channels: a push-mode
decode learns where each prefill that claimed a reservation answers, and asks there,
with a real ``SideChannelClient``, whether that prefill still runs.

The prefill is a loopback instance (real workers and listener in this process); the
claim goes over a real ZMQ connection to a decode's real listener."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from stub_upstream import wait_until

from kvxfer.harness.loopback import CacheConfig, LoopbackInstance
from kvxfer.sidecar.roles.claimers import Claimers
from kvxfer.transfer.side_channel.client import SideChannelClient

CFG = CacheConfig(num_blocks=8)
PROBE_S = 0.2  # probes this often here (a sidecar: PROBE_EVERY_S), so that waits are short


@pytest.fixture
def prefill() -> Iterator[LoopbackInstance]:
    inst = LoopbackInstance.create("prefill", CFG)
    try:
        yield inst
    finally:
        inst.close()


class CountedClaimers(Claimers):
    """``Claimers`` that count, per engine, the probes whose verdict is in."""

    def __init__(self, client: SideChannelClient, probe_every: float) -> None:
        super().__init__(client, probe_every)
        self.answered: Counter[str] = Counter()
        submit = self._pool.submit

        def counted(probe: Any, engine_id: str, *args: Any) -> Future[str | None]:
            future = submit(probe, engine_id, *args)
            future.add_done_callback(lambda _: self.answered.update([engine_id]))
            return future

        self._pool.submit = counted  # type: ignore[method-assign]


@pytest.fixture
def claimers() -> Iterator[CountedClaimers]:
    made = CountedClaimers(SideChannelClient("decode-probing", CFG.compat(), CFG.hmac_key),
                           PROBE_S)
    try:
        yield made
    finally:
        made.close()


def wait_seen(claimers: Claimers, engine_id: str) -> None:
    """Until a probe found ``engine_id`` answering at its side channel as itself."""
    wait_until(lambda: claimers._claimers[engine_id].seen, 10.0,
               f"a probe to find {engine_id} answering as itself")


def settle(claimers: CountedClaimers, engine_id: str, probes: int = 2
           ) -> tuple[str, float] | None:
    """What ``gone`` says once ``probes`` more probes of ``engine_id`` were answered (the
    first may have been under way already), or once it is known gone; for a claimer that
    is never probed, what it says after as long as those probes take."""
    deadline = time.monotonic() + probes * PROBE_S + 2.0
    enough = claimers.answered[engine_id] + probes
    while time.monotonic() < deadline:
        gone = claimers.gone(engine_id)
        if gone is not None:
            return gone
        if claimers.answered[engine_id] >= enough:
            return claimers.gone(engine_id)  # the last verdict is in: gone() takes it
        time.sleep(0.05)
    return None


def test_a_claimer_that_answers_as_itself_is_not_gone(prefill: LoopbackInstance,
                                                      claimers: Claimers) -> None:
    claimers.heard(prefill.engine_id, ("127.0.0.1", prefill.port))
    assert settle(claimers, prefill.engine_id) is None


def test_a_claimer_whose_side_channel_refuses_is_gone_since_the_probe_saw_it(
        prefill: LoopbackInstance, claimers: Claimers) -> None:
    claimers.heard(prefill.engine_id, ("127.0.0.1", prefill.port))
    wait_seen(claimers, prefill.engine_id)  # the claim's own probe: it answers as itself
    assert claimers.gone(prefill.engine_id) is None
    prefill.close()
    before = time.monotonic()
    gone = settle(claimers, prefill.engine_id)
    assert gone is not None and "no longer runs" in gone[0], gone
    assert before <= gone[1] <= time.monotonic()
    assert claimers.gone(prefill.engine_id) == gone  # known gone stays gone


def test_another_engine_answering_at_the_claimers_side_channel_means_it_restarted(
        prefill: LoopbackInstance, claimers: Claimers) -> None:
    from kvxfer.transfer.side_channel.listener import SideChannelListener

    port = prefill.port
    claimers.heard(prefill.engine_id, ("127.0.0.1", port))
    wait_seen(claimers, prefill.engine_id)
    prefill.close()
    restarted = SideChannelListener("127.0.0.1", port, engine_id="restarted-prefill",
                                  compat=CFG.compat(), metadata=list).start()
    try:
        gone = settle(claimers, prefill.engine_id)
        assert gone is not None and "restarted-prefill" in gone[0], gone
    finally:
        restarted.close()


def test_an_address_that_never_answered_as_the_claimer_proves_nothing(
        prefill: LoopbackInstance, claimers: Claimers) -> None:
    """A claim names a side channel that some other engine serves, or that nothing
    serves at all (a wrong --advertise-host, say): neither makes the claimer gone, so a
    WRITE it may still have in flight keeps its blocks out of use."""
    claimers.heard("claimed-from-elsewhere", ("127.0.0.1", prefill.port))
    claimers.heard("claimed-from-nowhere", ("127.0.0.1", 1))  # nothing listens on port 1
    assert settle(claimers, "claimed-from-elsewhere", probes=1) is None
    assert settle(claimers, "claimed-from-nowhere", probes=1) is None


def test_the_first_side_channel_an_engine_named_is_the_one_probed(
        prefill: LoopbackInstance, claimers: Claimers) -> None:
    """A later claim naming another address for the same engine (a peer with the key
    pretending to be it, say) does not move where it is probed."""
    claimers.heard(prefill.engine_id, ("127.0.0.1", prefill.port))
    claimers.heard(prefill.engine_id, ("127.0.0.1", 1))
    assert settle(claimers, prefill.engine_id) is None


def test_a_claimer_nobody_heard_of_is_never_probed(claimers: Claimers) -> None:
    assert settle(claimers, "never-claimed", probes=1) is None


def test_a_decode_listener_hands_over_where_a_granted_claimer_answers(
        prefill: LoopbackInstance, claimers: Claimers) -> None:
    """The claim names the claimer's side channel: the decode's listener hands it to
    ``on_claimer`` once the claim is granted, never for a refused one."""
    from kvxfer.transfer.leases import ReservationAnswers
    from kvxfer.transfer.side_channel.listener import SideChannelListener

    decode = LoopbackInstance.create("decode", CFG)
    heard: list[tuple[str, tuple[str, int]]] = []
    listener = SideChannelListener(
        "127.0.0.1", 0, engine_id=decode.engine_id, compat=CFG.compat(),
        metadata=lambda: [w.metadata() for w in decode.workers],
        on_renew=ReservationAnswers(decode.workers, 30.0).on_renew,
        on_claimer=lambda engine, at: heard.append((engine, at))).start()
    try:
        for worker in decode.workers:
            worker.hold("resv", [1], readers=None, ttl=30)
        with SideChannelClient("writer", CFG.compat(), CFG.hmac_key) as writer, \
                SideChannelClient("late-writer", CFG.compat(), CFG.hmac_key) as late:
            assert writer.renew("127.0.0.1", listener.port, "resv", claim=True,
                                side_channel=("10.0.0.7", 4321)).found
            assert not late.renew("127.0.0.1", listener.port, "resv", claim=True,
                                  side_channel=("10.0.0.8", 4321)).found
        assert heard == [("writer", ("10.0.0.7", 4321))]
        # the claim keeps the reservation past the deadline it was held with
        assert decode.workers[0].lease_claimer("resv") == "writer"
    finally:
        listener.close()
        decode.close()


def test_a_claimed_reservation_outlives_its_deadline_and_is_not_polled_for_past_it() -> None:
    """A claim keeps a reservation's lease up to the stale limit; past the deadline it
    was held with, the worker no longer polls fast for it (``awaited``): its writer's
    word may be minutes away."""
    from kvxfer.transfer.leases import LeaseTable
    from kvxfer.transfer.results import STALE_LIMIT_S, Tally

    table = LeaseTable(None, Tally())
    table.hold("resv", [1], None, ttl=0.2)
    table.hold("other", [2], None, ttl=0.2)
    assert table.awaited() == 2
    assert table.renew("resv", STALE_LIMIT_S, "writer", claim=True) > STALE_LIMIT_S - 1
    time.sleep(0.3)
    table.expire()
    assert [r.request_id for r in table.take_released()] == ["other"]
    assert table.holds("resv") and table.claimer("resv") == "writer"
    assert table.awaited() == 0


def test_a_reservation_is_claimed_once_before_its_deadline_and_never_renewed() -> None:
    from kvxfer.transfer.leases import LeaseTable, ReservationAnswers
    from kvxfer.transfer.results import Tally
    from kvxfer.wire.messages import RenewRefused

    decode = LoopbackInstance.create("decode", CFG)
    try:
        answers = ReservationAnswers(decode.workers, 30.0)
        for worker in decode.workers:
            worker.hold("resv", [1], readers=None, ttl=30)
        with pytest.raises(RenewRefused, match="never renewed"):
            answers.on_renew("resv", "writer", False)
        assert decode.workers[0].lease_claimer("resv") is None
        assert answers.on_renew("resv", "writer", True) > 30.0  # past the deadline
    finally:
        decode.close()
    table = LeaseTable(None, Tally())
    table.hold("late", [1], None, ttl=0.1)
    time.sleep(0.2)  # not expired yet (nobody called expire), but past its deadline
    with pytest.raises(RenewRefused, match="deadline passed"):
        table.renew("late", 60.0, "writer", claim=True)


def test_a_release_ends_a_reservation_only_where_nobody_claimed_it() -> None:
    """Released by the caller holding it: a claimed lease is its writer's to end (its
    WRITEs may be on their way); an unclaimed one ends, and nobody claims it after."""
    from kvxfer.transfer.leases import LeaseTable
    from kvxfer.transfer.results import Tally
    from kvxfer.wire.messages import RenewRefused

    table = LeaseTable(None, Tally())
    table.hold("claimed", [1], None, ttl=30)
    table.hold("unclaimed", [2], None, ttl=30)
    table.renew("claimed", 30, "writer", claim=True)
    assert not table.end("claimed", "abandoned", claimers=(None,))
    assert table.end("unclaimed", "abandoned", claimers=(None,))
    assert table.holds("claimed") and not table.holds("unclaimed")
    with pytest.raises(RenewRefused, match="no longer holds"):
        table.renew("unclaimed", 30, "writer", claim=True)
    assert [(r.request_id, r.reason) for r in table.take_released()] == \
        [("unclaimed", "abandoned")]
