"""``kvxfer bench descriptors``: cost of building one request's descriptor lists.

Times :func:`kvxfer.plan.descriptors.build_requests_descriptors` (block-id validation,
address arithmetic, run merging) for a Llama-8B-like request on every layout and
TP pair, with the per-peer plan precomputed as the worker does at handshake time.
Targets from the planning issue: <= 0.5 us per emitted descriptor and <= 1 ms
per request per decode rank.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

HELP = "time descriptor-list building per request for each layout and TP pair"

TP_PAIRS = ((1, 1), (1, 2), (2, 1), (1, 4), (4, 2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvxfer.harness.synthetic import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=200, help="timed builds per case")


def _case(layout: str, prefill_tp: int, decode_tp: int, args: argparse.Namespace
          ) -> dict[str, Any] | None:
    import numpy as np

    from kvxfer.harness.synthetic import synthetic_rank
    from kvxfer.plan.descriptors import (
        IncompatibleLayoutError,
        build_requests_descriptors,
        plan_peer_reads,
    )
    from kvxfer.plan.topology import read_plan

    blocks = -(-args.tokens // args.block_size)
    capacity = 2 * blocks
    keep, remotes = [], {}
    for rank in range(prefill_tp):
        views, (_, remotes[rank]) = synthetic_rank(layout, prefill_tp, args, capacity)
        keep.append(views)
    views, (_, local) = synthetic_rank(layout, decode_tp, args, capacity)
    try:
        peers = plan_peer_reads(local, remotes, read_plan(0, decode_tp, prefill_tp, args.kv_heads),
                                local_tp=decode_tp, remote_tp=prefill_tp)
    except IncompatibleLayoutError:
        return None
    rng = np.random.default_rng(0)
    lids = rng.choice(capacity, blocks, replace=False)
    rids = rng.choice(capacity, blocks, replace=False)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        descs = build_requests_descriptors(peers, lids, rids)
        times.append(time.perf_counter() - start)
    count = sum(len(d) for d in descs)
    median_us = float(np.median(times)) * 1e6
    return {"layout": layout, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
            "descriptors": count, "us_per_request": round(median_us, 1),
            "us_per_descriptor": round(median_us / count, 3),
            "p90_us_per_request": round(float(np.percentile(times, 90)) * 1e6, 1),
            "meets_targets": median_us <= 1000 and median_us / count <= 0.5}


def run(args: argparse.Namespace) -> int:
    from kvxfer.plan.layout import KVCacheLayout

    rows = [row for layout in KVCacheLayout for p, d in TP_PAIRS
            if (row := _case(layout.name, p, d, args)) is not None]
    if args.json:
        print(json.dumps({"tokens": args.tokens, "rows": rows}, indent=2))
        return 0
    print(f"descriptor building, {args.tokens}-token request, random block ids, decode rank 0")
    print(f"{'layout':7} {'P->D':6} {'descs':>6} {'us/req':>8} {'p90':>8} {'us/desc':>8}  ok")
    for r in rows:
        print(f"{r['layout']:7} {r['prefill_tp']}->{r['decode_tp']:<3} {r['descriptors']:>6} "
              f"{r['us_per_request']:>8} {r['p90_us_per_request']:>8} "
              f"{r['us_per_descriptor']:>8}  {'yes' if r['meets_targets'] else 'NO'}")
    return 0
