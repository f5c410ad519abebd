"""``kvxfer bench index``: what the proxy's KV index costs: memory per million blocks
indexed, and the time to score one prompt against one instance (its block keys, then its
longest cached prefix), in one process. Nothing is asserted.

Design: docs/design/kv-events.md#the-index
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc
from typing import Any

HELP = "the proxy's KV index: memory per million blocks, time to score a prompt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=200_000,
                        help="blocks to index, in chains of --chain blocks (default 200000)")
    parser.add_argument("--chain", type=int, default=64,
                        help="blocks per stored sequence (default 64)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--prompt-tokens", default="128,1024,8192",
                        help="prompt lengths to score, comma-separated (default 128,1024,8192)")
    parser.add_argument("--repeats", type=int, default=200,
                        help="scorings timed per prompt length (default 200)")


def _chains(blocks: int, chain: int, size: int) -> list[list[int]]:
    """The token ids of ``blocks`` blocks in sequences of ``chain`` blocks."""
    return [[(start * 131 + i * 7) % 50_000 for i in range(min(chain, blocks - start) * size)]
            for start in range(0, blocks, chain)]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from kvxfer.net.kv_events import BlockStored
    from proxy.kv_index import InstanceIndex, prefix_keys

    size = args.block_size
    chains = _chains(args.blocks, args.chain, size)
    gc.collect()
    tracemalloc.start()
    index, name = InstanceIndex(size), 0
    for tokens in chains:  # each as its instance's event, then gone
        count = len(tokens) // size
        index.apply(BlockStored(list(range(name, name + count)), None, tokens, size))
        name += count
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_million = held * 1_000_000 / max(args.blocks, 1)
    scores = {}
    for length in (int(x) for x in args.prompt_tokens.split(",")):
        hit = (chains[0] * (length // len(chains[0]) + 1))[:length]
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            index.cached_blocks(prefix_keys(hit, size))
            times.append(time.perf_counter() - started)
        scores[length] = {"p50_us": round(1e6 * statistics.median(times), 1),
                          "p90_us": round(1e6 * sorted(times)[int(0.9 * len(times))], 1)}
    return {"config": {"blocks": args.blocks, "chain": args.chain, "block_size": size,
                       "repeats": args.repeats},
            "indexed_blocks": len(index), "bytes_per_million_blocks": round(per_million),
            "score_one_instance": scores}


def run(args: argparse.Namespace) -> int:
    if min(args.blocks, args.chain, args.block_size, args.repeats) < 1:
        print("--blocks, --chain, --block-size and --repeats must be at least 1")
        return 2
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"kvxfer bench index: {report['indexed_blocks']} blocks of {args.block_size} "
          f"tokens in chains of {args.chain}")
    print(f"memory: {report['bytes_per_million_blocks'] / 2**20:.0f} MiB per million blocks "
          f"indexed (one instance)")
    for length, score in report["score_one_instance"].items():
        print(f"scoring a {length}-token prompt against one instance: p50 "
              f"{score['p50_us']} us, p90 {score['p90_us']} us (its block keys, computed "
              f"once per block size, are most of it)")
    return 0
