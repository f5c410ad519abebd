"""The engine's numbers contract: every layout, every TP size and the disaggregated path
(prefill on one engine, raw KV copy, decode on another) give the same greedy tokens as
a plain single-engine run, and match an independent dense implementation."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from kvxfer.engine import LLMEngine, ModelConfig, RequestOutput, SamplingParams, tiny_config
from kvxfer.engine.weights import init_weights
from kvxfer.plan.layout import KVCacheLayout
from kvxfer.plan.topology import rank_heads

LAYOUTS = [layout.name for layout in KVCacheLayout]
BLOCK_SIZE = 8
# Lengths chosen to end mid-block, exactly on a block edge, and after one token.
PROMPT_TEXTS = ["The quick brown fox jumps", "kvxfer moves paged KV blocks!", "a",
                "0123456789abcde"]
PARAMS = SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True)


def make_engine(tp: int = 1, layout: str = "LBHNC", config: ModelConfig | None = None,
                **kw: object) -> LLMEngine:
    return LLMEngine(config or tiny_config(), None, seed=7, tp=tp, layout=layout,
                     block_size=BLOCK_SIZE, num_blocks=64, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = make_engine().tokenizer
    return [tokenizer.encode(text) for text in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[RequestOutput]:
    """The plain run everything else is compared with: TP 1, LBHNC, one engine."""
    return make_engine().generate(prompts, PARAMS)


def assert_same_run(got: list[RequestOutput], want: list[RequestOutput], tol: float) -> None:
    """Same tokens; chosen and top-k logprobs within ``tol`` (0 means bit-identical)."""
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            values = [a.logprob] + [v for _, v in a.top]
            expected = [b.logprob] + [v for _, v in b.top]
            if tol == 0:
                assert values == expected
            else:
                assert values == pytest.approx(expected, abs=tol)


def test_logits_are_well_spread(reference: list[RequestOutput]) -> None:
    # Greedy picks must not sit on near-ties that float rounding could flip.
    assert_well_spread(reference)


def assert_well_spread(reference: list[RequestOutput]) -> None:
    """No near-ties (a 1e-4 logprob tolerance could flip a greedy token) and varied text."""
    gaps = [lp.top[0][1] - lp.top[1][1] for out in reference for lp in out.logprobs]
    assert min(gaps) > 1e-3, f"near-tie in the seeded model: smallest top-2 gap {min(gaps)}"
    assert len({t for out in reference for t in out.token_ids}) > 5  # not one repeated token


def assert_bit_identical(baseline: LLMEngine, other: LLMEngine,
                         prompts: list[list[int]]) -> None:
    """Same tokens and logprobs, and caches of the same logical contents block for block."""
    assert_same_run(other.generate(prompts, PARAMS), baseline.generate(prompts, PARAMS), tol=0)
    for rank in range(baseline.tp):
        for name, view in baseline.kv_caches[rank].items():
            assert torch.equal(other.kv_caches[rank][name], view), (other.layout, rank, name)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_is_bit_identical(layout: str, tp: int, prompts: list[list[int]]) -> None:
    assert_bit_identical(make_engine(tp, "LBHNC"), make_engine(tp, layout), prompts)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_matches_tp1(tp: int, prompts: list[list[int]],
                                     reference: list[RequestOutput]) -> None:
    # TP 8 over 4 KV heads replicates each head on two ranks.
    engine = make_engine(tp, "BLHNC")
    assert [engine.cache_spec(r).num_kv_heads for r in range(tp)] == [max(4 // tp, 1)] * tp
    assert_same_run(engine.generate(prompts, PARAMS), reference, tol=1e-4)


# -- an independent dense implementation, written from the HF Llama definition --

def dense_logits(config: ModelConfig, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Full causal forward without any cache; RoPE as complex rotation of (i, i + D/2) pairs."""
    n, d = len(ids), config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps)

    freqs = 1.0 / config.rope_theta ** (torch.arange(0, d, 2).float() / d)
    rotation = torch.polar(torch.ones(n, d // 2), torch.arange(n).float()[:, None] * freqs)

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: [heads, n, d]
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * rotation
        return torch.cat([z.real, z.imag], dim=-1)

    h = w["model.embed_tokens.weight"][ids]
    mask = torch.full((n, n), float("-inf")).triu(1)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."

        def proj(name: str, x: torch.Tensor, heads: int, p: str = p) -> torch.Tensor:
            y = x @ w[f"{p}self_attn.{name}.weight"].T
            if config.attention_bias:
                y = y + w[f"{p}self_attn.{name}.bias"]
            return y.view(n, heads, d).transpose(0, 1)

        x = norm(h, w[p + "input_layernorm.weight"])
        q, k, v = proj("q_proj", x, hq), proj("k_proj", x, hkv), proj("v_proj", x, hkv)
        q, k = rope(q), rope(k)
        group = hq // hkv
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + mask, dim=-1) @ v
        h = h + attn.transpose(0, 1).reshape(n, hq * d) @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return norm(h[-1], w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("tp", [1, 2])
def test_matches_dense_reference_with_biases_and_tied_head(tp: int) -> None:
    config = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         intermediate_size=96, rope_theta=500.0, tie_word_embeddings=True,
                         attention_bias=True, bos_token_id=256, eos_token_id=257,
                         model_type="qwen2")
    assert_matches_dense(config, tp, dense_logits)


def assert_matches_dense(config: ModelConfig, tp: int, dense: Callable[
        [ModelConfig, dict[str, torch.Tensor], list[int]], torch.Tensor]) -> None:
    """Greedy tokens and logprobs of the engine at ``tp`` equal those of ``dense``, a
    cacheless forward, at every step."""
    weights = init_weights(config, seed=3)
    engine = LLMEngine(config, weights, tp=tp, block_size=4, num_blocks=16)
    prompt = [256, 5, 17, 99, 3, 250, 7]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    ids = list(prompt)
    for token, logprob in zip(out.token_ids, out.logprobs, strict=True):
        expected = torch.log_softmax(dense(config, weights, ids), dim=-1)
        assert token == int(expected.argmax())
        assert logprob.logprob == pytest.approx(float(expected[token]), abs=1e-4)
        ids.append(token)


# -- the disaggregated path --

def run_to_end(engine: LLMEngine, ids: set[str], first: list[RequestOutput] | None = None
               ) -> dict[str, RequestOutput]:
    """Step until every id has a finished output; keep each request's last output
    (``first``: the outputs of a step the caller took already)."""
    done: dict[str, RequestOutput] = {}
    tokens: dict[str, list] = {i: [] for i in ids}
    for step in range(500):
        for out in first if step == 0 and first is not None else engine.step():
            tokens[out.request_id] += out.logprobs
            if out.finished:
                out.logprobs = tokens[out.request_id]
                done[out.request_id] = out
        if set(done) == ids:
            return done
    raise AssertionError(f"requests {ids - set(done)} did not finish in 500 steps")


def copy_prompt_kv(src: LLMEngine, src_blocks: list[int], dst: LLMEngine,
                   dst_blocks: list[int], num_tokens: int) -> None:
    """Copy positions [0, num_tokens) of every layer and KV head, block by block, from
    the owning source rank to every destination rank that holds the head."""
    heads = src.config.num_key_value_heads
    for dst_rank in range(dst.tp):
        for local, head in enumerate(rank_heads(dst_rank, dst.tp, heads)):
            src_rank = next(r for r in range(src.tp) if head in rank_heads(r, src.tp, heads))
            src_local = head - rank_heads(src_rank, src.tp, heads).start
            for name, dst_view in dst.kv_caches[dst_rank].items():
                src_view = src.kv_caches[src_rank][name]
                for j, (s, d) in enumerate(zip(src_blocks, dst_blocks, strict=False)):
                    rows = min(src.block_size, num_tokens - j * src.block_size)
                    if rows > 0:
                        dst_view[d, local, :rows] = src_view[s, src_local, :rows]


def poison(engine: LLMEngine) -> None:
    """Fill the whole cache with NaN: any slot read without being written shows up."""
    for rank in engine.kv_caches:
        for view in rank.values():
            view.fill_(float("nan"))


def poison_blocks(engine: LLMEngine, block_ids: list[int]) -> None:
    """Fill ``block_ids`` with NaN in every layer of every rank."""
    for rank in engine.kv_caches:
        for view in rank.values():
            view[torch.tensor(block_ids, device=view.device)] = float("nan")


def prefill_and_hold(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, RequestOutput]:
    for i, prompt in enumerate(prompts):
        engine.add_held_request(f"p{i}", prompt, SamplingParams(max_tokens=1, logprobs=3))
    return run_to_end(engine, {f"p{i}" for i in range(len(prompts))})


@pytest.mark.parametrize(("prefill_tp", "prefill_layout", "decode_tp", "decode_layout"), [
    (1, "LBHNC", 1, "LBHNC"),
    (1, "BLHNC", 2, "LBNHC"),
    (2, "LBHNC", 1, "BHLNC"),
    (4, "BHLNC", 2, "BLNHC"),
    (8, "LBNHC", 4, "BLHNC"),
])
def test_disaggregated_run_matches_plain_run(prefill_tp: int, prefill_layout: str,
                                             decode_tp: int, decode_layout: str,
                                             prompts: list[list[int]],
                                             reference: list[RequestOutput]) -> None:
    prefill = make_engine(prefill_tp, prefill_layout)
    decode = make_engine(decode_tp, decode_layout)
    poison(decode)
    held = prefill_and_hold(prefill, prompts)
    for i, prompt in enumerate(prompts):
        first = held[f"p{i}"]
        assert first.token_ids == reference[i].token_ids[:1]
        assert first.block_ids == prefill.block_ids(f"p{i}")
        assert len(first.block_ids) == -(-len(prompt) // BLOCK_SIZE)
        decode.add_awaiting_kv(f"d{i}", prompt, PARAMS)
        copy_prompt_kv(prefill, first.block_ids, decode, decode.block_ids(f"d{i}"),
                       len(prompt) - 1)
        decode.finish_kv_load(f"d{i}", ok=True)
        prefill.release(f"p{i}")
    assert prefill.num_used_blocks == 0
    done = run_to_end(decode, {f"d{i}" for i in range(len(prompts))})
    assert_same_run([done[f"d{i}"] for i in range(len(prompts))], reference, tol=1e-4)
    assert decode.num_used_blocks == 0


def test_decode_without_the_copied_kv_reads_poison(prompts: list[list[int]]) -> None:
    # The negative control of the test above: skip the copy and the NaNs come through.
    decode = make_engine(2, "BLHNC")
    poison(decode)
    decode.add_awaiting_kv("d", prompts[0], PARAMS)
    decode.finish_kv_load("d", ok=True)
    out = run_to_end(decode, {"d"})["d"]
    assert math.isnan(out.logprobs[0].logprob)


def test_failed_load_recomputes_the_prompt_in_the_same_blocks(
        prompts: list[list[int]], reference: list[RequestOutput]) -> None:
    decode = make_engine(2, "BHLNC")
    poison(decode)
    for i, prompt in enumerate(prompts):
        decode.add_awaiting_kv(f"d{i}", prompt, PARAMS)
    blocks = {i: decode.block_ids(f"d{i}") for i in range(len(prompts))}
    for i in range(len(prompts)):
        decode.finish_kv_load(f"d{i}", ok=False, recompute=True, reason="peer vanished")
        assert decode.block_ids(f"d{i}") == blocks[i]
    done = run_to_end(decode, {f"d{i}" for i in range(len(prompts))})
    assert_same_run([done[f"d{i}"] for i in range(len(prompts))], reference, tol=1e-4)


def test_a_quarantined_load_recomputes_in_fresh_blocks_and_keeps_the_old_ones_aside(
        prompts: list[list[int]], reference: list[RequestOutput]) -> None:
    """A READ given up in flight may still write into a request's blocks: set aside, they
    stay allocated and out of every request until freed, and the recompute runs in fresh
    blocks whatever is written into the old ones meanwhile."""
    decode = make_engine(2, "BHLNC")
    poison(decode)
    for i, prompt in enumerate(prompts):
        decode.add_awaiting_kv(f"d{i}", prompt, PARAMS)
    aside = {i: decode.set_aside_blocks(f"d{i}") for i in range(len(prompts))}
    used = decode.num_used_blocks
    for i in range(len(prompts)):
        assert aside[i] and decode.block_ids(f"d{i}") == []
        decode.finish_kv_load(f"d{i}", ok=False, recompute=True, reason="link cut")
    held = {b for blocks in aside.values() for b in blocks}
    first = decode.step()  # the recompute takes fresh blocks: none of those set aside
    fresh = {b for i in range(len(prompts)) for b in decode.block_ids(f"d{i}")}
    assert fresh and not fresh & held
    poison_blocks(decode, sorted(held))  # the stale READ lands while they run
    done = run_to_end(decode, {f"d{i}" for i in range(len(prompts))}, first)
    assert_same_run([done[f"d{i}"] for i in range(len(prompts))], reference, tol=1e-4)
    assert decode.num_used_blocks == used  # the finished requests freed theirs, not these
    for blocks in aside.values():
        decode.free_blocks(blocks)
    assert decode.num_used_blocks == 0


@pytest.mark.cuda
def test_cuda_engine_matches_cpu_and_takes_kv_from_a_cpu_prefill(
        prompts: list[list[int]], reference: list[RequestOutput]) -> None:
    on_gpu = make_engine(2, "BLHNC", device="cuda")
    assert on_gpu.kv_buffers[0].is_cuda
    assert_same_run(on_gpu.generate(prompts, PARAMS), reference, tol=1e-4)
    prefill = make_engine(1, "LBHNC")
    held = prefill_and_hold(prefill, prompts)
    for i, prompt in enumerate(prompts):
        on_gpu.add_awaiting_kv(f"d{i}", prompt, PARAMS)
        copy_prompt_kv(prefill, held[f"p{i}"].block_ids, on_gpu, on_gpu.block_ids(f"d{i}"),
                       len(prompt) - 1)
        on_gpu.finish_kv_load(f"d{i}", ok=True)
    done = run_to_end(on_gpu, {f"d{i}" for i in range(len(prompts))})
    assert_same_run([done[f"d{i}"] for i in range(len(prompts))], reference, tol=1e-4)
