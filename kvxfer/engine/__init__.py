"""The built-in reference engine: a small Llama-style transformer over a paged KV cache
in any kvxfer layout, with in-process tensor parallelism (see ``engine.py``)."""

from kvxfer.engine.block_allocator import BlockAllocator, NoFreeBlocks
from kvxfer.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kvxfer.engine.engine import LLMEngine, layer_name
from kvxfer.engine.model_config import ConfigError, ModelConfig, tiny_config, tiny_mla_config
from kvxfer.engine.model_names import TINY_MODEL
from kvxfer.engine.sampler import Logprob, SamplingParams
from kvxfer.engine.sequence import RequestOutput, RequestState
from kvxfer.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from kvxfer.engine.weights import fingerprint, init_weights

__all__ = [
    "TINY_MODEL", "BlockAllocator", "ByteTokenizer", "CheckpointError", "ConfigError",
    "HFTokenizer", "LLMEngine", "Logprob", "ModelConfig", "NoFreeBlocks", "RequestOutput",
    "RequestState", "SamplingParams", "Tokenizer", "fingerprint", "init_weights",
    "layer_name", "load_checkpoint", "load_tokenizer", "save_checkpoint", "tiny_config",
    "tiny_mla_config",
]
