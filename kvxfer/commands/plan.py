"""``kvxfer plan``: what a prefill/decode configuration will cost per request."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvxfer.harness.synthetic import add_model_arguments, synthetic_rank

HELP = "show regions, descriptors and bytes per request for a P/D configuration"

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--prefill-layout", default="LBHNC",
                        help="prefill KV layout: LBHNC (default), LBNHC, BLHNC, BLNHC, BHLNC "
                             "or LHBNC")
    parser.add_argument("--decode-layout", default=None,
                        help="decode KV layout (default: the prefill layout)")
    parser.add_argument("--prefill-tp", type=int, default=1, help="prefill TP size")
    parser.add_argument("--decode-tp", type=int, default=1, help="decode TP size")
    parser.add_argument("--prefill-block-size", type=int, default=None, metavar="TOKENS",
                        help="prefill tokens per block (default --block-size)")
    parser.add_argument("--decode-block-size", type=int, default=None, metavar="TOKENS",
                        help="decode tokens per block (default --block-size); one of the "
                             "two block sizes must be a multiple of the other")
    parser.add_argument("--prefill-kernel-block-size", type=int, default=None, metavar="TOKENS",
                        help="tokens per kernel block on the prefill: its attention kernel "
                             "sees each block as consecutive kernel blocks of TOKENS (a "
                             "divisor of the block size; default: the block size, no split)")
    parser.add_argument("--decode-kernel-block-size", type=int, default=None, metavar="TOKENS",
                        help="tokens per kernel block on the decode (as for the prefill)")
    parser.add_argument("--block-ids", choices=["random", "consecutive"], default="random",
                        help="how the request's blocks sit in each cache (default random)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random block ids")
    parser.add_argument("--kv-lora-rank", type=int, default=0, metavar="DIMS",
                        help="an MLA latent cache: per token one latent of --head-size "
                             "elements, the first DIMS of them the compressed KV and the rest "
                             "RoPE dims (DeepSeek-V3: --kv-lora-rank 512 --head-size 576), in "
                             "one head on every rank (replaces --kv-heads)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def plan_configuration(args: argparse.Namespace) -> dict[str, Any]:
    """Plan every decode rank's reads for one request; raises ValueError if incompatible.

    With different block sizes, ``same_block_size_descriptors`` is what the decode
    would post if it used the prefill's block size (and kernel block size): the price
    of the mismatch. With kernel blocks on either side, ``without_kernel_blocks_descriptors``
    is what it would post if neither side split its blocks. An MLA latent cache
    (``--kv-lora-rank``) is one head that every rank holds."""
    if args.kv_lora_rank:
        if not 0 < args.kv_lora_rank < args.head_size:
            raise ValueError(f"--kv-lora-rank must be positive and below the latent's "
                             f"--head-size {args.head_size} (the rest are RoPE dims), got "
                             f"{args.kv_lora_rank}")
        args = argparse.Namespace(**{**vars(args), "kv_heads": 1})
    prefill_bs = args.prefill_block_size or args.block_size
    decode_bs = args.decode_block_size or args.block_size
    prefill_k = getattr(args, "prefill_kernel_block_size", None) or prefill_bs
    decode_k = getattr(args, "decode_kernel_block_size", None) or decode_bs
    for side, size, kernel in (("prefill", prefill_bs, prefill_k), ("decode", decode_bs,
                                                                     decode_k)):
        if kernel <= 0 or size <= 0 or size % kernel:
            raise ValueError(f"--{side}-kernel-block-size {kernel} must divide the {side} "
                             f"block size {size}")
    result = _plan(args, (prefill_bs, prefill_k), (decode_bs, decode_k))
    baselines = {"same_block_size_descriptors": ((prefill_bs, prefill_k), (prefill_bs, prefill_k)),
                 "without_kernel_blocks_descriptors": ((prefill_bs, prefill_bs),
                                                       (decode_bs, decode_bs))}
    if prefill_bs == decode_bs:
        del baselines["same_block_size_descriptors"]
    if (prefill_k, decode_k) == (prefill_bs, decode_bs):
        del baselines["without_kernel_blocks_descriptors"]
    for key, (prefill_sizes, decode_sizes) in baselines.items():
        other = _plan(args, prefill_sizes, decode_sizes)
        for rank, baseline in zip(result["decode_ranks"], other["decode_ranks"], strict=True):
            rank[key] = baseline["descriptors"]
    return result


def _plan(args: argparse.Namespace, prefill_sizes: tuple[int, int],
          decode_sizes: tuple[int, int]) -> dict[str, Any]:
    """One configuration's reads; each side's sizes are (block size, kernel block size)."""
    import numpy as np

    from kvxfer.plan.descriptors import PeerReadPlan, build_requests_descriptors
    from kvxfer.plan.layout import parse_layout
    from kvxfer.plan.staging import StagedRead, layer_groups, plan_reads
    from kvxfer.plan.topology import notify_plan, read_plan
    from kvxfer.transfer.converted.host_reads import plan_host_read
    from kvxfer.transfer.converted.mapped_reads import mappable
    from kvxfer.wire.metadata import HostReads

    (prefill_bs, prefill_k), (decode_bs, decode_k) = prefill_sizes, decode_sizes
    prefill_layout = parse_layout(args.prefill_layout).name
    decode_layout = parse_layout(args.decode_layout or args.prefill_layout).name
    if args.tokens <= 0:
        raise ValueError(f"--tokens must be positive, got {args.tokens}")
    for flag, size in (("--prefill-block-size", prefill_bs), ("--decode-block-size", decode_bs)):
        if size <= 0:
            raise ValueError(f"{flag} must be positive, got {size}")
    blocks = {"prefill": -(-args.tokens // prefill_bs), "decode": -(-args.tokens // decode_bs)}
    rng = np.random.default_rng(args.seed)

    def ids(role: str) -> Any:
        if args.block_ids == "consecutive":
            return np.arange(blocks[role])
        return rng.choice(2 * blocks[role], size=blocks[role], replace=False)

    keep = []  # keep the synthetic buffers alive while their addresses are used
    prefill = {}
    for rank in range(args.prefill_tp):
        views, prefill[rank] = synthetic_rank(prefill_layout, args.prefill_tp, args,
                                              2 * blocks["prefill"], prefill_bs, prefill_k)
        keep.append(views)
    remote_ids = ids("prefill")
    ranks = []
    for rank in range(args.decode_tp):
        views, (plan, local) = synthetic_rank(decode_layout, args.decode_tp, args,
                                              2 * blocks["decode"], decode_bs, decode_k)
        keep.append(views)
        slices = read_plan(rank, args.decode_tp, args.prefill_tp, args.kv_heads)
        peers = plan_reads(local, {r: g for r, (_, g) in prefill.items()}, slices,
                           local_tp=args.decode_tp, remote_tp=args.prefill_tp)
        local_ids = ids("decode")
        direct = [p for p in peers if isinstance(p, PeerReadPlan)]
        descs = build_requests_descriptors(direct, local_ids, remote_ids) if direct else []
        converted = []
        for staged in (p for p in peers if isinstance(p, StagedRead)):
            descs.append(staged.descriptors(np.asarray(remote_ids, dtype=np.int64), 1 << 40))
            # what a prefill process on this host would offer (only counted here)
            offer = HostReads("this host", 1, 1, bytes(16))
            host = plan_host_read(staged, layer_groups(views), offer)
            converted.append({"prefill_rank": staged.remote_rank,
                              "staging_bytes": len(remote_ids) * staged.bytes_per_block,
                              "placed_bytes": len(remote_ids) * staged.placed_per_block,
                              # on one host, a prefill cache in shared memory: mapped, one
                              # local copy (kvxfer.transfer.converted.mapped_reads)
                              "mapped": mappable(staged),
                              # on one host: copied straight into place
                              # (kvxfer.transfer.converted.host_reads)
                              "host_read_unavailable": None if host is not None else (
                                  "the two sides' block sizes differ" if prefill_bs != decode_bs
                                  else "its ranges are too short to pay"),
                              "host_read": None if host is None else {
                                  "local_ranges": len(remote_ids) * len(host.local.off),
                                  "remote_ranges": len(remote_ids) * len(host.remote.off),
                                  "read_bytes": len(remote_ids) * host.read_per_block,
                                  "calls": len(host.copy_calls(len(remote_ids)))}})
        lengths = np.concatenate([d.local[:, 1] for d in descs]) if descs else np.zeros(0)
        notified = notify_plan(rank, args.decode_tp, args.prefill_tp, args.kv_heads)
        ranks.append({
            "converted": converted,
            "decode_rank": rank,
            # prefill ranks whose heads are all read elsewhere: told to free, not read
            "frees_only": sorted(set(notified) - {s.remote_rank for s in slices}),
            "reads_from": [{"prefill_rank": d.remote_rank, "descriptors": len(d),
                            "bytes": d.num_bytes,
                            "prefill_regions": len(prefill[d.remote_rank][0].regions)}
                           for d in descs],
            "decode_regions": len(plan.regions),
            "descriptors": len(lengths),
            "bytes": int(lengths.sum()),
            "bytes_per_descriptor": {"min": int(lengths.min()), "median": int(np.median(lengths)),
                                     "max": int(lengths.max())},
        })
    return {"prefill_layout": prefill_layout, "decode_layout": decode_layout,
            "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp, "tokens": args.tokens,
            "blocks": blocks["prefill"], "decode_blocks": blocks["decode"],
            "layers": args.layers, "kv_heads": args.kv_heads, "head_size": args.head_size,
            "block_size": prefill_bs, "decode_block_size": decode_bs,
            "kernel_block_size": prefill_k, "decode_kernel_block_size": decode_k,
            "dtype": args.dtype,
            "kv_lora_rank": args.kv_lora_rank, "decode_ranks": ranks}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    try:
        result = plan_configuration(args)
    except ValueError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        else:
            print(f"incompatible configuration: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    mismatch = result["block_size"] != result["decode_block_size"]
    kernels = (result["kernel_block_size"], result["decode_kernel_block_size"])
    split = kernels != (result["block_size"], result["decode_block_size"])
    sizes = tuple(f" block {size}" + (f" (kernel {kernel})" if kernel != size else "")
                  if mismatch or split else ""
                  for size, kernel in ((result["block_size"], kernels[0]),
                                       (result["decode_block_size"], kernels[1])))
    print(f"{result['prefill_layout']} TP{result['prefill_tp']}{sizes[0]} (prefill) -> "
          f"{result['decode_layout']} TP{result['decode_tp']}{sizes[1]} (decode): "
          f"{result['tokens']} tokens = {result['blocks']} blocks x {result['layers']} layers, "
          f"{result['dtype']}")
    if mismatch:
        small, large = sorted((result["block_size"], result["decode_block_size"]))
        side = "decode" if result["decode_block_size"] > result["block_size"] else "prefill"
        print(f"  block sizes differ: each {side} block holds {large // small} blocks of the "
              f"other side ({result['decode_blocks']} decode blocks); runs are cut at every "
              f"{small}-token block of both sides, so the decode converts instead of posting "
              f"these descriptors (host caches): from a prefill on this host whose cache is in "
              f"shared memory (kvxfer's sidecars), one copy from its mapped cache; elsewhere "
              f"a few long READs into staging and a local copy")
    if split:
        _explain_kernel_blocks(result)
    if result["kv_lora_rank"]:
        latent, rank_dims = result["head_size"], result["kv_lora_rank"]
        print(f"  MLA latent cache: per token and layer one {latent}-element latent "
              f"({rank_dims} compressed KV + {latent - rank_dims} RoPE dims), replicated on "
              f"every rank; each decode rank reads all of it from one prefill rank")
    for rank in result["decode_ranks"]:
        per = rank["bytes_per_descriptor"]
        sources = ", ".join(f"prefill rank {r['prefill_rank']} ({r['descriptors']} descriptors, "
                            f"{r['prefill_regions']} regions)" for r in rank["reads_from"])
        print(f"  decode rank {rank['decode_rank']}: {rank['decode_regions']} regions; reads "
              f"{_human(rank['bytes'])} in {rank['descriptors']} descriptors from {sources}")
        print(f"    bytes per descriptor: min {_human(per['min'])}, median "
              f"{_human(per['median'])}, max {_human(per['max'])}")
        if rank["frees_only"]:
            told = ", ".join(str(r) for r in rank["frees_only"])
            print(f"    tells prefill rank{'s' * (len(rank['frees_only']) > 1)} {told} to free "
                  f"the request's blocks without reading them (their copy is read elsewhere)")
        for part in rank["converted"]:
            print(f"    converted from prefill rank {part['prefill_rank']} (tokens outside "
                  f"heads, or heads and tokens ordered differently on the two sides):")
            host = part["host_read"]
            if part["mapped"]:
                print(f"      prefill on this host, its cache in shared memory (kvxfer's "
                      f"sidecars): one local copy of {_human(part['placed_bytes'])} from its "
                      f"cache mapped into the decode, no system call per request, no staging "
                      f"(measured 0.8-1.0x the time of a direct read)")
            if host is not None:
                print(f"      prefill on this host{', without shared memory' * part['mapped']}"
                      f": a host read copies "
                      f"{_human(host['read_bytes'])} straight into place, "
                      f"{host['remote_ranges']} ranges into {host['local_ranges']} in "
                      f"{host['calls']} system calls, no staging (measured 0.8-1.5x the time "
                      f"of a direct read; in-process decode ranks of one prefill rank share "
                      f"one copy)")
            where = "elsewhere" if host else \
                f"always ({part['host_read_unavailable']}: no host read)"
            print(f"      {where}: reads "
                  f"{_human(part['staging_bytes'])} into a staging buffer, places "
                  f"{_human(part['placed_bytes'])} of it with one local copy (measured "
                  f"0.75-1.1x the time of a direct read over TCP, where the network is the "
                  f"cost; 1.6-2.5x on one host, where every byte crosses memory twice)")
        if "same_block_size_descriptors" in rank:
            same = rank["same_block_size_descriptors"]
            print(f"    with equal block sizes: {same} descriptors "
                  f"({rank['descriptors'] / same:.2f}x as many now)")
        if "without_kernel_blocks_descriptors" in rank:
            plain = rank["without_kernel_blocks_descriptors"]
            print(f"    without kernel blocks: {plain} descriptors "
                  f"({rank['descriptors'] / plain:.2f}x as many now)")
    return 0


def _explain_kernel_blocks(result: dict[str, Any]) -> None:
    """How the ids of a side whose attention kernel splits its blocks are read."""
    import math

    parts = []
    for side, size, kernel in (("prefill", result["block_size"], result["kernel_block_size"]),
                               ("decode", result["decode_block_size"],
                                result["decode_kernel_block_size"])):
        parts.append(f"each {side} block of {size} tokens is {size // kernel} kernel blocks of "
                     f"{kernel}" if kernel != size else f"{side} blocks are not split")
    unit = math.gcd(result["kernel_block_size"], result["decode_kernel_block_size"])
    print(f"  kernel blocks: {'; '.join(parts)}. Block ids stay logical; each is expanded to "
          f"its kernel blocks, runs are cut every {unit} tokens where the two sides' kernel "
          f"blocks meet and merged again where both sides keep them adjacent; no extra copy")
