"""Weight names, seeded initialisation and the weights' identity.

Tensor names and shapes are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight``
is ``[num_attention_heads * head_dim, hidden_size]``, out x in), so a seeded model
saves as a loadable checkpoint and a real checkpoint loads without renaming. MLA
attention uses DeepSeek-V2's names (``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``).
"""

from __future__ import annotations

import hashlib
import json

import torch

from kvxfer.engine.model_config import ModelConfig


class WeightsError(ValueError):
    """Weights do not match the config: a tensor is missing, unexpected or mis-shaped."""


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, in a fixed order (the order seeds are drawn in)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attention = _latent_attention_shapes if config.is_mla else _attention_shapes
        shapes.update({p + "self_attn." + name: shape
                       for name, shape in attention(config).items()})
        shapes[p + "self_attn.o_proj.weight"] = (hidden, config.num_attention_heads
                                                 * config.head_dim)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * dim, config.num_key_value_heads * dim
    shapes: dict[str, tuple[int, ...]] = {
        "q_proj.weight": (q_out, hidden), "k_proj.weight": (kv_out, hidden),
        "v_proj.weight": (kv_out, hidden)}
    if config.attention_bias:
        shapes.update({"q_proj.bias": (q_out,), "k_proj.bias": (kv_out,),
                       "v_proj.bias": (kv_out,)})
    return shapes


def _latent_attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per query head: ``head_dim + qk_rope_head_dim`` rows of ``q_proj`` and ``2 * head_dim``
    rows of ``kv_b_proj`` (its key's no-RoPE part, then its value); ``kv_a_proj_with_mqa``
    makes the cached latent (``kv_lora_rank`` compressed dims, then the RoPE key)."""
    hidden, dim, rank = config.hidden_size, config.head_dim, config.kv_lora_rank
    heads, rope = config.num_attention_heads, config.qk_rope_head_dim
    return {"q_proj.weight": (heads * (dim + rope), hidden),
            "kv_a_proj_with_mqa.weight": (rank + rope, hidden),
            "kv_a_layernorm.weight": (rank,),
            "kv_b_proj.weight": (heads * 2 * dim, rank)}


def check_tensor_shapes(found: dict[str, tuple[tuple[int, ...], str]], config: ModelConfig,
                        where: str) -> None:
    """Compare ``name -> (shape, source)`` with the config's tensors; ``where`` names the
    checkpoint or state dict in messages."""
    expected = parameter_shapes(config)
    for name, (shape, source) in found.items():
        if name not in expected:
            raise WeightsError(f"unexpected tensor {name!r} in {source} (in {where})")
        if shape != expected[name]:
            raise WeightsError(f"tensor {name!r} in {source} (in {where}) has shape "
                               f"{list(shape)}, the config implies {list(expected[name])}")
    missing = [name for name in expected if name not in found]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightsError(f"tensor {missing[0]!r}{more} missing from {where}")


# Logit spread: the final norm gives unit-RMS hidden states, so logits have a standard
# deviation of about this many units. Wide enough that greedy picks never sit on
# near-ties that TP=1 vs TP=2 rounding (last bits of float32 sums) could flip.
LOGIT_STD = 4.0


def _init_std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) for one tensor: norms near 1, projections scaled by fan-in."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.1
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    fan_in = shape[-1]
    if name == "lm_head.weight":
        return 0.0, LOGIT_STD / fan_in ** 0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # Branch outputs smaller than the residual keep the stream from growing per layer.
        return 0.0, 0.5 / fan_in ** 0.5
    return 0.0, 1.0 / fan_in ** 0.5


def init_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic float32 CPU weights: same config and seed -> same bits, any process."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in parameter_shapes(config).items():
        mean, std = _init_std(name, shape)
        weights[name] = torch.randn(shape, generator=generator) * std + mean
    if config.tie_word_embeddings:
        # The embedding doubles as the lm head: scale it to the lm head's logit spread.
        weights["model.embed_tokens.weight"] *= LOGIT_STD / config.hidden_size ** 0.5
    return weights


# Tensors up to this many elements are hashed in full; larger ones by an even sample,
# so that identifying a multi-GB checkpoint costs milliseconds, not seconds.
_FULL_HASH_ELEMENTS = 1 << 20
_SAMPLE_ELEMENTS = 1 << 14


def fingerprint(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> str:
    """A stable id of config + weights: the same inputs give the same id in any process."""
    digest = hashlib.sha256(json.dumps(config.to_hf(), sort_keys=True).encode())
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(state_dict[name].shape)}".encode())
        if tensor.numel() > _FULL_HASH_ELEMENTS:
            step = tensor.numel() // _SAMPLE_ELEMENTS
            tensor = tensor[::step]
        data = tensor.to("cpu").contiguous()
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return f"{config.model_type}-{digest.hexdigest()[:16]}"
