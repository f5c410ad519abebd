"""The proxy's KV index (pure): blocks keyed by the proxy's own hash of their tokens, as an
instance's events store and remove them, and kv_aware's order of the instances."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.bench import index_cost as bench_index
from kvxfer.net.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from proxy.balancer import Balancer, Prompt, cost
from proxy.config import ProxyConfig
from proxy.kv_index import InstanceIndex, prefix_keys
from proxy.pd_watch import PROVEN, SAMPLE, PDWatch

SIZE = 4


def stored(names: Sequence[int], tokens: Sequence[int], parent: int | None = None,
           size: int = SIZE) -> BlockStored:
    return BlockStored(list(names), parent, list(tokens), size)


def test_prefix_keys_name_a_block_by_its_tokens_and_everything_before_them() -> None:
    a = prefix_keys(list(range(12)), SIZE)
    assert len(a) == 3 and len(set(a)) == 3
    assert prefix_keys(list(range(13)), SIZE) == a  # a partial block has no key
    assert prefix_keys([9, *range(1, 12)], SIZE)[1:] != a[1:]  # another start: other keys
    assert prefix_keys(list(range(8)), 8) != a[:1]  # another block size: other keys


def test_stored_blocks_are_found_by_the_prompts_that_start_with_them() -> None:
    index = InstanceIndex(SIZE)
    index.apply(stored([101, 102], range(8)))
    index.apply(stored([103], range(8, 12), parent=102))  # the chain goes on
    prompt = list(range(20))
    assert index.cached_blocks(prefix_keys(prompt, SIZE)) == 3
    assert index.cached_blocks(prefix_keys([0, 1, 2, 3, 99, 5, 6, 7], SIZE)) == 1
    assert index.cached_blocks(prefix_keys([7, *range(1, 12)], SIZE)) == 0


def test_removed_blocks_and_a_cleared_cache_are_no_longer_found() -> None:
    index = InstanceIndex(SIZE)
    index.apply(stored([1, 2, 3], range(12)))
    keys = prefix_keys(list(range(12)), SIZE)
    index.apply(BlockRemoved([2]))
    assert index.cached_blocks(keys) == 1
    assert len(index) == 2
    index.apply(AllBlocksCleared())
    assert index.cached_blocks(keys) == 0 and len(index) == 0


def test_blocks_of_an_unseen_chain_or_another_block_size_are_not_keyed() -> None:
    """Stored after a parent this index never saw (an event missed): they cannot be keyed,
    so they are not believed; nor blocks of another size, or with too few tokens."""
    index = InstanceIndex(SIZE)
    index.apply(stored([7], range(4, 8), parent=6))
    index.apply(stored([8], range(8), size=8))
    index.apply(stored([9, 10], range(4)))
    assert len(index) == 0 and index.unknown_parents == 4


def test_a_block_stored_twice_is_held_until_every_name_is_removed() -> None:
    """Two engine blocks of the same tokens (e.g. two groups): one key, held twice."""
    index = InstanceIndex(SIZE)
    index.apply(stored([1], range(4)))
    index.apply(stored([2], range(4)))
    keys = prefix_keys(list(range(4)), SIZE)
    index.apply(BlockRemoved([1]))
    assert index.cached_blocks(keys) == 1
    index.apply(BlockRemoved([2, 2, 99]))  # repeated and unknown names change nothing more
    assert index.cached_blocks(keys) == 0


@given(st.lists(st.integers(0, 50), min_size=0, max_size=40),
       st.lists(st.integers(0, 50), min_size=0, max_size=40))
def test_a_prompt_is_found_as_far_as_it_shares_whole_blocks(stored_tokens: list[int],
                                                            prompt: list[int]) -> None:
    index = InstanceIndex(SIZE)
    full = len(stored_tokens) // SIZE
    if full:
        index.apply(stored(range(full), stored_tokens[:full * SIZE]))
    shared = 0
    while shared < min(len(prompt), full * SIZE) and prompt[shared] == stored_tokens[shared]:
        shared += 1
    assert index.cached_blocks(prefix_keys(prompt, SIZE)) == shared // SIZE


class Believed:
    """KV events as the balancer reads them: cached tokens per instance (None: no index)."""

    def __init__(self, cached: dict[str, int | None]) -> None:
        self.cached = cached

    def cached_tokens(self, url: str, prompt: Sequence[int], keys: dict[int, list[bytes]]
                      ) -> int | None:
        return self.cached.get(url)

    def blocks(self) -> dict[str, int]:
        return {}


def balancer(cached: dict[str, int | None]) -> Balancer:
    config = ProxyConfig(("http://p0", "http://p1", "http://p2"), ("http://d0", "http://d1"))
    made = Balancer(config, Believed(cached))  # type: ignore[arg-type]
    for instance in made.instances():
        instance.healthy = True
    return made


def test_kv_aware_sends_a_prefill_where_the_least_is_left_to_compute() -> None:
    made = balancer({"http://p0": 0, "http://p1": 96, "http://p2": 32})
    prompt = Prompt(list(range(128)))
    for _ in range(3):  # whatever the rotation
        assert [i.url for i in made.candidates("prefill", (), prompt)] == \
            ["http://p1", "http://p2", "http://p0"]
    p1 = made.instances("prefill")[1]
    p1.tokens_in_flight = 200  # busy computing others' prompts: 32 + 200 > 96
    assert made.candidates("prefill", (), prompt)[0].url == "http://p2"
    assert made.candidates("prefill", ("http://p2",), prompt)[-1].url == "http://p2"


def test_kv_aware_weighs_a_decodes_cached_prefix_against_what_it_runs() -> None:
    made = balancer({"http://d0": 0, "http://d1": 128})
    prompt = Prompt(list(range(128)))
    assert made.candidates("decode", (), prompt)[0].url == "http://d1"
    made.instances("decode")[1].outstanding = 3  # 3 requests cost more than reading 128
    assert made.candidates("decode", (), prompt)[0].url == "http://d0"
    assert cost(made.instances("decode")[0], 128) < cost(made.instances("decode")[1], 0)


@pytest.mark.parametrize("cached", [{}, {"http://p0": None, "http://p1": None}])
def test_without_a_believed_index_kv_aware_goes_round_robin(cached: dict[str, int | None]
                                                           ) -> None:
    made = balancer(cached)
    prompt = Prompt(list(range(64)))
    firsts = [made.candidates("prefill", (), prompt)[0].url for _ in range(3)]
    assert firsts == ["http://p0", "http://p1", "http://p2"]


def test_a_pair_that_reads_is_asked_about_one_request_in_sixteen_until_one_is_unread() -> None:
    watch = PDWatch()
    asked = [watch.ask("p", "d") for _ in range(PROVEN)]
    for _ in range(PROVEN):
        watch.read("p", "d")
    later = [watch.ask("p", "d") for _ in range(4 * SAMPLE)]
    assert all(asked) and sum(later) == 4
    watch.unread("p", "d", "r1")
    assert watch.ask("p", "d") and watch.ask("p", "d"), "an unread request asks every time"
    assert watch.ask("p", "other"), "another pair is asked about from the start"
    assert [a["requests"] for a in watch.state()] == [1]
    watch.cannot_ask("p")  # a prefill without the release route (vLLM's)
    assert not watch.ask("p", "d") and not watch.ask("p", "other")


def test_bench_index_reports_memory_and_scoring_time_of_the_blocks_it_indexed() -> None:
    args = argparse.Namespace(blocks=640, chain=64, block_size=SIZE * 4, prompt_tokens="64,256",
                              repeats=3)
    report = bench_index.measure(args)
    assert report["indexed_blocks"] == 640
    assert 10_000_000 < report["bytes_per_million_blocks"] < 2_000_000_000
    assert set(report["score_one_instance"]) == {64, 256}
    assert all(s["p50_us"] > 0 for s in report["score_one_instance"].values())
