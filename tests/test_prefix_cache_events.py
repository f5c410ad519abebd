"""The prefix cache's KV events: what it records once they are taken (the sidecar's KV event
stream publishes them). A block newly cached is stored once, with its tokens, its chain hash
and its parent's; an idle block evicted is removed by the name it was stored under; nothing
is kept before anyone takes them.
"""

from __future__ import annotations

import pytest

from kvxfer.engine import LLMEngine, SamplingParams, tiny_config
from kvxfer.engine.prefix_cache import PrefixCache, extend_hashes
from kvxfer.net.kv_events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

BLOCK = 4
ONE = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
THREE = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)


def make_engine(num_blocks: int = 64) -> LLMEngine:
    return LLMEngine(tiny_config(), None, seed=1, block_size=BLOCK, num_blocks=num_blocks,
                     enable_prefix_caching=True)


def chain(tokens: list[int]) -> list[bytes]:
    """The cache's names of the full blocks of ``tokens``."""
    return extend_hashes([], tokens, BLOCK, len(tokens) // BLOCK)


def stored(events: list[BlockStored | BlockRemoved]) -> list[BlockStored]:
    assert all(isinstance(e, BlockStored) for e in events), events
    return [e for e in events if isinstance(e, BlockStored)]


def test_nothing_is_recorded_before_the_first_take() -> None:
    engine = make_engine(num_blocks=8)
    for first in range(1, 6):  # stores, and evictions once the 8 blocks run short
        engine.generate([[first] * 13], ONE)
    assert engine.prefix_cache is not None and engine.prefix_cache.num_cached
    assert engine.take_cache_events() == []
    engine.generate([[9] * 13], ONE)
    assert engine.take_cache_events(), "the first take starts the recording"


def test_a_prompt_s_full_blocks_are_stored_in_one_event_with_their_tokens() -> None:
    engine = make_engine()
    engine.take_cache_events()
    prompt = list(range(10, 20))  # two full blocks, then two tokens
    engine.add_request("a", prompt, ONE)
    engine.step()
    names = chain(prompt)
    assert engine.take_cache_events() == [BlockStored(
        block_hashes=names, parent_block_hash=None, token_ids=prompt[:8], block_size=BLOCK)]


def test_a_block_filled_while_decoding_is_stored_after_its_parent() -> None:
    engine = make_engine()
    engine.take_cache_events()
    prompt = list(range(10, 20))
    tokens = prompt + engine.generate([prompt], THREE)[0].token_ids  # 10, 11 fill block 2
    events = stored(engine.take_cache_events())
    names = chain(tokens[:12])
    assert [e.block_hashes for e in events] == [names[:2], names[2:]]
    assert events[1].parent_block_hash == names[1]
    assert events[1].token_ids == tokens[8:12]


def test_a_cached_prefix_is_not_stored_again_and_the_rest_names_it_as_parent() -> None:
    engine = make_engine()
    engine.take_cache_events()
    prompt = list(range(10, 22))
    engine.generate([prompt], ONE)
    engine.take_cache_events()
    longer = [*prompt[:8], *range(50, 58), 1]  # shares two blocks, adds two
    engine.generate([longer], ONE)
    names = chain(longer)
    assert engine.take_cache_events() == [BlockStored(
        block_hashes=names[2:4], parent_block_hash=names[1], token_ids=longer[8:16],
        block_size=BLOCK)]


def test_evicting_idle_blocks_removes_them_by_the_names_they_were_stored_under() -> None:
    engine = make_engine(num_blocks=5)
    engine.take_cache_events()
    first, second = [1] * 13, [2] * 13  # three full blocks and a fourth each
    engine.generate([first], ONE)
    engine.generate([second], ONE)
    events = engine.take_cache_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored]
    assert events[0] == BlockStored(block_hashes=chain(first), parent_block_hash=None,
                                    token_ids=first[:12], block_size=BLOCK)
    removed = events[1]
    assert isinstance(removed, BlockRemoved)
    # the second prompt's 4 blocks: the 2 free ones and 2 of first's 3, oldest first
    assert removed.block_hashes == chain(first)[:2]
    assert engine.prefix_cache is not None and engine.prefix_cache.num_cached == 4


def test_a_run_broken_by_a_block_cached_elsewhere_is_stored_as_two_events() -> None:
    cache = PrefixCache(8, BLOCK)
    cache.take_events()
    tokens = [1] * 4 + [2] * 4 + [3] * 4
    names = chain(tokens)
    cache.insert(names[1:2], cache.allocate(1), tokens[4:8], names[0])
    cache.insert(names, cache.allocate(3), tokens)  # the middle one is cached already
    assert cache.take_events() == [
        BlockStored(block_hashes=names[1:2], parent_block_hash=names[0],
                    token_ids=tokens[4:8], block_size=BLOCK),
        BlockStored(block_hashes=names[:1], parent_block_hash=None, token_ids=tokens[:4],
                    block_size=BLOCK),
        BlockStored(block_hashes=names[2:], parent_block_hash=names[1],
                    token_ids=tokens[8:], block_size=BLOCK)]
    assert cache.take_events() == []


def test_an_insert_whose_tokens_do_not_fill_its_blocks_is_refused() -> None:
    cache = PrefixCache(4, BLOCK)
    with pytest.raises(ValueError, match="hold 8 tokens, not 7"):
        cache.insert(chain([5] * 8), cache.allocate(2), [5] * 7)


def test_recorded_events_survive_the_wire_format() -> None:
    engine = make_engine(num_blocks=6)
    engine.take_cache_events()
    engine.generate([[1] * 13], ONE)
    engine.generate([[2] * 13], ONE)
    events = engine.take_cache_events()
    batch = KVEventBatch(ts=1.5, events=list(events))
    assert decode_batch(encode_batch(batch)) == batch
