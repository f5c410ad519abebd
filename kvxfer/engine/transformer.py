"""The transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, lm head.

Tensor parallelism runs in one process: rank ``r`` holds the KV heads
``rank_heads(r, tp, num_key_value_heads)`` and its own KV cache, and the ranks' partial
outputs are summed in rank order. Numerics follow Hugging Face Llama (RoPE frequencies,
RMSNorm, softmax and logits in float32).

Design: docs/design/engine.md#the-transformer-and-tensor-parallelism
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvxfer.engine.attention import latent_attention, paged_attention
from kvxfer.engine.model_config import ModelConfig
from kvxfer.engine.weights import WeightsError, check_tensor_shapes
from kvxfer.plan.packing import TOKEN_PACKING
from kvxfer.plan.topology import rank_heads


@dataclass(frozen=True)
class Segment:
    """One sequence's slice of a flattened batch.

    Its ``num_tokens`` new tokens sit at positions ``[start, start + num_tokens)``;
    positions ``[0, start)`` are already in the cache. ``block_tables[r]`` is the
    sequence's int64 block table on TP rank ``r``'s device (the ids are the same
    on every rank; each rank has its own cache).
    """

    start: int
    num_tokens: int
    block_tables: tuple[torch.Tensor, ...]


@dataclass
class LatentWeights:
    """MLA's latent projections on one rank: down and norm whole, up for its query heads."""

    down: torch.Tensor         # [kv_lora_rank + qk_rope_head_dim, hidden], every rank
    norm: torch.Tensor         # [kv_lora_rank]
    up: torch.Tensor           # [q_heads * 2 * head_dim, kv_lora_rank]


@dataclass
class RankLayer:
    """One layer's weights on one TP rank (``[out, in]`` matrices, HF orientation)."""

    qkv: torch.Tensor          # q rows, then k rows, then v rows of this rank's heads (MLA: q)
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor       # [hidden, q_heads * head_dim]
    gate_up: torch.Tensor      # gate rows, then up rows of this rank's intermediate slice
    down: torch.Tensor         # [hidden, intermediate / tp]
    latent: LatentWeights | None = None  # MLA only


@dataclass
class RankWeights:
    q_heads: range
    kv_heads: range
    layers: list[RankLayer]


