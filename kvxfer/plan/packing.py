"""How K and V of one head share a block's ``N x C`` elements: the packing vocabulary.

Pure (torch views, no copies, no I/O): ``token`` (:data:`TOKEN_PACKING`) and
``vllm-cpu-<isa>`` (:data:`VLLM_CPU_PACKING_PREFIX`). The two sides must agree on a packing
or the decode converts (:func:`kv_views` takes either apart).

Design: docs/design/plan.md#packing
"""

from __future__ import annotations

import torch

from kvxfer.plan.layout import HEADS_OUTSIDE_TOKENS, KVCacheLayout

TOKEN_PACKING = "token"
VLLM_CPU_PACKING_PREFIX = "vllm-cpu-"
VLLM_CPU_VEC_PACKING = "vllm-cpu-vec"

PACKINGS = (TOKEN_PACKING, VLLM_CPU_VEC_PACKING)
"""The packings :func:`kv_views` takes apart: the reference engine keeps its cache in any
of them, and a decode converts between any two (:mod:`kvxfer.plan.staging`)."""


def check_packing(packing: str, layout: KVCacheLayout) -> None:
    """ValueError unless a cache of ``layout`` can keep its heads' K and V in ``packing``
    (any but ``token`` keeps them as tiles of a block: heads outside tokens)."""
    if packing not in PACKINGS:
        raise ValueError(f"kv_packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
    if packing != TOKEN_PACKING and not layout.heads_outside_tokens:
        raise ValueError(f"kv_packing {packing!r} keeps each head's K and V as tiles of a "
                         f"block, which needs heads outside tokens; layout {layout.name} has "
                         f"them inside (use {', '.join(HEADS_OUTSIDE_TOKENS)})")


def kv_views(cache: torch.Tensor, packing: str = TOKEN_PACKING
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and the V parts of a ``[..., H, N, C]`` cache view (``[B, H, N, C]``, or with
    more leading dims, such as a block's layers), each ``[..., H, N, D]``.

    Views of ``cache``'s memory, never copies. ``vllm-cpu-vec`` needs each head's
    ``N x C`` block contiguous (a layout with heads outside tokens); ValueError otherwise,
    and for a packing not in :data:`PACKINGS`."""
    head_dim = cache.shape[-1] // 2
    if packing == TOKEN_PACKING:
        return cache[..., :head_dim], cache[..., head_dim:]
    if packing != VLLM_CPU_VEC_PACKING:
        raise ValueError(f"kv_packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
    *lead, heads, block_size, content = cache.shape
    if block_size > 1 and (cache.stride(-1) != 1 or cache.stride(-2) != content):
        raise ValueError("kv_packing 'vllm-cpu-vec' needs each head's block contiguous: a "
                         "layout with heads outside tokens (LBHNC, BLHNC, BHLNC, LHBNC)")
    outer, offset = cache.stride()[:-2], cache.storage_offset()
    size = (*lead, heads, block_size, head_dim)
    keys = cache.as_strided(size, (*outer, 1, block_size), offset)  # [D, N] in memory
    values = cache.as_strided(size, (*outer, head_dim, 1), offset + block_size * head_dim)
    return keys, values
