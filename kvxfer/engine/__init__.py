"""The built-in reference engine: a small Llama-style transformer over a paged KV cache in any
kvxfer layout, with in-process tensor parallelism. Modules:

- ``engine``: ``LLMEngine``, model + caches + scheduler + sampler behind one lock;
- ``sequence``: a request's state and lifecycle;
- ``scheduler``: first-come-first-served scheduling onto blocks, preemption;
- ``block_allocator``, ``prefix_cache``: who may write which block; blocks kept for reuse;
- ``transformer``, ``attention``: the model, TP in one process; paged attention;
- ``sampler``: sampling parameters and the per-token sampler;
- ``model_config``, ``weights``, ``checkpoint``: model shape, weights, checkpoint directories;
- ``model_names``, ``gguf``, ``gguf_tokenizer``, ``model_cache``: what ``--model`` accepts,
  GGUF files and their tokenizers, the converted-model cache;
- ``tokenizer``: the byte tokenizer and ``tokenizer.json`` wrapper.

Design: docs/design/engine.md
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.engine.block_allocator import BlockAllocator, NoFreeBlocks
    from kvxfer.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from kvxfer.engine.engine import LLMEngine, layer_name
    from kvxfer.engine.model_config import (
        ConfigError,
        ModelConfig,
        tiny_config,
        tiny_mla_config,
    )
    from kvxfer.engine.model_names import TINY_MODEL
    from kvxfer.engine.sampler import Logprob, SamplingParams
    from kvxfer.engine.sequence import RequestOutput, RequestState
    from kvxfer.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
    from kvxfer.engine.weights import fingerprint, init_weights

# Imported on first use: the tokenizer alone (the proxy's) must not load torch.
_HOMES = {
    "block_allocator": ("BlockAllocator", "NoFreeBlocks"),
    "checkpoint": ("CheckpointError", "load_checkpoint", "save_checkpoint"),
    "engine": ("LLMEngine", "layer_name"),
    "model_config": ("ConfigError", "ModelConfig", "tiny_config", "tiny_mla_config"),
    "model_names": ("TINY_MODEL",),
    "sampler": ("Logprob", "SamplingParams"),
    "sequence": ("RequestOutput", "RequestState"),
    "tokenizer": ("ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"),
    "weights": ("fingerprint", "init_weights"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = [
    "TINY_MODEL", "BlockAllocator", "ByteTokenizer", "CheckpointError", "ConfigError",
    "HFTokenizer", "LLMEngine", "Logprob", "ModelConfig", "NoFreeBlocks", "RequestOutput",
    "RequestState", "SamplingParams", "Tokenizer", "fingerprint", "init_weights",
    "layer_name", "load_checkpoint", "load_tokenizer", "save_checkpoint", "tiny_config",
    "tiny_mla_config",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvxfer.engine.{module}"), name)
