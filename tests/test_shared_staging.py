"""Staged reads shared by in-process decode ranks (:mod:`kvxfer.transfer.converted.shared_staging`):
how the request is cut into shares, and the guard that keeps a member that gave up from being
written into. The shared reads themselves run end to end in test_transfer.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from test_descriptors import make_rank

from kvxfer.plan.layout import CacheSpec, KVCacheLayout
from kvxfer.plan.staging import StagedRead, plan_reads
from kvxfer.plan.topology import read_plan
from kvxfer.transfer.converted.shared_staging import StagedMeeting, Target


def page_read(decode_bs: int, prefill_bs: int) -> StagedRead:
    """Decode rank 0 of TP 2 reading an LBNHC TP 1 prefill's pages."""
    rng = np.random.default_rng(0)
    remote = make_rank(CacheSpec(prefill_bs, 4, 2, torch.float16), KVCacheLayout.LBNHC, 16, 2,
                       False, rng)
    local = make_rank(CacheSpec(decode_bs, 2, 2, torch.float16), KVCacheLayout.LBHNC, 16, 2,
                      False, rng)
    (read,) = plan_reads(local.geometry, {0: remote.geometry}, read_plan(0, 2, 1, 4),
                         local_tp=2, remote_tp=1)
    assert isinstance(read, StagedRead)
    return read


@pytest.mark.parametrize(("sizes", "counts", "want"), [
    ((4, 4), (5, 5), {0: ((0, 2), (0, 2)), 1: ((2, 5), (2, 5))}),
    # decode blocks 2x larger: shares end at a decode block, the prefill's follow
    ((8, 4), (3, 5), {0: ((0, 1), (0, 2)), 1: ((1, 3), (2, 5))}),
    # prefill blocks 2x larger: shares end at a prefill block
    ((4, 8), (5, 3), {0: ((0, 2), (0, 1)), 1: ((2, 5), (1, 3))}),
    # fewer blocks than members: the last one reads nothing, it only places its heads
    ((4, 4), (1, 1), {0: ((0, 0), (0, 0)), 1: ((0, 1), (0, 1))})])
def test_shares_are_whole_blocks_of_both_sides(sizes: tuple[int, int], counts: tuple[int, int],
                                               want: dict[int, tuple]) -> None:
    shares = page_read(*sizes).shares(*counts, 2)
    got = {rank: ((lo.start, lo.stop), (ro.start, ro.stop)) for rank, (lo, ro) in enumerate(shares)}
    assert got == want


def meeting() -> StagedMeeting:
    read = page_read(4, 4)
    targets = {rank: Target(rank, read, [], threading.Event()) for rank in (0, 1)}
    return StagedMeeting(targets, dict(enumerate(read.shares(4, 4, 2))))


def test_a_member_that_closes_is_written_no_more_and_waits_for_running_writes() -> None:
    shared = meeting()
    entered, release = threading.Event(), threading.Event()

    def place() -> None:  # another member's converter, writing into rank 1's views
        with shared.writing(1) as allowed:
            assert allowed
            entered.set()
            release.wait(10)

    writer = threading.Thread(target=place)
    writer.start()
    assert entered.wait(10)
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (shared.close(1), closed.set()))
    closer.start()
    time.sleep(0.05)
    assert not closed.is_set(), "close returned while a write into its views still ran"
    release.set()
    assert closed.wait(10)
    writer.join()
    closer.join()
    with shared.writing(1) as allowed:
        assert not allowed  # closed: nothing starts
    with shared.writing(0) as allowed:
        assert allowed  # the other member's views are still open


def test_the_meeting_settles_when_every_share_ended_and_keeps_the_first_error() -> None:
    shared = meeting()
    shared.end_share(0)
    assert not shared.settled and shared.error is None
    assert all(t.wake.is_set() for t in shared.targets.values())  # members look again
    shared.end_share(1, "READ failed")
    shared.end_share(1, "a later reason")  # the first call counts
    assert shared.settled and shared.error == "READ failed"


def test_a_meeting_that_cannot_close_fails_every_member() -> None:
    """The rank that closes a meeting runs its on_close; if that raises, every member
    raises it (none waits for a state that never comes)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvxfer.transfer.converted.siblings import Siblings

    siblings: Siblings[int] = Siblings()
    for rank in (0, 1):
        siblings.register("decode", "prefill", 0, rank)

    def broken(_meeting: object) -> None:
        raise ValueError("shares could not be cut")

    ids = np.arange(3)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(siblings.join, ("decode", "prefill", "req", 0), rank, ids, ids,
                               rank, broken) for rank in (0, 1)]
        errors = [f.exception(timeout=10) for f in futures]
    assert all(isinstance(e, ValueError) and "could not be cut" in str(e) for e in errors)
    assert siblings.waiting == 0
