"""LLMEngine behaviour: batching, preemption, stopping, streaming, the request API and
its errors, thread safety."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from kvxfer.engine import (
    LLMEngine,
    NoFreeBlocks,
    RequestOutput,
    RequestState,
    SamplingParams,
    tiny_config,
)
from kvxfer.engine.sampler import Logprob
from kvxfer.engine.sequence import Request
from kvxfer.engine.tokenizer import ByteTokenizer

TEXTS = ["alpha", "a much longer prompt that spans blocks", "x", "hello world", "0123456789",
         "KV", "the decode side pulls", "zzz"]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)


def make_engine(num_blocks: int = 64, block_size: int = 4, **kw: object) -> LLMEngine:
    return LLMEngine(tiny_config(), None, seed=1, block_size=block_size, num_blocks=num_blocks,
                     **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [ByteTokenizer().encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def one_at_a_time(prompts: list[list[int]]) -> list[RequestOutput]:
    engine = make_engine()
    return [engine.generate([p], GREEDY)[0] for p in prompts]


def assert_same_tokens(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx(
            [x.logprob for x in w.logprobs], abs=1e-4)


def drain(engine: LLMEngine, limit: int = 500) -> list[RequestOutput]:
    """Step until idle; every output in order."""
    outputs: list[RequestOutput] = []
    for _ in range(limit):
        if not engine.has_work():
            return outputs
        outputs += engine.step()
    raise AssertionError(f"engine still busy after {limit} steps")


def test_eight_batched_requests_match_one_at_a_time(
        prompts: list[list[int]], one_at_a_time: list[RequestOutput]) -> None:
    engine = make_engine()
    batched = engine.generate(prompts, GREEDY)
    assert_same_tokens(batched, one_at_a_time)
    assert engine.num_used_blocks == 0


def test_one_step_is_one_forward_over_all_running_requests(prompts: list[list[int]]) -> None:
    engine = make_engine()
    calls: list[int] = []
    forward = engine.model.forward

    def counting(tokens: torch.Tensor, segments: list, caches: list, *rest: object
                 ) -> torch.Tensor:
        calls.append(len(segments))
        return forward(tokens, segments, caches, *rest)  # type: ignore[arg-type]

    engine.model.forward = counting  # type: ignore[method-assign]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    first = engine.step()
    assert calls == [8] and len(first) == 8
    engine.add_request("late", prompts[0], GREEDY)  # joins the running decodes
    engine.step()
    assert calls == [8, 9]


def test_requests_arriving_mid_run_get_the_same_tokens(
        prompts: list[list[int]], one_at_a_time: list[RequestOutput]) -> None:
    engine = make_engine()
    finals: dict[str, RequestOutput] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
        for out in engine.step() + engine.step():
            if out.finished:
                finals[out.request_id] = out
    for out in drain(engine):
        if out.finished:
            finals[out.request_id] = out
    assert [finals[str(i)].token_ids for i in range(len(prompts))] == \
        [o.token_ids for o in one_at_a_time]


def test_preemption_recomputes_and_keeps_the_tokens(
        prompts: list[list[int]], one_at_a_time: list[RequestOutput]) -> None:
    # 16 blocks of 4 tokens: 8 requests of up to 40 + 12 tokens cannot all run at once.
    engine = make_engine(num_blocks=16)
    outputs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert_same_tokens(outputs, one_at_a_time)
    assert engine.num_used_blocks == 0 and engine.num_free_blocks == 16


def test_preemption_takes_the_most_recently_admitted(prompts: list[list[int]]) -> None:
    engine = make_engine(num_blocks=6)  # 24 tokens
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("old", prompts[0], params)   # 6 tokens: 2 blocks
    engine.add_request("new", prompts[4], params)   # 11 tokens: 3 blocks
    engine.step()
    assert engine.num_free_blocks == 1
    for _ in range(8):
        engine.step()
        if engine.scheduler.num_preemptions:
            break
    assert engine.scheduler.num_preemptions == 1
    assert [r.request_id for r in engine.scheduler.running] == ["old"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["new"]
    assert engine._requests["new"].block_ids == []
    drain(engine)
    assert engine.num_used_blocks == 0


def test_max_tokens_finishes_with_length(prompts: list[list[int]]) -> None:
    out = make_engine().generate([prompts[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(prompts: list[list[int]],
                                  one_at_a_time: list[RequestOutput]) -> None:
    # Declare the 5th greedy token of prompt 3 the model's EOS: weights are unchanged.
    tokens = one_at_a_time[3].token_ids
    eos = tokens[4]
    first = tokens.index(eos)
    config = dataclasses.replace(tiny_config(), eos_token_id=(257, eos))
    engine = LLMEngine(config, None, seed=1, block_size=4, num_blocks=64)
    stopped, ignored = engine.generate([prompts[3]] * 2, [
        SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, ignore_eos=True)])
    assert stopped.token_ids == tokens[:first + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_stop_string_cuts_the_text_before_it(prompts: list[list[int]],
                                             one_at_a_time: list[RequestOutput]) -> None:
    full = one_at_a_time[1]
    text = full.text
    stop = text[5:8]
    cut = text.find(stop)
    engine = make_engine()
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=12, ignore_eos=True,
                                                       stop=["never-seen", stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert full.token_ids[:len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)


def test_streamed_deltas_add_up_and_hold_back_a_possible_stop(prompts: list[list[int]]) -> None:
    engine = make_engine()
    # A stop string that never matches still holds back its length - 1 characters.
    engine.add_request("s", prompts[1], SamplingParams(max_tokens=12, ignore_eos=True,
                                                       stop=["\x00\x00\x00\x00"]))
    outputs = drain(engine)
    final = outputs[-1]
    assert final.finished and final.finish_reason == "length"
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
    assert "".join(o.new_text for o in outputs) == final.text
    for out in outputs[:-1]:
        assert len(out.text) <= max(0, len(ByteTokenizer().decode(out.token_ids)) - 3)


def test_streaming_never_emits_half_a_character() -> None:
    request = Request("u", [256], SamplingParams(max_tokens=20),
                      detokenizer=ByteTokenizer().detokenizer(), generator=None)
    deltas = []
    for byte in "é€😀".encode():
        request.append_token(Logprob(byte, 0.0), frozenset())
        deltas.append(request.take_output().new_text)
    assert [d for d in deltas if d] == ["é", "€", "😀"]
    assert request.text == "é€😀"


def test_a_held_request_keeps_its_blocks_until_release(prompts: list[list[int]]) -> None:
    engine = make_engine()
    engine.add_held_request("p", prompts[1], SamplingParams(max_tokens=1))
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "length"
    assert len(out.block_ids) == -(-len(prompts[1]) // 4)
    assert engine.num_used_blocks == len(out.block_ids)
    assert engine._requests["p"].state is RequestState.HELD
    assert not engine.has_work()
    engine.release("p")
    assert engine.num_used_blocks == 0
    with pytest.raises(KeyError, match="unknown request id 'p'"):
        engine.release("p")


def test_a_request_awaiting_kv_parks_with_blocks_for_the_prompt(
        prompts: list[list[int]]) -> None:
    engine = make_engine()
    engine.add_awaiting_kv("d", prompts[1], GREEDY)
    assert len(engine.block_ids("d")) == -(-len(prompts[1]) // 4)
    assert not engine.has_work() and engine.step() == []
    with pytest.raises(ValueError, match="request 'd' is waiting_for_kv, not held"):
        engine.release("d")


def test_failed_load_without_recompute_ends_in_error(prompts: list[list[int]]) -> None:
    engine = make_engine()
    engine.add_awaiting_kv("d", prompts[1], GREEDY)
    engine.finish_kv_load("d", ok=False, recompute=False, reason="READ timed out from peer-7")
    assert engine.num_used_blocks == 0
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "error"
    assert out.error == "READ timed out from peer-7" and out.token_ids == []
    with pytest.raises(KeyError, match="unknown request id 'd'"):
        engine.block_ids("d")


def test_finish_kv_load_needs_a_parked_request(prompts: list[list[int]]) -> None:
    engine = make_engine()
    engine.add_request("r", prompts[0], GREEDY)
    with pytest.raises(ValueError, match="request 'r' is waiting, not waiting for KV"):
        engine.finish_kv_load("r", ok=True)
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        engine.finish_kv_load("nope", ok=True)


@pytest.mark.parametrize("state", list(RequestState)[:-1])
def test_abort_in_any_state_frees_blocks(state: RequestState, prompts: list[list[int]]) -> None:
    engine = make_engine()
    held = state is RequestState.HELD
    add = engine.add_awaiting_kv if state is RequestState.WAITING_FOR_KV else \
        engine.add_held_request if held else engine.add_request
    add("a", prompts[1], SamplingParams(max_tokens=1 if held else 8))
    if state in (RequestState.RUNNING, RequestState.HELD):
        engine.step()
    assert engine._requests["a"].state is state
    assert engine.abort("a") is True
    assert engine.num_used_blocks == 0
    outputs = drain(engine)
    # A held request already reported its end; every other state reports the abort.
    assert [(o.request_id, o.finish_reason) for o in outputs] == ([] if held else
                                                                   [("a", "abort")])
    assert engine.abort("a") is False


def test_a_failed_forward_fails_its_requests_not_the_engine(prompts: list[list[int]]) -> None:
    engine = make_engine()

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("device lost")

    forward = engine.model.forward
    engine.model.forward = broken  # type: ignore[method-assign]
    engine.add_request("x", prompts[0], GREEDY)
    (out,) = engine.step()
    assert out.finish_reason == "error" and "device lost" in (out.error or "")
    assert engine.num_used_blocks == 0
    engine.model.forward = forward  # type: ignore[method-assign]
    assert engine.generate([prompts[0]], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ([], GREEDY, "request 'r': the prompt is empty"),
    ([1, 258], GREEDY, r"request 'r': token id 258 is not in \[0, 258\)"),
    ([1, -1], GREEDY, r"token id -1 is not in \[0, 258\)"),
    ([1] * 250, SamplingParams(max_tokens=10), "250 prompt tokens \\+ max_tokens 10 = 260 "
     "exceeds the KV cache capacity of 256 tokens"),
    ([1, 2], "greedy", "params must be SamplingParams, got str"),
])
def test_invalid_requests_raise_before_allocating(prompt: list[int], params: SamplingParams,
                                                   message: str) -> None:
    engine = make_engine()
    for add in (engine.add_request, engine.add_awaiting_kv):
        with pytest.raises(ValueError, match=message):
            add("r", prompt, params)
    assert engine.num_used_blocks == 0 and not engine.has_work()


def test_request_limits_and_duplicates() -> None:
    engine = LLMEngine(tiny_config(), None, block_size=16, num_blocks=256)
    with pytest.raises(ValueError, match="2040 prompt tokens \\+ max_tokens 9 = 2049 exceeds "
                                         "the max_position_embeddings of 2048 tokens"):
        engine.add_request("r", [1] * 2040, SamplingParams(max_tokens=9))
    engine.add_request("r", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="request id 'r' is already in use"):
        engine.add_request("r", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="request id must be a non-empty string, got ''"):
        engine.add_request("", [1, 2], GREEDY)


def test_a_request_awaiting_kv_without_free_blocks_raises_and_allocates_nothing() -> None:
    engine = make_engine(num_blocks=4)  # 16 tokens
    engine.add_awaiting_kv("a", [1] * 9, SamplingParams(max_tokens=1))  # 3 blocks
    with pytest.raises(NoFreeBlocks, match="asked for 2 KV cache blocks but only 1 are free"):
        engine.add_awaiting_kv("b", [1] * 5, SamplingParams(max_tokens=1))
    assert engine.num_used_blocks == 3
    engine.add_awaiting_kv("b", [1] * 4, SamplingParams(max_tokens=1))


def test_engine_construction_errors() -> None:
    with pytest.raises(ValueError, match="4 KV heads cannot be split evenly over local TP 3"):
        LLMEngine(tiny_config(), tp=3)
    with pytest.raises(ValueError, match="unknown KV cache layout 'XYZ'"):
        LLMEngine(tiny_config(), layout="XYZ")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, "
                                         "got 'int8'"):
        LLMEngine(tiny_config(), dtype="int8")
    with pytest.raises(ValueError, match="num_blocks must be a positive integer, got 0"):
        LLMEngine(tiny_config(), num_blocks=0)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got -4"):
        LLMEngine(tiny_config(), block_size=-4)
    weights = {"model.embed_tokens.weight": torch.zeros(258, 128)}
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' "
                                         r"and \d+ more missing from the given state_dict"):
        LLMEngine(tiny_config(), weights)


def test_engine_introspection() -> None:
    engine = LLMEngine(tiny_config(), tp=2, layout="BHLNC", block_size=8, num_blocks=32)
    assert engine.layout.name == "BHLNC"
    assert [list(c) for c in engine.kv_caches] == \
        [[f"model.layers.{i}.self_attn" for i in range(4)]] * 2
    spec = engine.cache_spec(1)
    assert (spec.block_size, spec.num_kv_heads, spec.head_size) == (8, 2, 16)
    assert engine.kv_caches[1]["model.layers.3.self_attn"].shape == (32, 2, 8, 32)
    assert engine.num_free_blocks == 32 and engine.max_model_len == 256
    same = LLMEngine(tiny_config(), tp=1, layout="LBHNC")
    assert same.model_id == engine.model_id  # identity of weights + config only
    assert LLMEngine(tiny_config(), seed=5).model_id != engine.model_id


def test_bfloat16_runs_and_layouts_stay_identical(prompts: list[list[int]]) -> None:
    runs = [LLMEngine(tiny_config(), None, seed=1, layout=layout, dtype=torch.bfloat16,
                      block_size=4, num_blocks=64).generate(prompts[:3], GREEDY)
            for layout in ("LBHNC", "BLNHC")]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [lp.logprob for o in runs[0] for lp in o.logprobs] == \
        [lp.logprob for o in runs[1] for lp in o.logprobs]


def test_requests_from_other_threads(prompts: list[list[int]],
                                     one_at_a_time: list[RequestOutput]) -> None:
    engine = make_engine()
    finals: dict[str, RequestOutput] = {}

    def submit(start: int) -> None:
        for i in range(start, len(prompts), 2):
            engine.add_request(str(i), prompts[i], GREEDY)

    threads = [threading.Thread(target=submit, args=(s,)) for s in (0, 1)]
    for thread in threads:
        thread.start()
    for _ in range(2000):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if len(finals) == len(prompts):
            break
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(finals, key=int) == [str(i) for i in range(len(prompts))]
    assert [finals[str(i)].token_ids for i in range(len(prompts))] == \
        [o.token_ids for o in one_at_a_time]


# -- a request given its first token -----------------------------------------------------

@pytest.mark.parametrize("params", [
    GREEDY, SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True,
                           logprobs=1)], ids=["greedy", "seeded"])
def test_a_request_given_its_first_token_continues_as_one_instance(
        prompts: list[list[int]], params: SamplingParams) -> None:
    """Given the first token (as a prefill sampled it), the engine answers the rest that
    one instance answers: the same tokens, log-probabilities and seeded draws."""
    engine = make_engine()
    prompt = prompts[1]
    want = engine.generate([prompt], params)[0]
    first = want.logprobs[0]
    answered = engine.first_output("r", prompt, params, first)
    assert answered.new_token_ids == [first.token_id] and not answered.finished
    engine.add_request("r", prompt, params, first=first)
    rest = drain(engine)
    assert [t for o in rest for t in o.new_token_ids] == want.token_ids[1:]
    assert [x.logprob for o in rest for x in o.logprobs] == pytest.approx(
        [x.logprob for x in want.logprobs[1:]], abs=1e-4)
    assert rest[-1].finished and rest[-1].token_ids == want.token_ids


def test_a_first_token_that_ends_the_request_is_refused(prompts: list[list[int]]) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=1)
    first = Logprob(65, -0.5)
    assert engine.first_output("one", prompts[0], params, first).finish_reason == "length"
    eos = Logprob(tiny_config().eos_token_id or 0, -0.1)  # end-of-text as the first token
    ended = engine.first_output("eos", prompts[0], SamplingParams(max_tokens=5), eos)
    assert ended.finished and ended.finish_reason == "stop" and ended.text == ""
    with pytest.raises(ValueError, match=r"its first token ends it \(stop\)"):
        engine.add_request("eos", prompts[0], SamplingParams(max_tokens=5), first=eos)
    with pytest.raises(ValueError, match=r"its first token ends it \(length\)"):
        engine.add_request("one", prompts[0], params, first=first)
    with pytest.raises(ValueError, match="top log-probabilities, the request asks for 2"):
        engine.add_request("two", prompts[0], GREEDY, first=first)
    assert engine.num_used_blocks == 0 and not engine.has_work()
