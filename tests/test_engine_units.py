"""Unit tests of the engine's small parts: block allocator, sampler, model config."""

from __future__ import annotations

import math

import pytest
import torch

from kvxfer.engine import (
    BlockAllocator,
    ConfigError,
    LLMEngine,
    ModelConfig,
    NoFreeBlocks,
    SamplingParams,
    tiny_config,
)
from kvxfer.engine.sampler import sample, top_p_filter
from kvxfer.engine.transformer import check_tp, valid_tp_sizes

# -- block allocator --


def test_allocator_hands_out_distinct_blocks_and_takes_them_back() -> None:
    alloc = BlockAllocator(8)
    first, second = alloc.allocate(3), alloc.allocate(5)
    assert first == [0, 1, 2] and sorted(first + second) == list(range(8))
    assert (alloc.num_free, alloc.num_used) == (0, 8)
    alloc.free(first)
    assert (alloc.num_free, alloc.num_used) == (3, 5)
    assert sorted(alloc.allocate(3)) == [0, 1, 2]
    assert alloc.allocate(0) == []


def test_allocator_reuses_freed_blocks_last() -> None:
    alloc = BlockAllocator(4)
    alloc.free(alloc.allocate(1))
    assert alloc.allocate(1) == [1]


def test_no_free_blocks_names_the_counts() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(NoFreeBlocks, match="asked for 2 KV cache blocks but only 1 are free") \
            as info:
        alloc.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert alloc.num_free == 1


def test_double_free_and_unknown_ids_raise_and_free_nothing() -> None:
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    with pytest.raises(ValueError, match=r"block id 9 is not in \[0, 4\)"):
        alloc.free([ids[0], 9])
    with pytest.raises(ValueError, match="block 2 is not allocated"):
        alloc.free([ids[0], 2])
    with pytest.raises(ValueError, match=f"block {ids[1]} is not allocated .double free"):
        alloc.free([ids[1], ids[1]])
    assert alloc.num_used == 2  # nothing was freed by the failed calls
    alloc.free(ids)
    with pytest.raises(ValueError, match=f"block {ids[0]} is not allocated"):
        alloc.free([ids[0]])


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_allocator_rejects_bad_counts(bad: object) -> None:
    with pytest.raises(ValueError, match=f"block count must be a non-negative integer, "
                                         f"got {bad!r}"):
        BlockAllocator(4).allocate(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"num_blocks must be a positive integer, got {bad!r}"):
        BlockAllocator(bad)  # type: ignore[arg-type]


# -- sampler --


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(tiny_config(), seed=2, block_size=8, num_blocks=64)


PROMPT = [256, *b"sampling"]


def test_seeded_sampling_is_deterministic_and_batch_independent(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPT], params)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)  # unseeded
    batched = engine.generate([[256, 1, 2, 3], PROMPT, [256, 9]], [others, params, others])
    assert batched[1].token_ids == alone
    fresh = LLMEngine(tiny_config(), seed=2, block_size=8, num_blocks=64)
    assert fresh.generate([PROMPT], params)[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert engine.generate([PROMPT], other_seed)[0].token_ids != alone
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert greedy.token_ids != alone


def test_tiny_top_p_is_greedy_and_logprobs_ignore_temperature(engine: LLMEngine) -> None:
    greedy = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True,
                                                      logprobs=2))[0]
    nucleus = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True,
                                                       temperature=5.0, top_p=1e-6, seed=3,
                                                       logprobs=2))[0]
    assert nucleus.token_ids == greedy.token_ids
    assert [lp.logprob for lp in nucleus.logprobs] == [lp.logprob for lp in greedy.logprobs]
    assert [lp.top for lp in nucleus.logprobs] == [lp.top for lp in greedy.logprobs]


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    assert top_p_filter(probs.clone(), 0.5).tolist() == [0, 0.5, 0, 0]
    assert top_p_filter(probs.clone(), 0.6).tolist() == [0, 0.5, 0, 0.25]
    assert top_p_filter(probs.clone(), 0.9).tolist() == pytest.approx([0, 0.5, 0.15, 0.25])
    assert top_p_filter(probs.clone(), 1.0).tolist() == pytest.approx(probs.tolist())


@pytest.mark.parametrize("temperature, top_p", [(1e-38, 1.0), (1e-300, 1.0), (1.0, 1e-46),
                                                 (1e-30, 5e-324), (1e-6, 1.0)])
def test_extreme_sampling_values_pick_the_most_likely_token(temperature: float,
                                                            top_p: float) -> None:
    """Regression: temperature 1e-38 or top_p 1e-46 made the distribution NaN / all zero,
    and the exception stopped a sidecar's engine loop for good."""
    logits = torch.tensor([0.0, 3.0, 1.0, -2.0])
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=1)
    generator = torch.Generator().manual_seed(0)
    assert {sample(logits, params, generator).token_id for _ in range(20)} == {1}


