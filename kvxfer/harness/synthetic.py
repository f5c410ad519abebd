"""Address-only KV caches of a model shape, for ``kvxfer plan`` and the benchmarks that
price a configuration without moving its bytes."""

from __future__ import annotations

import argparse
from typing import Any

DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model-shape flags shared by ``kvxfer plan`` and the benchmarks (Llama-8B-like
    defaults)."""
    parser.add_argument("--layers", type=int, default=32, help="layers (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="total KV heads (default 8)")
    parser.add_argument("--head-size", type=int, default=128, help="head size (default 128)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="cache dtype")


def synthetic_rank(layout: str, tp: int, args: argparse.Namespace, num_blocks: int,
                   block_size: int | None = None, kernel_block_size: int | None = None
                   ) -> tuple[Any, Any]:
    """An address-only cache for one rank: ``torch.empty`` never touches its pages; its
    views at ``kernel_block_size`` when given: (its views, which keep the buffer alive,
    (plan, geometry))."""
    import torch

    from kvxfer.plan.descriptors import SideGeometry
    from kvxfer.plan.layout import CacheSpec, reshape_kv_cache
    from kvxfer.plan.regions import plan_regions
    from kvxfer.plan.topology import heads_per_rank

    spec = CacheSpec(block_size or args.block_size, heads_per_rank(tp, args.kv_heads),
                     args.head_size, getattr(torch, args.dtype),
                     latent=getattr(args, "kv_lora_rank", 0) > 0)
    raw = torch.empty(args.layers * num_blocks * spec.page_size_bytes, dtype=torch.uint8)
    views = reshape_kv_cache(raw, spec, num_blocks, args.layers, layout,
                             block_size=kernel_block_size)
    plan = plan_regions({f"model.layers.{i}": v for i, v in enumerate(views)}, spec, num_blocks,
                        layout)
    return views, (plan, SideGeometry.from_plan(plan))
