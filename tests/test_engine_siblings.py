"""``LLMEngine.start_siblings``: n samples of one prompt from one KV load, in every layout.

A decode engine gets a prompt's KV the way a NIXL READ delivers it (copied from a
prefill engine's blocks into the parked request's blocks), then starts the other
samples from a local copy. Each sample must match a plain single-instance run with
its own sampling params, without recomputing the prompt, and every block is freed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kvxfer.engine import LLMEngine, RequestOutput, RequestState, SamplingParams, tiny_config
from kvxfer.engine.tokenizer import ByteTokenizer
from kvxfer.plan.layout import KVCacheLayout

PROMPT = ByteTokenizer().encode("one read, several samples of this prompt")  # 42 tokens
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=11)


def make_engine(layout: str = "LBHNC", tp: int = 1) -> LLMEngine:
    return LLMEngine(tiny_config(), None, seed=1, block_size=4, num_blocks=64, layout=layout,
                     tp=tp)


def drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; each request's final output, with the logprobs of all its steps."""
    final: dict[str, RequestOutput] = {}
    logprobs: dict[str, list[Any]] = {}
    for _ in range(200):
        if not engine.has_work():
            return final
        for output in engine.step():
            logprobs.setdefault(output.request_id, []).extend(output.logprobs)
            if output.finished:
                final[output.request_id] = dataclasses.replace(
                    output, logprobs=logprobs[output.request_id])
    raise AssertionError("engine still busy after 200 steps")


def load_like_a_read(prefill: LLMEngine, decode: LLMEngine, source: str) -> None:
    """What a decode's READ does: the prompt's KV into the parked request's blocks."""
    prefill.add_held_request("p", PROMPT, SamplingParams(max_tokens=1))
    drain(prefill)
    src = torch.tensor(prefill.block_ids("p"))
    dst = torch.tensor(decode.block_ids(source))
    for prefill_rank, decode_rank in zip(prefill.kv_caches, decode.kv_caches, strict=True):
        for name, view in decode_rank.items():
            view[dst] = prefill_rank[name][src]
    prefill.release("p")
    decode.finish_kv_load(source, ok=True)


def reference(params: list[SamplingParams]) -> list[RequestOutput]:
    engine = make_engine()
    return [engine.generate([PROMPT], p)[0] for p in params]


def with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("layout", [layout.name for layout in KVCacheLayout])
def test_siblings_start_from_the_loaded_kv_in_every_layout(layout: str, tp: int) -> None:
    prefill, decode = make_engine(layout, tp), make_engine(layout, tp)
    params = [GREEDY, GREEDY, with_seed(SEEDED, 11), with_seed(SEEDED, 12)]
    ids = [f"d{k}" for k in range(len(params))]
    for request_id, p in zip(ids, params, strict=True):
        decode.add_awaiting_kv(request_id, PROMPT, p)
    forwarded: list[int] = []
    forward = decode.model.forward

    def counting(tokens: torch.Tensor, *args: Any) -> torch.Tensor:
        forwarded.append(len(tokens))
        return forward(tokens, *args)

    decode.model.forward = counting  # type: ignore[method-assign]
    load_like_a_read(prefill, decode, ids[0])
    decode.start_siblings(ids[0], ids[1:])
    got = drain(decode)
    # first step: the last prompt token of each sample, nothing recomputed
    assert forwarded[0] == len(ids), forwarded
    for request_id, want in zip(ids, reference(params), strict=True):
        assert got[request_id].token_ids == want.token_ids, (layout, tp, request_id)
        assert [x.logprob for x in got[request_id].logprobs] == pytest.approx(
            [x.logprob for x in want.logprobs], abs=1e-4)
    assert got["d0"].token_ids == got["d1"].token_ids, "greedy samples must agree"
    assert got["d2"].token_ids != got["d3"].token_ids, "seeded samples must differ"
    assert decode.num_used_blocks == 0 and prefill.num_used_blocks == 0


def test_siblings_without_the_copy_would_answer_otherwise() -> None:
    """The copy is what makes a sibling right: from its own (empty) blocks it differs."""
    prefill, decode = make_engine(), make_engine()
    decode.add_awaiting_kv("a", PROMPT, GREEDY)
    decode.add_awaiting_kv("b", PROMPT, GREEDY)
    load_like_a_read(prefill, decode, "a")
    decode.finish_kv_load("b", ok=True)  # claims a load that never happened
    got = drain(decode)
    assert got["a"].token_ids == reference([GREEDY])[0].token_ids
    assert got["b"].token_ids != got["a"].token_ids


def test_an_aborted_sibling_frees_its_blocks_and_the_rest_go_on() -> None:
    prefill, decode = make_engine(), make_engine()
    for request_id in ("a", "b", "c"):
        decode.add_awaiting_kv(request_id, PROMPT, GREEDY)
    assert decode.abort("b") is True
    load_like_a_read(prefill, decode, "a")
    decode.start_siblings("a", ["c"])
    got = drain(decode)
    assert got["b"].finish_reason == "abort"
    assert got["a"].token_ids == got["c"].token_ids == reference([GREEDY])[0].token_ids
    assert decode.num_used_blocks == 0


def test_start_siblings_refuses_wrong_states_before_copying() -> None:
    prefill, decode = make_engine(), make_engine()
    decode.add_awaiting_kv("a", PROMPT, GREEDY)
    decode.add_awaiting_kv("b", PROMPT, GREEDY)
    decode.add_awaiting_kv("other", PROMPT[:-1], GREEDY)
    with pytest.raises(ValueError, match="'a' is waiting_for_kv"):
        decode.start_siblings("a", ["b"])
    load_like_a_read(prefill, decode, "a")
    with pytest.raises(ValueError, match="another prompt"):
        decode.start_siblings("a", ["b", "other"])
    assert decode._requests["b"].state is RequestState.WAITING_FOR_KV, "nothing started"
    with pytest.raises(KeyError, match="'nope'"):
        decode.start_siblings("a", ["nope"])
    decode.step()  # "a" samples its first token: too late to start siblings from it
    with pytest.raises(ValueError, match="1 tokens sampled"):
        decode.start_siblings("a", ["b"])
    for request_id in ("a", "b", "other"):
        decode.abort(request_id)
    drain(decode)
    assert decode.num_used_blocks == 0
