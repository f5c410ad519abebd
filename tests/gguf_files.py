"""Small GGUF files for tests, written with ``gguf.GGUFWriter`` the way llama.cpp's
converter writes a Llama: its tensor names, its metadata keys (through the writer's own
``add_*`` methods), q/k rows permuted for interleaved RoPE, and dims reversed.

Nothing here uses kvxfer's GGUF code, so a test that reads these files back checks
kvxfer against an independent writer. :func:`write_llama_gguf` takes overrides so a
test can corrupt one thing at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize

from kvxfer.engine.model_config import ModelConfig

# HF name -> llama.cpp name, written out independently of kvxfer.engine.gguf.
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def interleave_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter order: in each head of ``D`` rows, HF row ``i < D/2`` goes to
    row ``2i`` and HF row ``D/2 + i`` to row ``2i + 1``."""
    dim = weight.shape[0] // num_heads
    order = torch.empty(weight.shape[0], dtype=torch.int64)
    for head in range(num_heads):
        for i in range(dim // 2):
            order[head * dim + 2 * i] = head * dim + i
            order[head * dim + 2 * i + 1] = head * dim + dim // 2 + i
    return weight[order]


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (byte-level BPE's base vocabulary)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            out[byte] = chr(byte)
        else:
            out[byte] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def add_byte_tokenizer(writer: GGUFWriter, pre: str = "gpt2", model: str = "gpt2") -> None:
    """A 258-token byte-level vocabulary (ids 0-255 are bytes, 256 BOS, 257 EOS), no merges:
    the same ids as kvxfer's byte tokenizer, so it fits ``tiny_config``."""
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([*byte_level_alphabet(), "<s>", "</s>"])
    writer.add_token_types([1] * 256 + [3, 3])
    writer.add_token_merges([])
    writer.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                             "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def _encoded(weight: torch.Tensor, dtype: str) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    array = weight.detach().float().numpy()
    if dtype == "F32" or array.ndim == 1:  # llama.cpp keeps norms in F32
        return array.astype(np.float32), None
    if dtype == "F16":
        return array.astype(np.float16), None
    qtype = GGMLQuantizationType[dtype]
    return quantize(array, qtype), qtype


def write_llama_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], *,
                     dtype: str = "F32", arch: str = "llama", skip: Sequence[str] = (),
                     extra_tensors: dict[str, np.ndarray] | None = None,
                     replace: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
                     metadata: Callable[[GGUFWriter], None] | None = None,
                     tokenizer: Callable[[GGUFWriter], None] | None = None,
                     skip_keys: Sequence[str] = ()) -> Path:
    """Write ``weights`` (HF names) as llama.cpp would; ``skip`` drops GGUF tensor names,
    ``replace`` stores raw bytes of a type under a GGUF name instead, ``extra_tensors``
    adds some, ``skip_keys`` drops metadata (by the writer method's name, e.g.
    "add_block_count"), ``metadata`` and ``tokenizer`` add more keys."""
    writer = GGUFWriter(str(path), arch)
    keys: dict[str, Any] = {
        "add_context_length": config.max_position_embeddings,
        "add_embedding_length": config.hidden_size,
        "add_block_count": config.num_hidden_layers,
        "add_feed_forward_length": config.intermediate_size,
        "add_head_count": config.num_attention_heads,
        "add_head_count_kv": config.num_key_value_heads,
        "add_rope_freq_base": config.rope_theta,
        "add_layer_norm_rms_eps": config.rms_norm_eps,
        "add_vocab_size": config.vocab_size,
        "add_rope_dimension_count": config.head_dim,
        "add_key_length": config.head_dim,
        "add_value_length": config.head_dim,
    }
    if config.bos_token_id is not None:
        keys["add_bos_token_id"] = config.bos_token_id
    if isinstance(config.eos_token_id, int):
        keys["add_eos_token_id"] = config.eos_token_id
    for method, value in keys.items():
        if method not in skip_keys:
            getattr(writer, method)(value)
    if metadata is not None:
        metadata(writer)
    if tokenizer is not None:
        tokenizer(writer)
    for hf_name, weight in weights.items():
        name = llama_cpp_name(hf_name)
        if name in skip:
            continue
        if ".attn_q." in name:
            weight = interleave_rotary_rows(weight, config.num_attention_heads)
        elif ".attn_k." in name:
            weight = interleave_rotary_rows(weight, config.num_key_value_heads)
        array, qtype = (replace or {}).get(name) or _encoded(weight, dtype)
        writer.add_tensor(name, array, raw_dtype=qtype)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_weights(weights: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """What a reader must get back from :func:`write_llama_gguf` at ``dtype``: the weights
    rounded through that encoding (row-wise, so q/k row order does not matter)."""
    from gguf.quants import dequantize

    out = {}
    for name, weight in weights.items():
        array, qtype = _encoded(weight, dtype)
        if qtype is not None:
            array = dequantize(array, qtype)
        out[name] = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(weight.shape)
    return out


BROKEN_CASES = ("wrong magic", "truncated data", "truncated header", "empty", "not llama",
                "missing tensor", "unexpected tensor", "unsupported quantization",
                "missing metadata", "rope scaling", "wrong shape")


def _mangle(path: Path, keep: int | None = None, head: bytes | None = None) -> Path:
    data = path.read_bytes()
    if head is not None:
        data = head + data[len(head):]
    path.write_bytes(data[:keep])
    return path


def write_broken_gguf(tmp_path: Path, config: ModelConfig, weights: dict[str, torch.Tensor],
                      case: str) -> Path:
    """A GGUF file in ``tmp_path`` broken in one way (one of :data:`BROKEN_CASES`)."""
    path = tmp_path / f"{case}.gguf"
    if case == "wrong magic":
        return _mangle(write_llama_gguf(path, config, weights), head=b"GGML")
    if case == "truncated data":
        write_llama_gguf(path, config, weights)
        return _mangle(path, keep=path.stat().st_size - 4096)
    if case == "truncated header":
        return _mangle(write_llama_gguf(path, config, weights), keep=200)
    if case == "empty":
        path.write_bytes(b"")
        return path
    if case == "not llama":
        return write_llama_gguf(path, config, weights, arch="qwen2")
    if case == "missing tensor":
        return write_llama_gguf(path, config, weights, skip=["blk.1.ffn_up.weight"])
    if case == "unexpected tensor":
        return write_llama_gguf(path, config, weights,
                                extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    if case == "unsupported quantization":
        # Q8_1 is a real llama.cpp type that gguf.quants cannot dequantize.
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
        q8_1 = np.zeros((config.intermediate_size, config.hidden_size // block * size), np.uint8)
        return write_llama_gguf(path, config, weights, replace={
            "blk.0.ffn_up.weight": (q8_1, GGMLQuantizationType.Q8_1)})
    if case == "missing metadata":
        return write_llama_gguf(path, config, weights, skip_keys=["add_block_count"])
    if case == "rope scaling":
        return write_llama_gguf(path, config, weights, metadata=lambda w: w.add_rope_scaling_type(
            RopeScalingType.YARN))
    if case == "wrong shape":
        return write_llama_gguf(path, dataclasses.replace(config, intermediate_size=128),
                                weights)
    raise AssertionError(case)