def query_heads(rank: int, tp: int, config: ModelConfig) -> range:
    """Query heads of ``rank``; checks that they all use the rank's KV heads."""
    per = config.num_attention_heads // tp
    heads = range(rank * per, (rank + 1) * per)
    kv = rank_heads(rank, tp, config.num_key_value_heads)
    group = config.queries_per_kv_head
    if any(h // group not in kv for h in heads):
        raise ValueError(f"TP {tp}: query heads {heads.start}-{heads.stop - 1} of rank {rank} "
                         f"do not all belong to its KV heads {kv.start}-{kv.stop - 1}")
    return heads


def tp_problem(config: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` ranks cannot run ``config`` (None when they can): ``tp`` must split the
    KV heads evenly or be a multiple of them (replication), and split the query heads
    and the MLP's intermediate dim evenly."""
    try:
        for rank in range(tp):
            query_heads(rank, tp, config)  # also checks the KV head split
    except ValueError as exc:
        return str(exc)
    if config.num_attention_heads % tp:
        return f"TP {tp} does not divide num_attention_heads={config.num_attention_heads}"
    if config.intermediate_size % tp:
        return f"TP {tp} does not divide intermediate_size={config.intermediate_size}"
    return None


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Every TP size that can run ``config`` (none exceeds the query head count)."""
    return [tp for tp in range(1, config.num_attention_heads + 1)
            if tp_problem(config, tp) is None]


def check_tp(config: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the reason and the TP sizes that would work."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"TP size must be a positive integer, got {tp!r}")
    problem = tp_problem(config, tp)
    if problem is not None:
        sizes = ", ".join(f"{n} (KV heads replicated)" if n > config.num_key_value_heads
                          else str(n) for n in valid_tp_sizes(config))
        raise ValueError(f"{problem}; TP sizes that fit this model "
                         f"({config.num_attention_heads} query heads, "
                         f"{config.num_key_value_heads} KV heads, intermediate_size "
                         f"{config.intermediate_size}): {sizes}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, scale in the model dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Pairs element ``i`` with ``i + D/2`` (HF's convention, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Transformer:
    """Weights sharded over ``tp`` in-process ranks, and the batched forward pass."""

    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], *,
                 tp: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu",
                 kv_packing: str = TOKEN_PACKING) -> None:
        check_tp(config, tp)
        if kv_packing != TOKEN_PACKING and config.is_mla:
            raise ValueError(f"kv_packing {kv_packing!r} arranges K and V of a head; an MLA "
                             f"model's cache holds one latent per token (use 'token')")
        self.kv_packing = kv_packing  # how K and V share a head's block (plan/packing.py)
        try:
            check_tensor_shapes({n: (tuple(t.shape), "state_dict") for n, t in state_dict.items()},
                                config, "the given state_dict")
        except WeightsError as exc:
            raise ValueError(str(exc)) from None
        self.config, self.tp, self.dtype = config, tp, dtype
        self.device = torch.device(device)
        # Fresh copies: the engine owns its weights, and every weight starts on an allocator-
        # aligned address (GEMM kernels may round differently for unaligned inputs, e.g. a
        # tensor inside a safetensors buffer), so numbers do not depend on how it was loaded.
        full = {name: t.to(device=self.device, dtype=dtype, copy=True)
                for name, t in state_dict.items()}
        self.embed = full["model.embed_tokens.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else full["lm_head.weight"]
        self.final_norm = full["model.norm.weight"]
        self.input_norms = [full[f"model.layers.{i}.input_layernorm.weight"]
                            for i in range(config.num_hidden_layers)]
        self.post_norms = [full[f"model.layers.{i}.post_attention_layernorm.weight"]
                           for i in range(config.num_hidden_layers)]
        self.ranks = [self._shard(full, rank) for rank in range(tp)]
        rotary = config.rotary_dim
        half = torch.arange(0, rotary, 2, dtype=torch.int64).to(self.device).float()
        self.inv_freq = 1.0 / (config.rope_theta ** (half / rotary))

    def _shard(self, full: dict[str, torch.Tensor], rank: int) -> RankWeights:
        cfg, dim = self.config, self.config.head_dim
        q_heads, kv_heads = query_heads(rank, self.tp, cfg), rank_heads(rank, self.tp,
                                                                        cfg.num_key_value_heads)
        q_rows = slice(q_heads.start * dim, q_heads.stop * dim)
        kv_rows = slice(kv_heads.start * dim, kv_heads.stop * dim)
        inter = cfg.intermediate_size // self.tp
        mlp_rows = slice(rank * inter, (rank + 1) * inter)
        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            latent = self._latent_shard(full, attn, q_heads) if cfg.is_mla else None
            if latent is not None:  # queries carry RoPE dims too: rows per head differ
                rows = cfg.head_dim + cfg.qk_rope_head_dim
                qkv = full[attn + "q_proj.weight"][q_heads.start * rows:q_heads.stop * rows]
            else:
                qkv = torch.cat([full[attn + "q_proj.weight"][q_rows],
                                 full[attn + "k_proj.weight"][kv_rows],
                                 full[attn + "v_proj.weight"][kv_rows]])
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([full[attn + "q_proj.bias"][q_rows],
                                  full[attn + "k_proj.bias"][kv_rows],
                                  full[attn + "v_proj.bias"][kv_rows]])
            layers.append(RankLayer(
                qkv=qkv, qkv_bias=bias,
                o_proj=full[attn + "o_proj.weight"][:, q_rows].contiguous(),
                gate_up=torch.cat([full[p + "mlp.gate_proj.weight"][mlp_rows],
                                   full[p + "mlp.up_proj.weight"][mlp_rows]]),
                down=full[p + "mlp.down_proj.weight"][:, mlp_rows].contiguous(),
                latent=latent))
        return RankWeights(q_heads, kv_heads, layers)

    def _latent_shard(self, full: dict[str, torch.Tensor], attn: str,
                      q_heads: range) -> LatentWeights:
        rows = 2 * self.config.head_dim  # per query head: its key's no-RoPE part, its value
        return LatentWeights(
            down=full[attn + "kv_a_proj_with_mqa.weight"],
            norm=full[attn + "kv_a_layernorm.weight"],
            up=full[attn + "kv_b_proj.weight"][q_heads.start * rows:q_heads.stop * rows])

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, rotary_dim]`` in the model dtype (computed in float32, as
        HF does)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(self.dtype)[:, None, :], angles.sin().to(self.dtype)[:, None, :]

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, segments: list[Segment],
                kv_caches: list[list[torch.Tensor]],
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run the flattened tokens of ``segments`` (in order) through the model.

        ``kv_caches[r][layer]`` is rank ``r``'s ``[B, H, N, C]`` view of that layer.
        Writes every new token's K/V into the caches and returns float32 logits
        ``[len(segments), vocab]`` of each segment's last token. ``on_layer(i)`` is
        called once layer ``i`` wrote its K/V, before layer ``i + 1`` runs.
        """
        positions = torch.cat([torch.arange(s.start, s.start + s.num_tokens)
                               for s in segments]).to(self.device)
        cos, sin = self.rope(positions)
        hidden = self.embed[token_ids.to(self.device)]
        eps = self.config.rms_norm_eps
        attention = self._latent_attention if self.config.is_mla else self._attention
        for i in range(self.config.num_hidden_layers):
            x = rms_norm(hidden, self.input_norms[i], eps)
            hidden = hidden + self._all_reduce(
                [attention(x, cos, sin, segments, r, i, kv_caches[r][i])
                 for r in range(self.tp)])
            if on_layer is not None:
                on_layer(i)
            x = rms_norm(hidden, self.post_norms[i], eps)
            hidden = hidden + self._all_reduce([self._mlp(x, rank.layers[i])
                                                for rank in self.ranks])
        last = torch.tensor([s.num_tokens for s in segments]).cumsum(0) - 1
        final = rms_norm(hidden[last.to(self.device)], self.final_norm, eps)
        return (final @ self.lm_head.T).float()

    @staticmethod
    def _all_reduce(partials: list[torch.Tensor]) -> torch.Tensor:
        total = partials[0]
        for partial in partials[1:]:
            total = total + partial
        return total

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   segments: list[Segment], rank_index: int, layer: int,
                   cache: torch.Tensor) -> torch.Tensor:
        rank = self.ranks[rank_index]
        weights, dim = rank.layers[layer], self.config.head_dim
        num_q, num_kv = len(rank.q_heads), len(rank.kv_heads)
        qkv = F.linear(x, weights.qkv, weights.qkv_bias)
        q, k, v = torch.split(qkv, [num_q * dim, num_kv * dim, num_kv * dim], dim=-1)
        q = q.reshape(-1, num_q, dim)
        k = k.reshape(-1, num_kv, dim)
        v = v.reshape(-1, num_kv, dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = torch.empty_like(q)
        offset, scale = 0, dim ** -0.5
        for seg in segments:
            rows = slice(offset, offset + seg.num_tokens)
            out[rows] = paged_attention(q[rows], k[rows], v[rows], cache,
                                        seg.block_tables[rank_index], seg.start, scale,
                                        self.kv_packing)
            offset += seg.num_tokens
        return F.linear(out.reshape(-1, num_q * dim), weights.o_proj)

    def _latent_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          segments: list[Segment], rank_index: int, layer: int,
                          cache: torch.Tensor) -> torch.Tensor:
        """MLA on one rank: its query heads over the latent cache it holds whole."""
        rank, cfg = self.ranks[rank_index], self.config
        weights, dim, rank_dims = rank.layers[layer], cfg.head_dim, cfg.kv_lora_rank
        assert weights.latent is not None
        num_q = len(rank.q_heads)
        q = F.linear(x, weights.qkv).reshape(-1, num_q, dim + cfg.qk_rope_head_dim)
        q_rope = q[..., dim:]
        q = torch.cat((q[..., :dim], q_rope * cos + rotate_half(q_rope) * sin), dim=-1)
        compressed, k_rope = torch.split(F.linear(x, weights.latent.down),
                                         [rank_dims, cfg.qk_rope_head_dim], dim=-1)
        k_rope = (k_rope[:, None] * cos + rotate_half(k_rope[:, None]) * sin)[:, 0]
        latent = torch.cat((rms_norm(compressed, weights.latent.norm, cfg.rms_norm_eps),
                            k_rope), dim=-1)
        out = torch.empty(q.shape[0], num_q, dim, dtype=q.dtype, device=q.device)
        offset, scale = 0, (dim + cfg.qk_rope_head_dim) ** -0.5
        for seg in segments:
            rows = slice(offset, offset + seg.num_tokens)
            out[rows] = latent_attention(q[rows], latent[rows], cache,
                                         seg.block_tables[rank_index], seg.start, scale,
                                         weights.latent.up)
            offset += seg.num_tokens
        return F.linear(out.reshape(-1, num_q * dim), weights.o_proj)

    def _mlp(self, x: torch.Tensor, weights: RankLayer) -> torch.Tensor:
        gate, up = F.linear(x, weights.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, weights.down)