def test_a_request_whose_sampling_fails_ends_alone(engine: LLMEngine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception while sampling one request fails that request only: its blocks
    come back, the others in the batch finish, and the engine keeps stepping."""
    import kvxfer.engine.engine as engine_module

    real_sample = engine_module.sample

    def flaky(logits: torch.Tensor, params: SamplingParams, generator: object) -> object:
        if params.seed == 13:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(logits, params, generator)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "sample", flaky)
    good = SamplingParams(max_tokens=4, ignore_eos=True)
    bad = SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, seed=13)
    outputs = engine.generate([PROMPT, PROMPT], [bad, good])
    assert outputs[0].finish_reason == "error" and "sampling failed" in (outputs[0].error or "")
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 4
    assert engine.num_used_blocks == 0
    assert engine.generate([PROMPT], good)[0].token_ids == outputs[1].token_ids


def test_sampling_draws_only_from_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25]))
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=0.6)
    drawn = {sample(logits, params, generator).token_id for _ in range(200)}
    assert drawn == {1, 3}


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    result = sample(logits, SamplingParams(logprobs=3, temperature=0.5, seed=1),
                    torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits, dim=-1)
    assert result.logprob == pytest.approx(float(expected[result.token_id]))
    assert [t for t, _ in result.top] == [1, 2, 0]
    assert [v for _, v in result.top] == pytest.approx(expected[[1, 2, 0]].tolist())
    assert math.fsum(math.exp(v) for v in expected.tolist()) == pytest.approx(1.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ({"temperature": -0.1}, "temperature must be a number >= 0, got -0.1"),
    ({"temperature": float("nan")}, "temperature must be a number >= 0, got nan"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"seed": -3}, r"seed must be an integer in \[0, 2\*\*63\), got -3"),
    ({"stop": ["ok", ""]}, r"stop must be a list of non-empty strings, got \['ok', ''\]"),
    ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\], got 21"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false, got 'yes'"),
])
def test_sampling_params_validation_names_the_field(kwargs: dict[str, object],
                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_accepts_a_single_stop_string() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


# -- model config --

LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": [2, 3],
         "hidden_act": "silu", "tie_word_embeddings": False, "rope_scaling": None}


def test_llama_config_reads_and_round_trips() -> None:
    config = ModelConfig.from_hf(LLAMA)
    assert config.head_dim == 128 and config.num_key_value_heads == 8
    assert config.eos_token_ids == (2, 3) and not config.attention_bias
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert config.to_hf()["architectures"] == ["LlamaForCausalLM"]


def test_qwen2_always_has_attention_bias_and_mistral_window_caps_positions() -> None:
    qwen = ModelConfig.from_hf({**LLAMA, "model_type": "qwen2", "sliding_window": 4096,
                                "use_sliding_window": False, "head_dim": 64})
    assert qwen.attention_bias and qwen.head_dim == 64 and qwen.max_position_embeddings == 8192
    mistral = ModelConfig.from_hf({**LLAMA, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.max_position_embeddings == 4096 and not mistral.attention_bias
    no_kv = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf(no_kv).num_key_value_heads == 32


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"hidden_size": None}, "hidden_size", "must be a positive integer, got None"),
    ({"num_key_value_heads": 5}, "num_key_value_heads", "5 does not divide "
                                                        "num_attention_heads=32"),
    ({"head_dim": 7}, "head_dim", "must be even for RoPE, got 7"),
    ({"model_type": "gpt2"}, "model_type", "'gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act", "only 'silu' is supported, got 'gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling",
     "RoPE scaling 'llama3' is not supported"),
    ({"mlp_bias": True}, "mlp_bias", "MLP biases are not supported"),
    ({"eos_token_id": 32000}, "eos_token_id", "32000 is not a token id below "
                                              "vocab_size=32000"),
    ({"rms_norm_eps": 0}, "rms_norm_eps", "must be a positive number, got 0"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings", "must be true or false, got 'no'"),
])
def test_config_errors_name_the_field(change: dict[str, object], field: str,
                                      message: str) -> None:
    with pytest.raises(ConfigError, match=f"model config field '{field}': {message}") as info:
        ModelConfig.from_hf({**LLAMA, **change})
    assert info.value.field == field


def test_config_missing_field_is_named() -> None:
    hf = {k: v for k, v in LLAMA.items() if k != "intermediate_size"}
    with pytest.raises(ConfigError, match=r"'intermediate_size': is missing from config\.json"):
        ModelConfig.from_hf(hf)


def test_tiny_config_shape() -> None:
    config = tiny_config()
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (258, 256, 257)
    assert (config.num_key_value_heads, config.num_attention_heads, config.head_dim) == (4, 8, 16)
    with pytest.raises(ConfigError, match="'attention_bias': mistral models have no attention"):
        ModelConfig(**{**config.__dict__, "model_type": "mistral", "attention_bias": True})


# -- TP sizes --


@pytest.mark.parametrize(("heads", "kv_heads", "inter", "sizes"), [
    (8, 4, 256, [1, 2, 4, 8]),      # kvxfer-tiny: 8 replicates its 4 KV heads
    (9, 3, 1536, [1, 3]),           # SmolLM2-135M: 9 would replicate, but 9 does not divide 1536
    (32, 8, 14336, [1, 2, 4, 8, 16, 32]),
])
def test_valid_tp_sizes_split_heads_and_mlp(heads: int, kv_heads: int, inter: int,
                                             sizes: list[int]) -> None:
    config = ModelConfig(vocab_size=300, hidden_size=heads * 16, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                         intermediate_size=inter)
    assert valid_tp_sizes(config) == sizes


def test_an_impossible_tp_names_the_reason_and_the_sizes_that_fit() -> None:
    with pytest.raises(ValueError, match=r"^4 KV heads cannot be split evenly over local TP 3; "
                                         r"TP sizes that fit this model \(8 query heads, 4 KV "
                                         r"heads, intermediate_size 256\): 1, 2, 4, 8 \(KV "
                                         r"heads replicated\)$"):
        check_tp(tiny_config(), 3)
    with pytest.raises(ValueError, match="TP size must be a positive integer, got 0"):
        check_tp(tiny_config(), 0)
