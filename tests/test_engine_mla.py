"""``kvxfer-tiny-mla``: latent attention over a latent cache, the same on every TP size.

Its cache holds one latent per token (32 compressed dims, then 8 RoPE dims) in one
head that every TP rank keeps whole; its TP split shards query heads only. Every
layout, every TP size and the disaggregated path (prefill on one engine, a copy of
the latent cache, decode on another) give the same greedy tokens as a plain TP 1 run,
which matches an independent dense implementation of multi-head latent attention.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from test_engine_numerics import (
    BLOCK_SIZE,
    LAYOUTS,
    PARAMS,
    PROMPT_TEXTS,
    assert_bit_identical,
    assert_matches_dense,
    assert_same_run,
    assert_well_spread,
    copy_prompt_kv,
    make_engine,
    poison,
    prefill_and_hold,
    run_to_end,
)

from kvxfer.engine import (
    ConfigError,
    LLMEngine,
    ModelConfig,
    RequestOutput,
    init_weights,
    save_checkpoint,
    tiny_config,
    tiny_mla_config,
)
from kvxfer.engine.model_names import load_model, model_config

MLA = tiny_mla_config()


def mla_engine(tp: int = 1, layout: str = "LBHNC", **kw: object) -> LLMEngine:
    return make_engine(tp, layout, MLA, **kw)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = mla_engine().tokenizer
    return [tokenizer.encode(text) for text in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> list[RequestOutput]:
    return mla_engine().generate(prompts, PARAMS)


# -- the model and its cache --------------------------------------------------------------------

def test_the_named_model_is_the_seeded_mla_config() -> None:
    loaded = load_model("kvxfer-tiny-mla")
    assert (loaded.config, loaded.state_dict, model_config("kvxfer-tiny-mla")) == (MLA, None, MLA)
    assert LLMEngine.from_model_arg("kvxfer-tiny-mla", num_blocks=8).model_name == \
        "kvxfer-tiny-mla"


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_every_rank_holds_the_whole_latent_cache(tp: int) -> None:
    engine = mla_engine(tp)
    for rank in range(tp):
        spec = engine.cache_spec(rank)
        assert (spec.latent, spec.num_kv_heads, spec.head_size, spec.content_size) == \
            (True, 1, 32 + 8, 32 + 8)
        assert {tuple(v.shape) for v in engine.kv_caches[rank].values()} == \
            {(64, 1, BLOCK_SIZE, 40)}
    # TP shards the query heads and their up-projection, never the latent
    assert [len(r.q_heads) for r in engine.model.ranks] == [8 // tp] * tp
    latent = engine.model.ranks[0].layers[0].latent
    assert latent is not None and tuple(latent.up.shape) == (8 // tp * 2 * 16, 32)


def test_logits_are_well_spread(reference: list[RequestOutput]) -> None:
    assert_well_spread(reference)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_is_bit_identical(layout: str, tp: int, prompts: list[list[int]]) -> None:
    assert_bit_identical(mla_engine(tp, "LBHNC"), mla_engine(tp, layout), prompts)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_matches_tp1_with_the_same_latents_on_every_rank(
        tp: int, prompts: list[list[int]], reference: list[RequestOutput]) -> None:
    engine = mla_engine(tp, "BLHNC")
    assert_same_run(engine.generate(prompts, PARAMS), reference, tol=1e-4)
    for name, view in engine.kv_caches[0].items():
        for rank in range(1, tp):
            assert torch.equal(engine.kv_caches[rank][name], view), (rank, name)


# -- an independent dense implementation, from DeepSeek-V2's attention --------------------------

def dense_mla_logits(config: ModelConfig, w: dict[str, torch.Tensor],
                     ids: list[int]) -> torch.Tensor:
    """Full causal forward without a cache: per head, q = [q_nope, rope(q_pe)] and
    k = [c @ W_uk, rope(k_pe)] with k_pe shared by all heads, v = c @ W_uv, where c is
    the normalised compressed KV; RoPE as complex rotation of (i, i + R/2) pairs."""
    n, d, r = len(ids), config.head_dim, config.qk_rope_head_dim
    heads, rank = config.num_attention_heads, config.kv_lora_rank

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps)

    freqs = 1.0 / config.rope_theta ** (torch.arange(0, r, 2).float() / r)
    rotation = torch.polar(torch.ones(n, r // 2), torch.arange(n).float()[:, None] * freqs)

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: [..., n, r]
        z = torch.complex(x[..., : r // 2], x[..., r // 2:]) * rotation
        return torch.cat([z.real, z.imag], dim=-1)

    h = w["model.embed_tokens.weight"][ids]
    mask = torch.full((n, n), float("-inf")).triu(1)
    for i in range(config.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        x = norm(h, w[f"model.layers.{i}.input_layernorm.weight"])
        q = (x @ w[a + "q_proj.weight"].T).view(n, heads, d + r).transpose(0, 1)
        q = torch.cat([q[..., :d], rope(q[..., d:])], dim=-1)
        down = x @ w[a + "kv_a_proj_with_mqa.weight"].T
        c, k_pe = norm(down[:, :rank], w[a + "kv_a_layernorm.weight"]), rope(down[:, rank:])
        kv = (c @ w[a + "kv_b_proj.weight"].T).view(n, heads, 2 * d).transpose(0, 1)
        k = torch.cat([kv[..., :d], k_pe.expand(heads, n, r)], dim=-1)
        attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d + r) + mask, -1) @ kv[..., d:]
        h = h + attn.transpose(0, 1).reshape(n, heads * d) @ w[a + "o_proj.weight"].T
        p = f"model.layers.{i}."
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return norm(h[-1], w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("tp", [1, 4])
def test_matches_dense_latent_attention(tp: int) -> None:
    config = dataclasses.replace(MLA, hidden_size=64, num_hidden_layers=2, head_dim=12,
                                 kv_lora_rank=20, qk_rope_head_dim=6, intermediate_size=96,
                                 num_attention_heads=4, rope_theta=500.0)
    assert_matches_dense(config, tp, dense_mla_logits)


# -- the disaggregated path: only the latent cache crosses -----------------------------------

@pytest.mark.parametrize(("prefill_tp", "prefill_layout", "decode_tp", "decode_layout"), [
    (1, "LBHNC", 2, "BLNHC"),
    (2, "BHLNC", 1, "LBNHC"),
    (4, "BLHNC", 8, "BHLNC"),
])
def test_decode_from_a_copied_latent_cache_matches_the_plain_run(
        prefill_tp: int, prefill_layout: str, decode_tp: int, decode_layout: str,
        prompts: list[list[int]], reference: list[RequestOutput]) -> None:
    prefill, decode = mla_engine(prefill_tp, prefill_layout), mla_engine(decode_tp, decode_layout)
    poison(decode)
    held = prefill_and_hold(prefill, prompts)
    for i, prompt in enumerate(prompts):
        decode.add_awaiting_kv(f"d{i}", prompt, PARAMS)
        copy_prompt_kv(prefill, held[f"p{i}"].block_ids, decode, decode.block_ids(f"d{i}"),
                       len(prompt) - 1)
        decode.finish_kv_load(f"d{i}", ok=True)
        prefill.release(f"p{i}")
    done = run_to_end(decode, {f"d{i}" for i in range(len(prompts))})
    assert_same_run([done[f"d{i}"] for i in range(len(prompts))], reference, tol=1e-4)


def test_decode_attends_over_the_cached_latents(prompts: list[list[int]]) -> None:
    """Negative control: without the copy, the poisoned latents come through."""
    decode = mla_engine(2, "BLHNC")
    poison(decode)
    decode.add_awaiting_kv("d", prompts[0], PARAMS)
    decode.finish_kv_load("d", ok=True)
    assert math.isnan(run_to_end(decode, {"d"})["d"].logprobs[0].logprob)


# -- config and weights ---------------------------------------------------------------------------

def test_a_checkpoint_round_trip_keeps_the_model(tmp_path: Path,
                                                 prompts: list[list[int]]) -> None:
    saved = save_checkpoint(tmp_path / "mla", MLA, init_weights(MLA, 7))
    from_dir = LLMEngine.from_model_arg(str(saved), block_size=BLOCK_SIZE, num_blocks=64)
    seeded = mla_engine()
    assert from_dir.config == MLA and from_dir.model_id == seeded.model_id
    assert_same_run(from_dir.generate(prompts[:1], PARAMS), seeded.generate(prompts[:1], PARAMS),
                    tol=0)
    assert "kv_lora_rank" not in tiny_config().to_hf()  # the llama ids stay what they were


@pytest.mark.parametrize(("fields", "field"), [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "llama"}, "kv_lora_rank"),
])
def test_bad_mla_configs_name_the_field(fields: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(MLA, **fields)
    assert info.value.field == field


def test_an_mla_model_has_no_kv_packing_but_its_latent() -> None:
    with pytest.raises(ValueError, match="MLA model's cache holds one latent per token"):
        mla_engine(kv_packing="vllm-cpu-vec")


def test_a_sidecars_compat_info_says_its_cache_is_a_latent() -> None:
    """What a peer checks at the handshake: the latent's size as the head, the rank set;
    a K/V model's info keeps its head size and rank 0."""
    from kvxfer.sidecar.roles.composition import compat_info

    mla = compat_info(LLMEngine(MLA, init_weights(MLA, seed=0), num_blocks=8))
    assert (mla.kv_lora_rank, mla.head_size, mla.total_kv_heads) == (
        MLA.kv_lora_rank, MLA.kv_lora_rank + MLA.qk_rope_head_dim, 1)
    tiny = tiny_config()
    plain = compat_info(LLMEngine(tiny, init_weights(tiny, seed=0), num_blocks=8))
    assert (plain.kv_lora_rank, plain.head_size) == (0, tiny.head_dim)
