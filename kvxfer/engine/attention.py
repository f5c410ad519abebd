"""Paged attention over one layer's logical ``[B, H, N, C]`` KV cache view.

Token position ``p`` lives in block ``block_table[p // N]`` at row ``p % N``. What is read
from the cache is copied into one canonical tensor before any arithmetic, so every layout and
packing gives bit-identical results. :func:`latent_attention` serves latent (MLA) caches.

Design: docs/design/engine.md#attention-over-a-paged-cache
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvxfer.plan.packing import TOKEN_PACKING, kv_views


def _slots(cache: torch.Tensor, block_table: torch.Tensor, start: int, count: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, row) of positions ``[start, start + count)``."""
    block_size = cache.shape[2]
    positions = torch.arange(start, start + count, device=cache.device)
    return block_table[positions // block_size], positions % block_size


def write_rows(cache: torch.Tensor, block_table: torch.Tensor, start: int,
               rows: torch.Tensor) -> None:
    """Store whole content rows ``[T, H, C]`` of positions ``[start, start + T)``."""
    blocks, slots = _slots(cache, block_table, start, rows.shape[0])
    cache[blocks, :, slots] = rows


def write_kv(cache: torch.Tensor, block_table: torch.Tensor, start: int,
             key: torch.Tensor, value: torch.Tensor, packing: str = TOKEN_PACKING) -> None:
    """Store K/V ``[T, H, D]`` of positions ``[start, start + T)`` into their slots."""
    blocks, rows = _slots(cache, block_table, start, key.shape[0])
    keys, values = kv_views(cache, packing)
    # Two index tensors around a slice: the indexed result is [T, H, D], like key.
    keys[blocks, :, rows] = key
    values[blocks, :, rows] = value


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, end: int,
              packing: str = TOKEN_PACKING) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[H, end, D]`` of positions ``[0, end)``, as canonical contiguous copies."""
    if packing == TOKEN_PACKING:  # one gather of K and V together, split after the copy
        packed = gather_rows(cache, block_table, end)
        head_dim = packed.shape[-1] // 2
        return packed[..., :head_dim], packed[..., head_dim:]
    used = block_table[: -(-end // cache.shape[2])]
    keys, values = kv_views(cache, packing)
    return _gathered(keys, used, end), _gathered(values, used, end)


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, end: int) -> torch.Tensor:
    """Whole content rows ``[H, end, C]`` of positions ``[0, end)``, a canonical copy."""
    return _gathered(cache, block_table[: -(-end // cache.shape[2])], end)


def _gathered(part: torch.Tensor, used: torch.Tensor, end: int) -> torch.Tensor:
    """Positions ``[0, end)`` of ``part`` (``[B, H, N, X]``) as a contiguous ``[H, end, X]``."""
    pages = part.index_select(0, used)  # [b, H, N, X]; strides may follow the layout
    heads = pages.shape[1]
    flat = pages.permute(1, 0, 2, 3).reshape(heads, -1, pages.shape[3])[:, :end]
    return flat.contiguous()  # the same memory order whatever the layout and packing


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    cache: torch.Tensor, block_table: torch.Tensor, start: int,
                    scale: float, packing: str = TOKEN_PACKING) -> torch.Tensor:
    """Causal attention of ``T`` new tokens at positions ``[start, start + T)``.

    ``query`` is ``[T, Hq, D]``; ``key``/``value`` are ``[T, Hkv, D]`` and are written
    into the cache first. Positions ``[0, start)`` must already be in the cache: this
    one call serves prefill (``start=0``), decode (``T=1``) and the decode side of a
    disaggregated run (``start=n-1, T=1`` after the first ``n-1`` tokens' KV arrived).
    Query head ``j`` attends with KV head ``j // (Hq // Hkv)``. Returns ``[T, Hq, D]``.
    """
    num_new, _, head_dim = query.shape
    num_kv_heads = key.shape[1]
    end = start + num_new
    _check_table(cache, block_table, end)
    if cache.shape[1] != num_kv_heads or cache.shape[3] != 2 * head_dim:
        raise ValueError(f"cache view {list(cache.shape)} does not hold {num_kv_heads} heads "
                         f"of K+V with head_dim {head_dim}")
    write_kv(cache, block_table, start, key, value, packing)
    keys, values = gather_kv(cache, block_table, end, packing)
    return _attend(query, keys, values, start, scale)


def latent_attention(query: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
                     block_table: torch.Tensor, start: int, scale: float,
                     kv_up: torch.Tensor) -> torch.Tensor:
    """MLA: causal attention of ``T`` new tokens over a latent cache.

    ``query`` is ``[T, Hq, D + R]`` (no-RoPE dims, then the rotated RoPE dims);
    ``latent`` ``[T, L + R]`` is each new token's normalised compressed KV (``L``
    dims) and rotated RoPE key, written into the single-head ``[B, 1, N, L + R]``
    cache first. ``kv_up`` ``[Hq * 2D, L]`` up-projects a cached latent to each query
    head's key no-RoPE part and value (``D`` rows each, head by head); the key's RoPE
    part is the cached one, shared by every head. Returns ``[T, Hq, D]``.
    """
    num_heads, rank, end = query.shape[1], kv_up.shape[1], start + query.shape[0]
    _check_table(cache, block_table, end)
    if cache.shape[1] != 1 or cache.shape[3] != latent.shape[-1]:
        raise ValueError(f"cache view {list(cache.shape)} does not hold one latent of "
                         f"{latent.shape[-1]} elements per token")
    write_rows(cache, block_table, start, latent[:, None])
    cached = gather_rows(cache, block_table, end)[0]  # [end, L + R]
    up = F.linear(cached[:, :rank], kv_up).view(end, num_heads, 2, -1)
    rope = cached[:, None, rank:].expand(end, num_heads, -1)
    keys = torch.cat((up[:, :, 0], rope), dim=-1).transpose(0, 1)  # [Hq, end, D + R]
    values = up[:, :, 1].transpose(0, 1)  # [Hq, end, D]
    return _attend(query, keys.contiguous(), values.contiguous(), start, scale)


def _check_table(cache: torch.Tensor, block_table: torch.Tensor, end: int) -> None:
    block_size = cache.shape[2]
    if block_table.numel() * block_size < end:
        raise ValueError(f"block table of {block_table.numel()} blocks x {block_size} tokens "
                         f"cannot hold positions up to {end}")


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
            scale: float) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, D]`` over positions ``[0, start + T)`` of
    ``keys`` ``[Hkv, end, D]`` and ``values`` ``[Hkv, end, Dv]``; returns ``[T, Hq, Dv]``.
    Query head ``j`` uses KV head ``j // (Hq // Hkv)``."""
    num_new, num_q_heads, head_dim = query.shape
    num_kv_heads, end, value_dim = values.shape
    group = num_q_heads // num_kv_heads
    # [T, Hq, D] -> [Hkv, group * T, D]: each KV head with the query heads it serves.
    q = query.reshape(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * num_new, head_dim)
    scores = (torch.matmul(q, keys.transpose(1, 2)) * scale).float()  # [Hkv, group*T, end]
    query_pos = torch.arange(start, end, device=query.device)
    key_pos = torch.arange(end, device=query.device)
    future = key_pos[None, :] > query_pos[:, None]  # [T, end]
    scores = scores.view(num_kv_heads, group, num_new, end).masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(num_kv_heads, -1, end)
    out = torch.matmul(probs, values)  # [Hkv, group * T, Dv]
    return out.view(num_kv_heads, group, num_new, value_dim).permute(2, 0, 1, 3) \
        .reshape(num_new, num_q_heads, value_dim)
