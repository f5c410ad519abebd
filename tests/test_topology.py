"""Tests for ``kvxfer.plan.topology``; which rank holds which head is computed here.

Sharding rule: with ``heads >= tp`` rank ``r`` holds ``[r * heads // tp, (r + 1) * heads // tp)``;
with fewer heads than ranks, heads are replicated and rank ``r`` holds the single
head ``r * heads // tp``.
"""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.plan.topology import (
    HeadSlice,
    heads_per_rank,
    rank_heads,
    read_plan,
    readers_per_remote_rank,
)

PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]
HEAD_COUNTS = [1, 2, 4, 8]


def valid(tp: int, heads: int) -> bool:
    return heads % tp == 0 if heads >= tp else tp % heads == 0


def holds(rank: int, tp: int, heads: int) -> list[int]:
    """Global KV heads ``rank`` holds under the sharding rule."""
    if heads >= tp:
        per = heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * heads // tp]


def check_plan(rank: int, local_tp: int, remote_tp: int, heads: int) -> list[HeadSlice]:
    slices = read_plan(rank, local_tp, remote_tp, heads)
    mine = holds(rank, local_tp, heads)
    # the local heads, each exactly once
    covered = collections.Counter(slice_.local_head_offset + i
                                  for slice_ in slices for i in range(slice_.count))
    assert covered == collections.Counter(range(len(mine))), (rank, slices)
    for slice_ in slices:
        assert slice_.count > 0 and slice_.local_head_offset >= 0
        assert 0 <= slice_.remote_rank < remote_tp
        assert slice_.remote_head_offset >= 0
        theirs = holds(slice_.remote_rank, remote_tp, heads)
        for i in range(slice_.count):
            # the remote rank really holds the head, and it is the head wanted locally
            assert slice_.remote_head_offset + i < len(theirs), (rank, slice_)
            assert theirs[slice_.remote_head_offset + i] == mine[slice_.local_head_offset + i]
    # one slice per contiguous run: no two slices could be merged
    for a, b in itertools.permutations(slices, 2):
        assert not (a.remote_rank == b.remote_rank
                    and a.remote_head_offset + a.count == b.remote_head_offset
                    and a.local_head_offset + a.count == b.local_head_offset), (a, b)
    # contiguous shards meet in one run per remote rank
    assert len(slices) == len({s.remote_rank for s in slices})
    return slices


