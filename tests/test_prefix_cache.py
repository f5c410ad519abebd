"""The engine's prefix cache: byte-exact hits, LRU eviction of idle blocks only, only
final blocks shared, and the decode-side rules (aligned to the prefill's block size,
never the last prompt token, a failed read or a sibling copy never writes a shared block).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvxfer.engine import LLMEngine, NoFreeBlocks, SamplingParams, tiny_config
from kvxfer.engine import engine as engine_module
from kvxfer.engine.prefix_cache import PrefixCache, extend_hashes

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0, logprobs=1)
ONE = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)


def make_engine(cache: bool = True, block_size: int = 4, num_blocks: int = 64,
                **kw: object) -> LLMEngine:
    return LLMEngine(tiny_config(), None, seed=1, block_size=block_size, num_blocks=num_blocks,
                     enable_prefix_caching=cache, **kw)  # type: ignore[arg-type]


def kv_rows(engine: LLMEngine, blocks: list[int], positions: range) -> list[torch.Tensor]:
    """The KV of ``positions`` (blocks ``blocks``) in every layer of every rank, as
    ``[T, H, C]`` through each layer's logical ``[B, H, N, C]`` view."""
    bs = engine.block_size
    ids = torch.tensor([blocks[p // bs] for p in positions], dtype=torch.int64)
    slots = torch.tensor([p % bs for p in positions], dtype=torch.int64)
    return [view[ids, :, slots, :].clone() for rank in engine.kv_caches for view in rank.values()]


def held(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    """Run ``prompt`` as a prefill (its blocks held afterwards); its block ids."""
    engine.add_held_request(request_id, prompt, ONE)
    while engine.has_work():
        engine.step()
    return engine.block_ids(request_id)


def reference_kv(prompt: list[int], positions: range, **kw: object) -> list[torch.Tensor]:
    engine = make_engine(cache=False, **kw)
    return kv_rows(engine, held(engine, "ref", prompt), positions)


# -- the pool ----------------------------------------------------------------------------

def hashes_of(*blocks: int) -> list[bytes]:
    return extend_hashes([], [t for b in blocks for t in (b,) * 4], 4, len(blocks))


def test_idle_blocks_are_evicted_least_recently_used_first() -> None:
    pool = PrefixCache(4, 4)
    a, b, c, d = (pool.allocate(1)[0] for _ in range(4))
    for block, name in ((a, 1), (b, 2), (c, 3)):
        pool.insert(hashes_of(name), [block], [name] * 4)
    pool.free([a])
    pool.free([b])
    pool.free([c])  # idle, oldest first: a, b, c
    assert (pool.num_free, pool.num_used, pool.num_cached) == (3, 1, 3)
    assert pool.match(hashes_of(1)) == [a]  # a used again: now the most recent
    pool.free([a])
    assert pool.allocate(1) == [b]  # b is the least recently used idle block
    assert pool.lookup(hashes_of(2)) == 0 and pool.lookup(hashes_of(1)) == 1
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]
    assert (pool.num_free, pool.num_cached) == (0, 0)
    pool.free([a, b, c, d])
    assert pool.num_free == 4


def test_a_held_block_is_never_evicted() -> None:
    pool = PrefixCache(3, 4)
    blocks = pool.allocate(3)
    pool.insert(hashes_of(7), blocks[:1], [7] * 4)
    pool.free(blocks[1:])
    assert pool.match(hashes_of(7)) == blocks[:1] and pool.holders(blocks[0]) == 2
    pool.free(blocks[:1])  # one of the two holders left: still held
    with pytest.raises(NoFreeBlocks):
        pool.allocate(3)
    assert pool.allocate(2) and pool.is_cached(blocks[0]) and pool.holders(blocks[0]) == 1


def test_double_frees_and_uncached_inserts_raise() -> None:
    pool = PrefixCache(4, 4)
    block = pool.allocate(1)[0]
    pool.insert(hashes_of(1), [block], [1] * 4)
    pool.free([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free([block])
    with pytest.raises(ValueError, match="not allocated"):
        pool.insert(hashes_of(2), [3], [2] * 4)


def test_chain_hashes_name_the_whole_prefix() -> None:
    one = extend_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], 4, 9)
    other = extend_hashes([], [9, 9, 9, 9, 5, 6, 7, 8], 4, 2)
    assert len(one) == 2 and one[1] != other[1]  # the same tokens after another prefix
    assert extend_hashes(one[:1], [1, 2, 3, 4, 5, 6, 7, 8], 4, 2) == one


# -- the engine --------------------------------------------------------------------------

prefix_st = st.lists(st.integers(0, 255), min_size=1, max_size=30)
tails_st = st.lists(st.lists(st.integers(0, 255), max_size=9), min_size=2, max_size=5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=prefix_st, tails=tails_st, block_size=st.sampled_from([2, 4]),
       tp_layout=st.sampled_from([(1, "LBHNC"), (2, "BHLNC"), (1, "BLNHC")]))
@example(prefix=[0, 0, 0], tails=[[], [0], [0, 0]], block_size=2, tp_layout=(1, "LBHNC"))
def test_a_hit_holds_exactly_the_kv_its_prompt_computes(
        prefix: list[int], tails: list[list[int]], block_size: int,
        tp_layout: tuple[int, str]) -> None:
    """Each hit block holds, byte for byte, the KV the request that first filled it
    stored (the same tokens at the same positions), and the whole prompt's KV is that of
    its own cacheless prefill up to float rounding (a forward over another number of
    tokens may round differently: the filler itself may have started from a hit)."""
    tp, layout = tp_layout
    geometry = {"block_size": block_size, "num_blocks": 128, "tp": tp, "layout": layout}
    engine = make_engine(**geometry)  # large enough that nothing is evicted here
    prompts = [prefix + tail for tail in tails]
    references = [reference_kv(p, range(len(p)), **geometry) for p in prompts]
    stored: list[list[torch.Tensor]] = []  # each request's KV rows as the engine kept them
    for k, prompt in enumerate(prompts):
        blocks = held(engine, f"r{k}", prompt)
        cached = engine.num_cached_tokens(f"r{k}")
        assert cached % block_size == 0 and cached <= len(prompt) - 1
        shared = max((common_blocks(p, prompt, block_size) for p in prompts[:k]), default=0)
        assert cached == min(shared, (len(prompt) - 1) // block_size) * block_size
        got = kv_rows(engine, blocks, range(len(prompt)))
        for index in range(cached // block_size):
            source = next(j for j in range(k)
                          if common_blocks(prompts[j], prompt, block_size) > index)
            rows = slice(index * block_size, (index + 1) * block_size)
            for have, kept in zip(got, stored[source], strict=True):
                assert torch.equal(have[rows], kept[rows])
        for have, expected in zip(got, references[k], strict=True):
            torch.testing.assert_close(have, expected, rtol=1e-5, atol=1e-5)
        stored.append(got)
        engine.release(f"r{k}")


def common_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """Full blocks both prompts start with (``a``'s KV of them is final once computed)."""
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return same // block_size


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=24), min_size=3,
                        max_size=8),
       shared=st.lists(st.integers(0, 255), min_size=0, max_size=16))
def test_only_final_blocks_are_shared_and_tokens_match_no_cache(
        prompts: list[list[int]], shared: list[int]) -> None:
    """Small pool (evictions, preemptions): after every step each cached block a request
    holds lies inside what it computed, and the answers are those of no cache."""
    prompts = [shared + p for p in prompts]
    engine = make_engine(num_blocks=14)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    done = {}
    for _ in range(400):
        if not engine.has_work():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        cache = engine.prefix_cache
        assert cache is not None
        holders: dict[int, int] = {}
        for request in engine.scheduler.running:
            for index, block in enumerate(request.block_ids):
                holders[block] = holders.get(block, 0) + 1
                if cache.is_cached(block):  # its content is final
                    assert (index + 1) * engine.block_size <= request.num_computed
        for block, count in holders.items():
            assert count == 1 or cache.holders(block) == count, "a private block shared"
        assert cache.num_free + cache.num_used == cache.num_blocks
    plain = make_engine(cache=False, num_blocks=14)
    want = plain.generate(prompts, GREEDY)
    assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [w.token_ids for w in want]
    assert engine.num_used_blocks == 0


def test_the_last_prompt_token_is_always_computed() -> None:
    engine = make_engine()
    prompt = list(range(12))  # three full blocks of 4
    held(engine, "a", prompt)
    held(engine, "b", prompt)
    assert engine.num_cached_tokens("b") == 8  # not 12: the last block holds the last token
    assert engine.prefix_cache_stats()[:2] == (11 + 11, 8)


def test_a_parked_decode_shares_nothing_until_its_kv_is_final() -> None:
    engine = make_engine()
    prompt = list(range(1, 14))
    engine.add_awaiting_kv("d", prompt, GREEDY)  # its READ has not ended
    engine.add_awaiting_kv("e", prompt, GREEDY)
    assert engine.num_cached_tokens("e") == 0
    assert not set(engine.block_ids("d")) & set(engine.block_ids("e"))


@pytest.mark.parametrize(("shared", "block_size", "remote_block_size", "cached"), [
    (16, 4, 4, 16), (16, 4, 8, 16), (16, 8, 4, 16), (16, 4, 12, 12),
    (12, 4, 4, 12), (12, 4, 8, 8), (12, 4, 2, 12), (12, 8, 4, 8), (12, 4, 12, 12)])
def test_a_decode_hit_ends_on_a_whole_prefill_block(shared: int, block_size: int,
                                                    remote_block_size: int,
                                                    cached: int) -> None:
    """The decode reads whole prefill blocks past its hit, so the hit is cut to a
    multiple of both block sizes; 16 of a 17-token prompt cached is a full hit."""
    engine = make_engine(block_size=block_size)
    prompt = list(range(1, 18))  # 17 tokens: the decode needs the KV of 16
    held(engine, "p", prompt[:shared] + [99] * (17 - shared))
    engine.add_awaiting_kv("d", prompt, GREEDY, remote_block_size=remote_block_size)
    assert engine.num_cached_tokens("d") == cached
    # the blocks past the hit are fresh: nothing shared is written by the READ
    cache = engine.prefix_cache
    assert cache is not None
    rest = engine.block_ids("d")[cached // block_size:]
    assert not any(cache.is_cached(b) for b in rest)


def test_a_request_awaiting_kv_that_does_not_fit_takes_no_cached_block() -> None:
    engine = make_engine(num_blocks=6)
    prompt = list(range(1, 18))
    held(engine, "p", prompt)  # 5 blocks held, 4 of them cached
    engine.add_held_request("x", [5], ONE)
    while engine.has_work():
        engine.step()  # the last free block
    with pytest.raises(NoFreeBlocks):
        engine.add_awaiting_kv("d", [*prompt, 1, 2, 3, 4], GREEDY)
    cache = engine.prefix_cache
    assert cache is not None
    assert all(cache.holders(b) == 1 for b in engine.block_ids("p")[:4])


def warm_engine() -> tuple[LLMEngine, list[int], list[int], list[torch.Tensor]]:
    """An engine whose cache holds a 19-token prompt's first 16 tokens: the engine, the
    prompt, its blocks and their KV."""
    engine = make_engine()
    prompt = list(range(3, 22))
    blocks = held(engine, "p", prompt)
    engine.release("p")
    return engine, prompt, blocks, kv_rows(engine, blocks, range(16))


def recomputes_past_the_cache(engine: LLMEngine, prompt: list[int], blocks: list[int],
                              before: list[torch.Tensor]) -> None:
    """Request "d"'s KV load failed: it recomputes past its 16 cached tokens only (their
    blocks unchanged) and answers as one instance without a cache."""
    engine.finish_kv_load("d", ok=False, recompute=True)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    for old, new in zip(before, kv_rows(engine, blocks, range(16)), strict=True):
        assert torch.equal(old, new)  # the shared blocks were not written
    want = make_engine(cache=False).generate([prompt], GREEDY)[0]
    assert outputs[-1].token_ids == want.token_ids


def test_a_failed_read_recomputes_past_the_cached_prefix_only() -> None:
    engine, prompt, blocks, before = warm_engine()
    engine.add_awaiting_kv("d", prompt, GREEDY)
    assert engine.num_cached_tokens("d") == 16
    recomputes_past_the_cache(engine, prompt, blocks, before)


@pytest.mark.parametrize(("shared", "cached"), [(16, 12), (12, 12), (11, 8), (3, 0)])
def test_a_push_reservation_takes_the_cached_prefix_and_fresh_blocks_for_the_rest(
        shared: int, cached: int) -> None:
    """Push mode reserves before the request (and its first token) comes: the hit stops
    short of the prompt's last token, whole decode blocks; only the rest is fresh."""
    engine = make_engine()
    prompt = list(range(3, 19))  # 16 tokens: at most 3 of its 4 blocks cached
    held(engine, "p", prompt[:shared] + [99] * (19 - shared))
    engine.release("p")
    cache = engine.prefix_cache
    assert cache is not None
    queries, hits = cache.queries, cache.hits
    hit, fresh = engine.reserve_blocks(prompt)
    assert len(hit) * 4 == cached and len(hit) + len(fresh) == 4
    assert all(cache.holders(b) == 1 for b in hit)
    assert not any(cache.is_cached(b) for b in fresh)
    assert (cache.queries - queries, cache.hits - hits) == (16, cached)
    engine.free_blocks(hit + fresh)  # an unused reservation: all of it back
    assert engine.num_used_blocks == 0


def test_a_pushed_request_adopts_its_cached_prefix_and_recomputes_only_past_it() -> None:
    engine, prompt, blocks, before = warm_engine()
    hit, fresh = engine.reserve_blocks(prompt)
    assert hit == blocks[:4]
    with pytest.raises(ValueError, match="3 of its tokens cached"):
        engine.add_awaiting_kv_in("x", prompt, GREEDY, hit + fresh, 3)
    engine.add_awaiting_kv_in("d", prompt, GREEDY, hit + fresh, 16)
    assert engine.num_cached_tokens("d") == 16
    assert engine.set_aside_blocks("d") == fresh  # a late WRITE could land only there
    engine.free_blocks(fresh)
    recomputes_past_the_cache(engine, prompt, blocks, before)


def test_a_push_reservation_that_does_not_fit_holds_nothing() -> None:
    engine = make_engine(num_blocks=6)
    prompt = list(range(1, 18))
    held(engine, "p", prompt)  # 5 blocks held, 4 of them cached
    with pytest.raises(NoFreeBlocks):
        engine.reserve_blocks([*prompt, 1, 2, 3, 4, 5, 6, 7, 8])
    cache = engine.prefix_cache
    assert cache is not None
    assert all(cache.holders(b) == 1 for b in engine.block_ids("p")[:4])


def play_read(engine: LLMEngine, request_id: str, prompt: list[int], first: int) -> None:
    """Stand in for the READ: the prefill's KV of ``prompt``'s blocks from ``first`` on."""
    prefill = make_engine(cache=False)
    theirs, mine = held(prefill, "q", prompt), engine.block_ids(request_id)
    for rank, their_rank in zip(engine.kv_caches, prefill.kv_caches, strict=True):
        for name, view in rank.items():
            for index in range(first, len(theirs)):
                view[mine[index]] = their_rank[name][theirs[index]]


def test_siblings_copy_only_past_the_shared_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine()
    prompt = list(range(3, 22))
    blocks = held(engine, "p", prompt)
    engine.release("p")
    before = kv_rows(engine, blocks, range(16))
    for rid in ("d", "s1", "s2"):
        engine.add_awaiting_kv(rid, prompt, GREEDY)
    assert engine.block_ids("s1")[:4] == blocks[:4] == engine.block_ids("d")[:4]
    play_read(engine, "d", prompt, first=4)
    copies: list[tuple[list[list[int]], list[list[int]]]] = []
    copy = engine_module._copy_blocks
    monkeypatch.setattr(engine_module, "_copy_blocks", lambda caches, src, dst: (
        copies.append((src, dst)), copy(caches, src, dst))[1])
    engine.finish_kv_load("d", ok=True)
    engine.start_siblings("d", ["s1", "s2"])
    d = engine.block_ids("d")
    assert copies == [([d[4:5], d[4:5]], [engine.block_ids("s1")[4:5],
                                          engine.block_ids("s2")[4:5]])]
    outputs = {}
    while engine.has_work():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    want = make_engine(cache=False).generate([prompt], GREEDY)[0].token_ids
    assert {r: o.token_ids for r, o in outputs.items()} == dict.fromkeys(("d", "s1", "s2"), want)
    for old, new in zip(before, kv_rows(engine, blocks, range(16)), strict=True):
        assert torch.equal(old, new)
