"""The reference engine's ``kv_packing``: ``vllm-cpu-vec`` (per head and block, K
transposed then V by rows, as vLLM's CPU attention kernels store float32 caches) computes
exactly what ``token`` does, and really lays the cache out that way."""

from __future__ import annotations

import pytest
import torch

from kvxfer.engine import LLMEngine, SamplingParams, tiny_config
from kvxfer.engine.attention import gather_kv, write_kv
from kvxfer.engine.tokenizer import ByteTokenizer
from kvxfer.plan.packing import kv_views
from kvxfer.sidecar.roles.composition import compat_info

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
PROMPTS = ["the decode side pulls the prefill's blocks", "x", "K transposed, then V"]


def engine(layout: str, packing: str) -> LLMEngine:
    return LLMEngine(tiny_config(), None, seed=3, block_size=4, num_blocks=64, layout=layout,
                     kv_packing=packing)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "BHLNC"])
def test_vllm_packing_gives_the_same_tokens_and_logprobs(layout: str) -> None:
    prompts = [ByteTokenizer().encode(t) for t in PROMPTS]
    token = engine(layout, "token").generate(prompts, GREEDY)
    tile = engine(layout, "vllm-cpu-vec").generate(prompts, GREEDY)
    for a, b in zip(token, tile, strict=True):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]


def test_vllm_packing_stores_k_transposed_then_v_by_rows() -> None:
    cache = torch.zeros(3, 2, 4, 6)  # [B, H, N, C]: head size 3
    key = torch.arange(1, 4 * 2 * 3 + 1, dtype=torch.float32).reshape(4, 2, 3)
    write_kv(cache, torch.tensor([2]), 0, key, -key, "vllm-cpu-vec")
    tile = cache[2, 1].reshape(-1)  # block 2, head 1: [N * C] in memory order
    assert torch.equal(tile[:12], key[:, 1].t().reshape(-1))  # K: dimension d of token t at d*N+t
    assert torch.equal(tile[12:], -key[:, 1].reshape(-1))  # V: token rows
    keys, values = gather_kv(cache, torch.tensor([2]), 3, "vllm-cpu-vec")
    assert torch.equal(keys, key[:3].permute(1, 0, 2))
    assert torch.equal(values, -key[:3].permute(1, 0, 2))


def test_vllm_packing_needs_heads_outside_tokens() -> None:
    with pytest.raises(ValueError, match="heads outside tokens; layout LBNHC"):
        engine("LBNHC", "vllm-cpu-vec")
    with pytest.raises(ValueError, match="each head's block contiguous"):
        kv_views(torch.zeros(2, 4, 3, 8).permute(0, 2, 1, 3), "vllm-cpu-vec")
    with pytest.raises(ValueError, match="kv_packing must be one of token, vllm-cpu-vec"):
        engine("LBHNC", "interleaved")


def test_the_packing_is_part_of_what_peers_must_share() -> None:
    assert compat_info(engine("LBHNC", "vllm-cpu-vec")).kv_packing == "vllm-cpu-vec"
    assert compat_info(engine("LBHNC", "token")).kv_packing == "token"
