"""GGUF files (llama.cpp's one-file model format) read into a config and HF-named weights.

Parsed and dequantized (to float32) by the ``gguf`` library; this module maps metadata,
names, dims and rotary rows onto the engine's Hugging Face conventions. Only ``llama`` is
read; anything the engine cannot run exactly raises :class:`GGUFError`.

Design: docs/design/models.md#reading-a-gguf-file
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.engine.checkpoint import CheckpointError
from kvxfer.engine.model_config import ConfigError, ModelConfig
from kvxfer.engine.weights import parameter_shapes

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


class GGUFError(CheckpointError):
    """A GGUF file is unreadable, corrupt, truncated or holds what the engine cannot run."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"GGUF file {path}: {reason}")
        self.path, self.reason = Path(path), reason


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of a Hugging Face Llama tensor name."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    match = _HF_LAYER.fullmatch(hf_name)
    if match is None or match[2] not in LAYER_NAMES:
        raise KeyError(f"no GGUF name for tensor {hf_name!r}")
    return f"blk.{match[1]}.{LAYER_NAMES[match[2]]}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head of ``D`` rows, GGUF row ``2j + h``
    is HF row ``h * D/2 + j`` (``h`` in {0, 1}). Works on weights and on biases."""
    dim = weight.shape[0] // num_heads
    rest = tuple(weight.shape[1:])
    return weight.reshape(num_heads, dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


class GGUFFile:
    """An open GGUF file: its path (for messages) and the ``gguf.GGUFReader`` over it."""

    def __init__(self, path: str | Path) -> None:
        """Open ``path``; its magic is checked first for a clear message."""
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            with self.path.open("rb") as handle:
                magic = handle.read(len(GGUF_MAGIC))
        except OSError as exc:
            raise self.error(f"cannot be read: {exc.strerror or exc}") from None
        if magic != GGUF_MAGIC:
            raise self.error(f"not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, IndexError, KeyError, OverflowError, OSError) as exc:
            # The reader maps every tensor with numpy views while it walks the header: a
            # short file fails to reshape one, a garbled one fails anywhere in between.
            raise self.error(f"corrupt or truncated ({exc})") from None

    def error(self, reason: str) -> GGUFError:
        return GGUFError(self.path, reason)

    @property
    def tensors(self) -> dict[str, Any]:
        """``name -> gguf.ReaderTensor`` in file order."""
        return {tensor.name: tensor for tensor in self.reader.tensors}

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        """Metadata ``key`` (a scalar, str or list), checked to be a ``kind``; ``default``
        when absent, else :class:`GGUFError`."""
        field = self.reader.get_field(key)
        if field is None:
            if default is ...:
                raise self.error(f"metadata key {key!r} is missing")
            return default
        value = field.contents()
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise self.error(f"metadata key {key!r} holds {value!r:.60}, not a "
                             f"{getattr(kind, '__name__', kind)}")
        return value


def _float32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def read_config(file: GGUFFile) -> ModelConfig:
    """The model config from a GGUF's ``general.architecture`` and ``llama.*`` keys."""
    arch = file.get("general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise file.error(f"architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    scaling = file.get(f"{arch}.rope.scaling.type", str, "none")
    if scaling not in ("none", ""):
        raise file.error(f"RoPE scaling {scaling!r} is not supported")
    hidden = file.get(f"{arch}.embedding_length", int)
    heads = file.get(f"{arch}.attention.head_count", int)
    head_dim = file.get(f"{arch}.attention.key_length", int, hidden // max(heads, 1))
    for key in ("attention.value_length", "rope.dimension_count"):
        value = file.get(f"{arch}.{key}", int, head_dim)
        if value != head_dim:
            raise file.error(f"{arch}.{key}={value} differs from the head size {head_dim}; "
                             f"only full-width rotary heads are supported")
    tensors = file.tensors
    tokens = file.reader.get_field("tokenizer.ggml.tokens")
    vocab = file.get(f"{arch}.vocab_size", int, None if tokens is None else len(tokens.data))
    number = (int, float)
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden,
            num_hidden_layers=file.get(f"{arch}.block_count", int),
            num_attention_heads=heads,
            num_key_value_heads=file.get(f"{arch}.attention.head_count_kv", int, heads),
            head_dim=head_dim, intermediate_size=file.get(f"{arch}.feed_forward_length", int),
            rms_norm_eps=_float32(file.get(f"{arch}.attention.layer_norm_rms_epsilon", number)),
            rope_theta=_float32(file.get(f"{arch}.rope.freq_base", number, 10000.0)),
            max_position_embeddings=file.get(f"{arch}.context_length", int, 2048),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=file.get("tokenizer.ggml.bos_token_id", int, None),
            eos_token_id=file.get("tokenizer.ggml.eos_token_id", int, None),
            model_type="llama")
    except ConfigError as exc:
        raise file.error(f"metadata gives an invalid config: {exc}") from None


def read_weights(file: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor ``config`` needs, dequantized to float32, in HF names, shapes and q/k
    row order. Missing, unexpected or mis-shaped tensors raise :class:`GGUFError`."""
    expected = {gguf_name(name): (name, shape) for name, shape in parameter_shapes(config).items()}
    present = file.tensors
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise file.error(f"tensor {missing[0]!r}{more} is missing")
    unexpected = [name for name in present if name not in expected]
    if unexpected:
        raise file.error(f"tensor {unexpected[0]!r} is not part of a Llama model the engine runs")
    weights = {hf_name: _tensor(file, present[name], shape)
               for name, (hf_name, shape) in expected.items()}
    for i in range(config.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn."
        for proj, heads in (("q_proj", config.num_attention_heads),
                            ("k_proj", config.num_key_value_heads)):
            for kind in ("weight", "bias"):
                if attn + f"{proj}.{kind}" in weights:
                    weights[attn + f"{proj}.{kind}"] = unpermute_rotary_rows(
                        weights[attn + f"{proj}.{kind}"], heads)
    return weights


def _tensor(file: GGUFFile, tensor: Any, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.quants import dequantize

    found = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if found != shape:
        raise file.error(f"tensor {tensor.name!r} has shape {list(found)} (torch order), the "
                         f"metadata implies {list(shape)}")
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise file.error(f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
                         f"gguf.quants cannot dequantize") from None
    # A copy: F32 data is a read-only view into the memory-mapped file.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 HF-named weights of a GGUF file."""
    file = GGUFFile(path)
    config = read_config(file)
    return config, read_weights(file, config)
