"""What a vLLM layer's KV cache view holds, read from its shape (pure: no vLLM import).

vLLM 0.32 hands one logical ``[B, H, N, C]`` view per layer. A backend's ``H`` slots are one
per KV head, K and V heads apart, or two (K, V) holding every head; the last cannot be split
across TP ranks (its peers must run the same TP).

Design: docs/design/vllm-connector.md#what-a-backends-cache-view-holds
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvxfer.plan.layout import CacheSpec


def cache_spec(shape: Sequence[int], dtype: torch.dtype, head_size: int, num_kv_heads: int,
               num_head_slots: int | None = None) -> CacheSpec:
    """The spec of one rank's layer view of ``shape`` ``[B, H, N, C]`` holding
    ``num_kv_heads`` heads of ``head_size`` (this rank's share), in the form the backend's
    ``num_head_slots`` names (vLLM's ``AttentionSpec`` field: ``None`` is one slot per KV
    head). The shape alone cannot tell the forms apart (two KV heads of 8 are
    ``[B, 2, N, 16]`` in the first and the third); ValueError when the shape does not
    hold the form."""
    if len(shape) != 4:
        raise ValueError(f"KvxferConnector needs vLLM's [blocks, head slots, block size, "
                         f"content] layer views; got a view of shape {list(shape)}")
    _, slots, block_size, content = shape
    if num_head_slots is None:
        form, want = "one slot per KV head, K then V in each token's row", \
            (num_kv_heads, 2 * head_size)
        spec = CacheSpec(block_size, num_kv_heads, head_size, dtype)
    elif num_head_slots == 2 * num_kv_heads:
        form, want = "K heads, then V heads, as slots", (2 * num_kv_heads, head_size)
        spec = CacheSpec(block_size, num_kv_heads, head_size, dtype,
                         separate_kv_head_groups=True)
    elif num_head_slots == 2:
        form, want = "a K and a V slot of every KV head", (2, num_kv_heads * head_size)
        spec = CacheSpec(block_size, 1, num_kv_heads * head_size, dtype,
                         separate_kv_head_groups=True)
    else:
        raise ValueError(f"KvxferConnector knows vLLM's head-slot forms None, 2 x KV heads "
                         f"({2 * num_kv_heads}) and 2; this backend declares num_head_slots="
                         f"{num_head_slots}")
    if (slots, content) != want:
        raise ValueError(f"a layer view of shape {list(shape)} does not hold {num_kv_heads} KV "
                         f"heads of {head_size} as {form} (num_head_slots={num_head_slots}): "
                         f"that needs [B, {want[0]}, N, {want[1]}]")
    return spec
