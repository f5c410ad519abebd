"""Model shape of the reference engine: a Llama-style decoder-only transformer.

:class:`ModelConfig` holds the fields of a Hugging Face ``config.json`` that
change the numbers (Llama, Qwen2 and Mistral share them), validated on
construction. Fields that would change the math in a way the engine does not
implement (RoPE scaling, another activation, MLP bias) are refused by
:meth:`ModelConfig.from_hf` with an error naming the field, never ignored.

``kvxfer_mla`` is kvxfer's own synthetic family: Llama with DeepSeek-style
multi-head latent attention (MLA), whose KV cache holds one latent vector per
token instead of K and V heads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "mistral": "MistralForCausalLM", "kvxfer_mla": "KvxferMLAForCausalLM"}
MLA_MODEL_TYPE = "kvxfer_mla"


class ConfigError(ValueError):
    """A model config field is missing, mistyped or inconsistent; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"model config field {field!r}: {message}")
        self.field = field


def _positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, f"must be a positive integer, got {value!r}")


def _positive_float(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(field, f"must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of the transformer. ``head_dim`` is in elements.

    Invariants: query heads are a multiple of KV heads (grouped-query attention);
    the rotary dims are even (RoPE rotates pairs); special token ids lie in the vocabulary.
    ``eos_token_id`` may be several ids (Llama 3 lists three).

    MLA (``model_type="kvxfer_mla"``): ``kv_lora_rank`` and ``qk_rope_head_dim`` are
    positive and ``num_key_value_heads`` is 1, the one latent "head" every TP rank
    keeps whole. Each query head has ``head_dim`` no-RoPE dims plus
    ``qk_rope_head_dim`` RoPE dims; keys and values (``head_dim`` each per head) are
    up-projected from the cached latent, whose RoPE part is the one key shared by all
    heads. Other model types have both fields 0.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str = "llama"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "intermediate_size",
                      "max_position_embeddings"):
            _positive_int(field, getattr(self, field))
        _positive_float("rms_norm_eps", self.rms_norm_eps)
        _positive_float("rope_theta", self.rope_theta)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads",
                              f"{self.num_key_value_heads} does not divide "
                              f"num_attention_heads={self.num_attention_heads}")
        self._check_mla()
        if self.rotary_dim % 2:
            field = "qk_rope_head_dim" if self.is_mla else "head_dim"
            raise ConfigError(field, f"must be even for RoPE, got {self.rotary_dim}")
        for field in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(field, f"must be true or false, got {getattr(self, field)!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError("model_type", f"{self.model_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ConfigError("attention_bias", "qwen2 models always have q/k/v biases")
        if self.model_type == "mistral" and self.attention_bias:
            raise ConfigError("attention_bias", "mistral models have no attention biases")
        self._check_token("bos_token_id", self.bos_token_id)
        for token in self.eos_token_ids:
            self._check_token("eos_token_id", token)

    def _check_mla(self) -> None:
        for field in ("kv_lora_rank", "qk_rope_head_dim"):
            value = getattr(self, field)
            if self.is_mla:
                _positive_int(field, value)
            elif value != 0:
                raise ConfigError(field, f"only {MLA_MODEL_TYPE} models have one, got {value!r} "
                                  f"for a {self.model_type} model")
        if self.is_mla and self.num_key_value_heads != 1:
            raise ConfigError("num_key_value_heads",
                              f"an MLA model caches one latent per token, its single KV head; "
                              f"got {self.num_key_value_heads}")
        if self.is_mla and self.attention_bias:
            raise ConfigError("attention_bias", f"{MLA_MODEL_TYPE} models have no attention "
                              f"biases")

    def _check_token(self, field: str, token: object) -> None:
        if token is None:
            return
        if isinstance(token, bool) or not isinstance(token, int) \
                or not 0 <= token < self.vocab_size:
            raise ConfigError(field, f"{token!r} is not a token id below "
                              f"vocab_size={self.vocab_size}")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id (empty when the model has none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, tuple):
            return self.eos_token_id
        return (self.eos_token_id,)

    @property
    def queries_per_kv_head(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: the cache holds one latent per token."""
        return self.model_type == MLA_MODEL_TYPE

    @property
    def rotary_dim(self) -> int:
        """Dims RoPE rotates in each query head (and key)."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def cache_head_size(self) -> int:
        """Elements of one KV head's K (or V) in the cache; for MLA, of the latent."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Llama / Qwen2 / Mistral ``config.json`` dict.

        ``head_dim`` defaults to ``hidden_size // num_attention_heads`` and
        ``num_key_value_heads`` to ``num_attention_heads``. A sliding window
        caps ``max_position_embeddings``: inside the window, sliding-window
        attention equals full attention, so the engine stays exact.
        """
        if not isinstance(hf, dict):
            raise ConfigError("<root>", f"config must be a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError("model_type", f"{model_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        _refuse_unsupported_math(hf)
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")
        for field in required:
            if field not in hf:
                raise ConfigError(field, "is missing from config.json")
        heads = hf["num_attention_heads"]
        _positive_int("num_attention_heads", heads)
        _positive_int("hidden_size", hf["hidden_size"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        max_positions = hf.get("max_position_embeddings", 2048)
        window = _sliding_window(hf, model_type)
        if window is not None and isinstance(max_positions, int):
            max_positions = min(max_positions, window)
        eos = hf.get("eos_token_id")
        rope = hf.get("rope_parameters") or {}
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6 if model_type == "qwen2" else 1e-5),
            rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=True if model_type == "qwen2" else hf.get("attention_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            model_type=model_type, kv_lora_rank=hf.get("kv_lora_rank", 0),
            qk_rope_head_dim=hf.get("qk_rope_head_dim", 0))

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that :meth:`from_hf` reads back to an equal config."""
        out = asdict(self)
        if not self.is_mla:  # the fields of another family; their absence keeps ids stable
            del out["kv_lora_rank"], out["qk_rope_head_dim"]
        if isinstance(self.eos_token_id, tuple):
            out["eos_token_id"] = list(self.eos_token_id)
        out["architectures"] = [SUPPORTED_MODEL_TYPES[self.model_type]]
        out["hidden_act"] = "silu"
        return out


def _refuse_unsupported_math(hf: dict[str, Any]) -> None:
    """Raise for config.json fields whose math the engine does not implement."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError("hidden_act", f"only 'silu' is supported, got {hf['hidden_act']!r}")
    if hf.get("mlp_bias", False):
        raise ConfigError("mlp_bias", "MLP biases are not supported")
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise ConfigError("rope_scaling", f"RoPE scaling {kind!r} is not supported")


def _sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    """The attention window in tokens, or None for full attention."""
    window = hf.get("sliding_window")
    if window is None or (model_type == "qwen2" and not hf.get("use_sliding_window", False)):
        return None
    _positive_int("sliding_window", window)
    return int(window)


def tiny_config() -> ModelConfig:
    """The built-in default: a byte-level model small enough for two CPU cores.

    Vocabulary: 256 bytes + BOS (256) + EOS (257). Four KV heads so that TP 1,
    2 and 4 shard heads and TP 8 replicates them.
    """
    return ModelConfig(vocab_size=258, hidden_size=128, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                       intermediate_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=False,
                       attention_bias=False, bos_token_id=256, eos_token_id=257,
                       model_type="llama")


def tiny_mla_config() -> ModelConfig:
    """``kvxfer-tiny-mla``: the tiny model with latent attention. Eight query heads over
    one cached latent of 32 + 8 elements per token, so every TP size up to 8 shards
    the query heads and keeps the whole latent on each rank."""
    return ModelConfig(vocab_size=258, hidden_size=128, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                       intermediate_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=False,
                       attention_bias=False, bos_token_id=256, eos_token_id=257,
                       model_type=MLA_MODEL_TYPE, kv_lora_rank=32, qk_rope_head_dim=8)
