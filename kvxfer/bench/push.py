"""``kvxfer bench push``: one request's KV pushed into a decode's reservation vs pulled.

Per layout and TP pair, over NIXL (no copies on this host); the ratios are push over pull,
measured in the same run.

Design: docs/design/bench.md#kvxfer-bench-push
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

HELP = "time pushing one request's KV into a decode reservation against pulling it"

CASES = ("LBHNC:1:1", "BLHNC:1:1", "BHLNC:1:1", "LBHNC:1:2", "BLHNC:2:1")
MODES = ("pull", "push", "push/layer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvxfer.harness.synthetic import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=8,
                        help="timed requests per case and mode (default 8, after one warm-up)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated LAYOUT:PREFILL_TP:DECODE_TP entries (default "
                             f"{','.join(CASES)})")


def _parse_cases(text: str) -> list[tuple[str, int, int]]:
    cases = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            layout, prefill_tp, decode_tp = entry.split(":")
            cases.append((layout, int(prefill_tp), int(decode_tp)))
        except ValueError:
            raise SystemExit(f"--cases: {entry!r} is not LAYOUT:PREFILL_TP:DECODE_TP "
                             f"(e.g. BLHNC:1:2)") from None
    if not cases:
        raise SystemExit("--cases names no case")
    return cases


class _Case:
    """One case's prefill instance (in the prefill process) and decode instance (here)."""

    def __init__(self, prefill: Any, case: tuple[str, int, int], args: argparse.Namespace
                 ) -> None:
        import numpy as np

        from kvxfer.harness.loopback import CacheConfig, LoopbackInstance

        layout, prefill_tp, decode_tp = case
        self.prefill, self.case, self.args = prefill, case, args
        self.blocks = -(-args.tokens // args.block_size)
        self.cap = self.blocks + self.blocks // 4 + 1
        base = CacheConfig(layout=layout, total_kv_heads=args.kv_heads, num_layers=args.layers,
                           block_size=args.block_size, head_size=args.head_size,
                           num_blocks=self.cap, dtype=args.dtype, host_reads=False,
                           shared_memory=False)
        self.pcfg = CacheConfig(**{**base.__dict__, "tp": prefill_tp})
        dcfg = CacheConfig(**{**base.__dict__, "tp": decode_tp})
        # every page written, as a serving cache's is (an untouched page's first copy
        # would allocate it, and the run would time that)
        self.remote = prefill.create(self.pcfg, fill="sentinel")
        try:
            self.decode = LoopbackInstance.create("decode", dcfg, fill="sentinel", listen=True)
        except BaseException:
            prefill.drop(self.remote["engine_id"])
            raise
        self.rng = np.random.default_rng(0)
        self.count = 0

    def once(self, mode: str) -> tuple[float, int]:
        """Move one request of fresh random blocks by ``mode``: (seconds, bytes)."""
        self.count += 1
        rid = f"bench-{mode}-{self.count}"
        engine = self.remote["engine_id"]
        remote_ids = self.rng.choice(self.cap, self.blocks, replace=False).tolist()
        local_ids = self.rng.choice(self.cap, self.blocks, replace=False).tolist()
        if mode == "pull":
            self.prefill.hold(engine, rid, remote_ids, ttl=60)
            params = {"remote_engine_id": engine, "remote_host": self.prefill.host,
                      "remote_port": self.remote["port"], "remote_block_ids": remote_ids,
                      "remote_request_id": rid, "tp_size": self.case[1]}
            start = time.perf_counter()
            self.decode.read(rid, params, local_ids)
            stats, failed = self.decode.wait([rid], timeout=60)
            seconds = time.perf_counter() - start
            if failed:
                raise RuntimeError(f"{_name(self.case)} pull: {failed[rid]}")
            moved = sum(s.num_bytes for s in stats[rid])
        else:
            reservation = self.decode.reserve(f"resv-{rid}", local_ids, self.args.tokens,
                                              ttl=60)
            groups = [range(i, i + 1) for i in range(self.args.layers)] \
                if mode == "push/layer" else None
            start = time.perf_counter()
            self.prefill.push(engine, rid, reservation, remote_ids, groups=groups)
            ended = _wait_released(self.decode, f"resv-{rid}")
            seconds = time.perf_counter() - start
            if ended != "done":
                raise RuntimeError(f"{_name(self.case)} {mode}: the reservation ended "
                                   f"{ended!r}")
            moved = self.args.tokens * self.args.layers * self.args.kv_heads * 2 * \
                self.args.head_size * _itemsize(self.args.dtype)
        self.prefill.wait_released(engine, {rid})
        return seconds, moved

    def close(self) -> None:
        self.decode.close()
        self.prefill.drop(self.remote["engine_id"])


def _wait_released(decode: Any, reservation_id: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = decode.released().get(reservation_id)
        if ended is not None:
            return str(ended)
        time.sleep(0.0002)
    return f"nothing within {timeout:g} s"


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 2)


def _name(case: tuple[str, int, int]) -> str:
    return f"{case[0]} TP {case[1]}->{case[2]}"


def _row(prefill: Any, case: tuple[str, int, int], args: argparse.Namespace
         ) -> dict[str, Any]:
    run = _Case(prefill, case, args)
    try:
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        moved = 0
        for i in range(args.repeats + 1):  # the first round warms connections and pages
            for mode in MODES:  # alternated: machine noise hits every mode alike
                seconds, moved = run.once(mode)
                if i:
                    times[mode].append(seconds)
    finally:
        run.close()
    ms = {mode: statistics.median(ts) * 1e3 for mode, ts in times.items()}
    row: dict[str, Any] = {"layout": case[0], "prefill_tp": case[1], "decode_tp": case[2],
                           "bytes": moved}
    for mode in MODES:
        key = mode.replace("/", "_")
        row[f"{key}_ms"] = round(ms[mode], 2)
        row[f"{key}_gb_per_s"] = round(moved / ms[mode] / 1e6, 2)
    row["push_vs_pull"] = round(ms["pull"] / ms["push"], 2)
    row["push_layer_vs_pull"] = round(ms["pull"] / ms["push/layer"], 2)
    return row


def run(args: argparse.Namespace) -> int:
    from kvxfer.harness.loopback import PrefillProcess

    cases = _parse_cases(args.cases)
    if args.tokens < 1 or args.repeats < 1:
        raise SystemExit("--tokens and --repeats must be at least 1")
    prefill = PrefillProcess()
    rows = []
    try:
        for case in cases:
            if not args.json:
                print(f"{_name(case)} ...", flush=True)
            rows.append(_row(prefill, case, args))
    finally:
        prefill.close()
    if args.json:
        print(json.dumps({"tokens": args.tokens, "repeats": args.repeats, "rows": rows},
                         indent=2))
        return 0
    print(f"\n{args.tokens} tokens, {args.layers} layers x {args.kv_heads} KV heads x "
          f"{args.head_size}, {args.dtype}; median of {args.repeats}; speed ratios to pull "
          f"in the same run (above 1: push faster)")
    print(f"{'case':20} {'MiB':>7} {'pull ms':>8} {'push ms':>8} {'x pull':>7} "
          f"{'layer ms':>9} {'x pull':>7}")
    for r in rows:
        name = f"{r['layout']} TP {r['prefill_tp']}->{r['decode_tp']}"
        print(f"{name:20} {r['bytes'] / 2**20:7.1f} {r['pull_ms']:8.2f} {r['push_ms']:8.2f} "
              f"{r['push_vs_pull']:7.2f} {r['push_layer_ms']:9.2f} "
              f"{r['push_layer_vs_pull']:7.2f}")
    return 0