def check_all_ranks(local_tp: int, remote_tp: int, heads: int) -> None:
    plans = {rank: check_plan(rank, local_tp, remote_tp, heads) for rank in range(local_tp)}
    readers: collections.Counter[int] = collections.Counter()
    for slices in plans.values():
        readers.update({s.remote_rank for s in slices})
    assert readers_per_remote_rank(local_tp, remote_tp, heads) == dict(readers)
    # replicas share the load: the local ranks reading a head spread over its copies
    sources: dict[int, set[int]] = collections.defaultdict(set)
    wanted: collections.Counter[int] = collections.Counter()
    for rank, slices in plans.items():
        mine = holds(rank, local_tp, heads)
        wanted.update(mine)
        for s in slices:
            for i in range(s.count):
                sources[mine[s.local_head_offset + i]].add(s.remote_rank)
    copies = max(remote_tp // heads, 1)
    for head, count in wanted.items():
        assert len(sources[head]) == min(count, copies), (head, sources[head])


@pytest.mark.parametrize("heads", HEAD_COUNTS)
@pytest.mark.parametrize(("local_tp", "remote_tp"), PAIRS)
def test_read_plan_for_tp_pairs(local_tp: int, remote_tp: int, heads: int) -> None:
    assert valid(local_tp, heads) and valid(remote_tp, heads)
    check_all_ranks(local_tp, remote_tp, heads)


@pytest.mark.parametrize(("args", "expected"), [
    ((0, 1, 1, 8), [HeadSlice(0, 0, 0, 8)]),
    ((0, 1, 2, 8), [HeadSlice(0, 0, 0, 4), HeadSlice(1, 0, 4, 4)]),
    ((1, 2, 1, 8), [HeadSlice(0, 4, 0, 4)]),
    ((3, 4, 2, 8), [HeadSlice(1, 2, 0, 2)]),
    ((1, 2, 4, 8), [HeadSlice(2, 0, 0, 2), HeadSlice(3, 0, 2, 2)]),
    ((0, 1, 4, 2), [HeadSlice(0, 0, 0, 1), HeadSlice(2, 0, 1, 1)]),
    ((3, 4, 1, 2), [HeadSlice(0, 1, 0, 1)]),
    ((2, 4, 4, 1), [HeadSlice(2, 0, 0, 1)]),
])
def test_read_plan_hand_computed(args: tuple[int, int, int, int],
                                 expected: list[HeadSlice]) -> None:
    assert read_plan(*args) == expected


@pytest.mark.parametrize(("local_tp", "remote_tp", "heads", "expected"), [
    (1, 2, 8, {0: 1, 1: 1}),
    (2, 1, 8, {0: 2}),
    (4, 2, 2, {0: 2, 1: 2}),
    (1, 4, 2, {0: 1, 2: 1}),
    (4, 4, 2, {0: 1, 1: 1, 2: 1, 3: 1}),
    (2, 4, 8, {0: 1, 1: 1, 2: 1, 3: 1}),
])
def test_readers_per_remote_rank_hand_computed(local_tp: int, remote_tp: int, heads: int,
                                               expected: dict[int, int]) -> None:
    assert readers_per_remote_rank(local_tp, remote_tp, heads) == expected


@pytest.mark.parametrize(("tp", "heads"), list(itertools.product([1, 2, 4, 8], [1, 2, 4, 8, 16])))
def test_rank_heads_and_heads_per_rank(tp: int, heads: int) -> None:
    assert heads_per_rank(tp, heads) == len(holds(0, tp, heads))
    for rank in range(tp):
        assert list(rank_heads(rank, tp, heads)) == holds(rank, tp, heads)


TP_VALUES = [1, 2, 3, 4, 6, 8, 16]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TP_VALUES), st.sampled_from(TP_VALUES), st.integers(1, 32))
def test_read_plan_any_valid_combination(local_tp: int, remote_tp: int, heads: int) -> None:
    if valid(local_tp, heads) and valid(remote_tp, heads):
        check_all_ranks(local_tp, remote_tp, heads)
        return
    role, tp = ("decode", local_tp) if not valid(local_tp, heads) else ("prefill", remote_tp)
    with pytest.raises(ValueError) as info:
        read_plan(0, local_tp, remote_tp, heads)
    message = str(info.value)
    assert f"{role} TP {tp}" in message and f"{heads} KV heads" in message, message
    with pytest.raises(ValueError):
        readers_per_remote_rank(local_tp, remote_tp, heads)


# ---------------------------------------------------------------- error paths

@pytest.mark.parametrize(("args", "fragments"), [
    ((0, 2, 1, 3), ["3 KV heads", "decode TP 2", "evenly"]),
    ((0, 1, 4, 6), ["6 KV heads", "prefill TP 4", "evenly"]),
    ((0, 4, 1, 3), ["decode TP 4", "not a multiple", "3 KV heads"]),
    ((0, 1, 8, 3), ["prefill TP 8", "not a multiple", "3 KV heads"]),
])
def test_uneven_heads_rejected(args: tuple[int, int, int, int], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        read_plan(*args)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(("args", "fragments"), [
    ((0, 0, 1, 8), ["decode TP", "positive", "got 0"]),
    ((0, 1, -2, 8), ["prefill TP", "positive", "got -2"]),
    ((0, 1, 1, 0), ["KV heads", "positive", "got 0"]),
    ((0, 1, 1, -4), ["KV heads", "positive", "got -4"]),
])
def test_non_positive_values_rejected(args: tuple[int, int, int, int],
                                      fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        read_plan(*args)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("rank", [2, 5, -1])
def test_rank_out_of_range_rejected(rank: int) -> None:
    with pytest.raises(ValueError) as info:
        read_plan(rank, 2, 1, 4)
    assert f"rank {rank}" in str(info.value)
    assert "TP size 2" in str(info.value)


def test_readers_per_remote_rank_rejects_invalid() -> None:
    with pytest.raises(ValueError, match="3 KV heads"):
        readers_per_remote_rank(2, 1, 3)
