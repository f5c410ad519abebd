"""``kvxfer bench transfer``: one request's KV moved between two processes, per layout/TP.

Against two ceilings measured in the same run for the same bytes: one large NIXL READ and a
single-thread memcpy. ``--transport tcp`` adds a run over TCP.

Design: docs/design/bench.md#kvxfer-bench-transfer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

HELP = "time KV transfers between a prefill and a decode process for each layout and TP pair"

# (layout, prefill TP, decode TP[, prefill block size, decode block size]); block sizes
# default to --block-size, "P/D" names two layouts. A block-size case is compared with
# its native one (same layouts and TP, equal block sizes), a converted one (a host read,
# kvxfer.transfer.converted.host_reads, or a read through staging, kvxfer.plan.staging) with the
# same case in the heads-outside-tokens twin layouts; each runs in alternation with it (_case).
Case = tuple[str, int, int] | tuple[str, int, int, int, int]
CASES: tuple[Case, ...] = (
    ("LBHNC", 1, 1), ("LBNHC", 1, 1), ("BLHNC", 1, 1), ("BLNHC", 1, 1), ("BHLNC", 1, 1),
    ("LBHNC", 1, 2), ("BLHNC", 1, 2), ("BHLNC", 1, 2),
    ("LBHNC", 2, 1), ("BLHNC", 2, 1), ("BHLNC", 2, 1),
    ("LBHNC", 1, 1, 16, 32), ("BLHNC", 1, 1, 16, 32), ("BHLNC", 1, 1, 32, 16),
    ("BLHNC", 1, 2, 16, 64),
    ("LBNHC", 1, 2), ("BLNHC", 1, 2), ("BLNHC", 2, 1), ("LBHNC/LBNHC", 1, 1))
TWIN = {"LBNHC": "LBHNC", "BLNHC": "BLHNC"}  # the same order with heads outside tokens
COALESCING = ("BLHNC", "BLNHC", "BHLNC")
DEFAULT_VS_MEMCPY = 0.8  # what a case on its default path must reach of one memcpy thread
# what a prefill offers a decode on its host: its cache mapped (kvxfer's default), host
# reads of a cache in private memory, nothing (as across machines)
OFFERS = ("mapped", "host", "none")
TCP_CASES = "LBHNC:1:1,BLHNC:1:1"  # --transport tcp without --cases: bounded (TCP is slow)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvxfer.harness.synthetic import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=10, help="timed requests per case")
    parser.add_argument("--read-lanes", type=int, default=2, metavar="N",
                        help="decode copy threads per instance, shared by its TP ranks (default "
                             "2, as kvxfer serve; 1 for a single posting thread)")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated LAYOUT:PTP:DTP[:PBS:DBS] entries, e.g. "
                             f"BLHNC:1:2 or LBHNC:1:1:16:32 (prefill and decode block sizes; "
                             f"default --block-size) (default all; with --transport tcp "
                             f"{TCP_CASES})")
    parser.add_argument("--host-reads", choices=["both", "on", "off", "all"], default="both",
                        help="both runs each case on its default path on this host (the "
                             "prefill's cache offered mapped, the path chosen by the decode) "
                             "and as across machines (NIXL READs; converted cases through "
                             "staging); on or off runs one; all adds, for converted cases, "
                             "host reads of a prefill without shared memory "
                             "(process_vm_readv) (default both; --transport tcp: off)")
    parser.add_argument("--transport", choices=["default", "tcp"], default="default",
                        help="default: UCX's own choice (cma on one host); tcp: also every "
                             "case with UCX_TLS=tcp, the ratio printed beside (default "
                             "default)")
    parser.add_argument("--path", choices=["auto", "loopback"], default="auto",
                        help="--transport tcp: auto runs prefill and decode in two network "
                             "namespaces joined by a veth pair when root (else loopback); "
                             "loopback stays on 127.0.0.1 (default auto)")
    # internal: the decode half of a namespace run, started by the command itself
    parser.add_argument("--prefill-netns", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prefill-host", default="127.0.0.1", help=argparse.SUPPRESS)


def _parse_cases(text: str, block_size: int) -> list[tuple[str, int, int, int, int]]:
    """Every case with its two block sizes filled in."""
    entries: list[Case] = list(CASES) if text == "all" else []
    if text != "all":
        for item in text.split(","):
            fields = item.split(":")
            try:
                if len(fields) not in (3, 5):
                    raise ValueError(item)
                numbers = tuple(int(x) for x in fields[1:])
            except ValueError:
                raise SystemExit(f"--cases: {item!r} is not LAYOUT:PREFILL_TP:DECODE_TP or "
                                 f"LAYOUT:PREFILL_TP:DECODE_TP:PREFILL_BLOCK:DECODE_BLOCK"
                                 ) from None
            entries.append((fields[0].upper(), *numbers))  # type: ignore[arg-type]
    out = []
    for case in entries:
        layout, p, d = case[:3]
        pbs, dbs = case[3:] if len(case) == 5 else (block_size, block_size)
        out.append((layout, p, d, pbs, dbs))
    return out


def _case_name(case: tuple[str, int, int, int, int]) -> str:
    layout, p, d, pbs, dbs = case
    return f"{layout}:{p}:{d}:{pbs}:{dbs}"


class _Memcpy:
    """A single-thread memcpy of ``nbytes`` (numpy's, which copies on the calling thread),
    timed once per :meth:`once` (its buffers written once first: no page is faulted in
    a timed copy)."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        np.copyto(self.dst, self.src)

    def once(self) -> float:
        import numpy as np

        start = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - start


def _large_read_seconds(host: str, port: int, cfg: Any, nbytes: int, repeats: int) -> float:
    """One NIXL READ of ``nbytes`` from the start of prefill rank 0's cache."""
    import numpy as np
    import torch

    from kvxfer.plan.regions import MemoryRegion
    from kvxfer.transfer.nixl_agent import NixlAgent
    from kvxfer.transfer.side_channel.client import SideChannelClient

    client = SideChannelClient("bench-ceiling", cfg.compat())
    meta = client.fetch(host, port, [0]).ranks[0]
    client.close()
    mem = meta.plan.memory[0]
    size = min(nbytes, mem.nbytes)
    buffer = torch.empty(size, dtype=torch.uint8)
    buffer.fill_(0)
    with NixlAgent("bench-ceiling") as agent:
        agent.register([MemoryRegion(buffer.data_ptr(), size, 0)])
        name = agent.add_remote(meta.agent_blob)
        agent.connect(name, probe=mem)
        local = np.array([[buffer.data_ptr(), size, 0]], dtype=np.uint64)
        remote = np.array([[mem.addr, size, 0]], dtype=np.uint64)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            transfer = agent.read(name, local, remote)
            while transfer.state() != "DONE":
                pass
            times.append(time.perf_counter() - start)
            transfer.release()
    return statistics.median(times[1:]) * nbytes / size


class _Run:
    """One case's prefill instance (in the prefill process) and decode instance (here)."""

    def __init__(self, prefill: Any, case: tuple[str, int, int, int, int],
                 args: argparse.Namespace, offer: str) -> None:
        import numpy as np

        from kvxfer.harness.loopback import CacheConfig, LoopbackInstance

        layout, prefill_tp, decode_tp, prefill_bs, decode_bs = case
        prefill_layout, decode_layout = _layouts(layout)
        self.prefill, self.case, self.args, self.offer = prefill, case, args, offer
        self.pblocks, self.dblocks = -(-args.tokens // prefill_bs), -(-args.tokens // decode_bs)
        self.pcap = self.pblocks + self.pblocks // 4 + 1
        self.dcap = self.dblocks + self.dblocks // 4 + 1
        base = CacheConfig(layout=prefill_layout, total_kv_heads=args.kv_heads,
                           num_layers=args.layers, block_size=prefill_bs,
                           head_size=args.head_size, num_blocks=self.pcap, dtype=args.dtype,
                           host_reads=offer != "none", shared_memory=offer == "mapped")
        self.pcfg = CacheConfig(**{**base.__dict__, "tp": prefill_tp})
        dcfg = CacheConfig(**{**base.__dict__, "tp": decode_tp, "read_lanes": args.read_lanes,
                              "block_size": decode_bs, "num_blocks": self.dcap,
                              "layout": decode_layout})
        # every page written, as a serving instance's cache is: a cache never written is
        # holes of its memory, which the first read of each page would allocate (on the
        # prefill's side over NIXL, through the mapping here), and the run would time that
        self.remote = prefill.create(self.pcfg, fill="sentinel")
        try:
            self.decode = LoopbackInstance.create("decode", dcfg, fill="sentinel")
        except BaseException:
            prefill.drop(self.remote["engine_id"])
            raise
        self.rng = np.random.default_rng(0)

    def request(self, i: int) -> tuple[float, list[Any]]:
        """Read one request of fresh random blocks; (seconds, each rank's ReadStats)."""
        layout, prefill_tp, decode_tp, prefill_bs, decode_bs = self.case
        rid = f"bench-{_case_name(self.case)}-{i}"
        rids = self.rng.choice(self.pcap, self.pblocks, replace=False).tolist()
        lids = self.rng.choice(self.dcap, self.dblocks, replace=False).tolist()
        engine = self.remote["engine_id"]
        self.prefill.hold(engine, rid, rids, ttl=60)
        params = {"remote_engine_id": engine, "remote_host": self.prefill.host,
                  "remote_port": self.remote["port"], "remote_block_ids": rids,
                  "remote_request_id": rid, "tp_size": prefill_tp,
                  "remote_block_size": prefill_bs}
        start = time.perf_counter()
        self.decode.read(rid, params, lids)
        stats, failed = self.decode.wait([rid], timeout=60)
        wall = time.perf_counter() - start
        if failed:
            raise RuntimeError(f"{layout} TP {prefill_tp}->{decode_tp}, blocks "
                               f"{prefill_bs}->{decode_bs}: {failed[rid]}")
        self.prefill.wait_released(engine, {rid})
        return wall, stats[rid]

    def row(self, walls: list[float], stats: list[Any], copies: list[float]
            ) -> dict[str, Any]:
        """The case's row: ``copies`` are memcpy times of the same bytes taken between its
        requests (:class:`_Memcpy`), so that machine noise hits both; the large READ's
        ceiling is measured now, on the same processes."""
        layout, prefill_tp, decode_tp, prefill_bs, decode_bs = self.case
        prefill_layout, decode_layout = _layouts(layout)
        nbytes = sum(s.num_bytes for s in stats)
        median = statistics.median(walls)
        p90 = sorted(walls)[max(0, round(0.9 * len(walls)) - 1)]
        read_s = _large_read_seconds(self.prefill.host, self.remote["port"], self.pcfg, nbytes,
                                     self.args.repeats)
        copy_s = statistics.median(copies)
        gbps = nbytes / median / 1e9
        read_gbps, copy_gbps = nbytes / read_s / 1e9, nbytes / copy_s / 1e9
        default = self.offer == "mapped"  # what kvxfer does on one host
        # the default path's target is the memcpy's, any other the large READ's
        target = DEFAULT_VS_MEMCPY if default else \
            0.9 if prefill_layout in COALESCING else 0.75
        achieved = gbps / (copy_gbps if default else read_gbps)
        paths = sorted({p for s in stats for p in s.path_names})
        return {"layout": layout, "prefill_layout": prefill_layout,
                "decode_layout": decode_layout, "converted": _converted(self.case),
                "offer": self.offer, "default": default, "path": "+".join(paths),
                "prefill_tp": prefill_tp, "decode_tp": decode_tp,
                "prefill_block_size": prefill_bs, "decode_block_size": decode_bs,
                "bytes": nbytes, "descriptors": sum(s.descriptors for s in stats),
                "ms_median": round(median * 1e3, 2), "ms_p90": round(p90 * 1e3, 2),
                "gb_per_s": round(gbps, 2),
                "large_read_gb_per_s": round(read_gbps, 2),
                "memcpy_gb_per_s": round(copy_gbps, 2),
                "vs_large_read": round(gbps / read_gbps, 2),
                "vs_memcpy": round(gbps / copy_gbps, 2),
                "target": f"{'copy' if default else 'READ'}>={target}",
                "meets_target": achieved >= target}

    def close(self) -> None:
        self.decode.close()
        self.prefill.drop(self.remote["engine_id"])


def _case(prefill: Any, case: tuple[str, int, int, int, int], args: argparse.Namespace,
          offer: str = "mapped") -> dict[str, Any]:
    """A case's row, its prefill making ``offer`` (:data:`OFFERS`). A converted or
    block-size case runs in alternation with its native counterpart (:func:`_native_case`,
    the same offer made), request by request (ABBA), so that drifts of a noisy machine hit
    both alike; ``vs_native`` is the counterpart's median time over this case's."""
    native = _native_case(case)
    runs: list[_Run] = []
    try:
        runs.append(_Run(prefill, case, args, offer))
        if native is not None:
            runs.append(_Run(prefill, native, args, offer))
        walls: list[list[float]] = [[] for _ in runs]
        stats: list[Any] = []
        memcpy: _Memcpy | None = None  # of the case's bytes, once the warm-up told them
        copies: list[float] = []
        for i in range(args.repeats + 1):  # the first request of each is the warm-up
            for k in (range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))):
                wall, got = runs[k].request(i)
                if k == 0 and memcpy is None:
                    memcpy = _Memcpy(sum(s.num_bytes for s in got))
                if i:
                    walls[k].append(wall)
                    stats = stats or (got if k == 0 else [])
            if i and memcpy is not None:
                copies.append(memcpy.once())
        del memcpy
        row = runs[0].row(walls[0], stats, copies)
        if native is not None:
            # from the printed times, so that a reader who divides them gets the same
            row["native_ms_median"] = round(statistics.median(walls[1]) * 1e3, 2)
            row["vs_native"] = round(row["native_ms_median"] / row["ms_median"], 2)
        return row
    finally:
        for run in runs:
            run.close()


def _native_case(case: tuple[str, int, int, int, int]
                 ) -> tuple[str, int, int, int, int] | None:
    """What a case is compared with: a converted one with the twin layouts (:data:`TWIN`)
    that byte copies serve, a block-size one with equal block sizes (the smaller); None
    for a native case."""
    layout, p, d, pbs, dbs = case
    if _converted(case):
        prefill, decode = (TWIN.get(x, x) for x in _layouts(layout))
        twin = (prefill if prefill == decode else f"{prefill}/{decode}", p, d, pbs, dbs)
        return None if _converted(twin) else twin
    if pbs != dbs:
        return (layout, p, d, min(pbs, dbs), min(pbs, dbs))
    return None


@contextlib.contextmanager
def _ucx_tls(value: str | None) -> Iterator[None]:
    """``UCX_TLS=value`` (None: unchanged) for agents made inside, this process's and
    the prefill process's (spawned inside, it inherits the environment)."""
    before = os.environ.get("UCX_TLS")
    if value is not None:
        os.environ["UCX_TLS"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = before


def _layouts(layout: str) -> tuple[str, str]:
    """(prefill, decode) layouts of a case's ``P`` or ``P/D`` field."""
    prefill, _, decode = layout.partition("/")
    return prefill, decode or prefill


def _converted(case: tuple[str, int, int, int, int]) -> bool:
    """Whether the decode converts the case (a host read or through staging)."""
    from kvxfer.plan.layout import parse_layout

    prefill, decode = (parse_layout(x) for x in _layouts(case[0]))
    return prefill.heads_outside_tokens != decode.heads_outside_tokens or (
        case[1] != case[2] and not prefill.heads_outside_tokens)


def _rows(cases: list[tuple[str, int, int, int, int]], args: argparse.Namespace,
          ucx_tls: str | None) -> list[dict[str, Any]]:
    from kvxfer.harness.loopback import PrefillProcess

    with _ucx_tls(ucx_tls):
        prefill = PrefillProcess() if args.prefill_netns is None else PrefillProcess(
            args.prefill_netns, args.prefill_host, ucx_devices=_netns().DEVICE)
        try:
            return [_case(prefill, case, args, offer)
                    for case in cases for offer in _offers(case, args)]
        finally:
            prefill.close()


def _offers(case: tuple[str, int, int, int, int], args: argparse.Namespace
            ) -> tuple[str, ...]:
    """What the prefill offers in each run of a case (:data:`OFFERS`): its mapped cache
    (the default on one host), nothing (as across machines), and, for a converted case
    with ``--host-reads all``, host reads of a cache without shared memory (a direct or
    block-size case has no host reads: it would run as across machines)."""
    if args.host_reads == "all" and _converted(case):
        return OFFERS
    return {"on": ("mapped",), "off": ("none",)}.get(args.host_reads, ("mapped", "none"))


def run(args: argparse.Namespace) -> int:
    tcp = args.transport == "tcp"
    if tcp:  # what TCP carries: a host read would bypass it
        args.host_reads = "off"
    cases = _parse_cases(args.cases or (TCP_CASES if tcp else "all"), args.block_size)
    if args.read_lanes < 1:
        raise SystemExit(f"--read-lanes must be at least 1, got {args.read_lanes}")
    rows = _rows(cases, args, None)
    if tcp:
        why = "--path loopback" if args.path == "loopback" else _netns().why_not()
        if why is None:
            return _print_tcp(rows, _rows_across(cases, args), args, "veth")
        return _print_tcp(rows, _rows(cases, args, "tcp"), args, f"loopback, {why}")
    summary = _worst_cases(rows)
    if args.json:
        print(json.dumps({"tokens": args.tokens, "repeats": args.repeats,
                          "read_lanes": args.read_lanes, "rows": rows,
                          "worst_vs_native": summary,
                          "default_vs_memcpy": _default_verdict(rows)}, indent=2))
        return 0
    _print(rows, summary, args)
    return 0


def _print(rows: list[dict[str, Any]], summary: dict[str, dict[str, Any]],
           args: argparse.Namespace) -> None:
    print(f"KV transfer of a {args.tokens}-token request ({args.layers} layers, {args.kv_heads} "
          f"KV heads x {args.head_size}, {args.dtype}), random block ids, median of "
          f"{args.repeats}, {args.read_lanes} read lane(s) per decode instance; for the same "
          f"bytes, a one-thread memcpy between the case's requests and a large READ after them")
    print(f"{'layout':11} {'run':7} {'path':6} {'P->D':5} {'blocks':7} {'MiB':>5} {'descs':>6} "
          f"{'ms':>7} {'p90':>7} {'GB/s':>6} {'READ':>6} {'copy':>6} {'xREAD':>6} {'xcopy':>6} "
          f"{'target':10} {'':4} xnative")
    for r in rows:
        blocks = f"{r['prefill_block_size']}->{r['decode_block_size']}"
        native = f"{r['vs_native']:>7}" if "vs_native" in r else f"{'':>7}"
        name = r["layout"] + ("*" if r["converted"] else "")
        run = "default" if r["default"] else {"none": "remote", "host": "no-shm"}[r["offer"]]
        print(f"{name:11} {run:7} {r['path']:6} {r['prefill_tp']}->{r['decode_tp']:<2} "
              f"{blocks:7} {r['bytes'] / 2**20:>5.0f} {r['descriptors']:>6} "
              f"{r['ms_median']:>7} {r['ms_p90']:>7} {r['gb_per_s']:>6} "
              f"{r['large_read_gb_per_s']:>6} {r['memcpy_gb_per_s']:>6} {r['vs_large_read']:>6} "
              f"{r['vs_memcpy']:>6} {r['target']:10} {'ok' if r['meets_target'] else 'MISS':4} "
              f"{native}")
    print("run default: the prefill offers its cache mapped, as kvxfer serve does, and the "
          "decode's routes choose the path (target: 0.8x one memcpy thread, xcopy); remote: "
          "no copies on this host, as across machines (target: xREAD, the large READ's "
          "share); no-shm: host reads of a prefill cache in private memory")
    if any(r["converted"] for r in rows):
        print("* converted. path mapped: one local copy from the prefill's cache mapped into "
              "the decode, MiB counts the bytes placed, descs the copy threads; host: copied "
              "from the prefill process straight into place with process_vm_readv, descs "
              "the ranges; staged: READ into staging, then one local copy, MiB counts what "
              "the READ moved")
    if any("vs_native" in r for r in rows):
        print("xnative: the native counterpart's time over this case's, the two run in "
              "alternation, request by request, the same run (converted: the twin layouts; "
              "block sizes: equal ones); 0.67 costs 1.5x")
    for path, worst in summary.items():
        print(f"{path}: at worst {worst['vs_native']} xnative ({worst['case']}), "
              f"{1 / worst['vs_native']:.2f}x the twin's time: "
              f"{'within' if worst['within_1_5x'] else 'over'} 1.5x")
    verdict = _default_verdict(rows)
    if verdict is not None:
        print(f"default path: {verdict['met']} of {verdict['cases']} cases at least "
              f"{DEFAULT_VS_MEMCPY}x single-thread memcpy; worst {verdict['worst_vs_memcpy']}x "
              f"({verdict['worst_case']}, {verdict['worst_path']}): "
              f"{'ok' if verdict['ok'] else 'MISS'}")


def _default_verdict(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How the rows on the default path did against 0.8x one memcpy thread (None: none)."""
    default = [r for r in rows if r["default"]]
    if not default:
        return None
    worst = min(default, key=lambda r: r["vs_memcpy"])
    met = sum(r["meets_target"] for r in default)
    return {"cases": len(default), "met": met, "ok": met == len(default),
            "worst_vs_memcpy": worst["vs_memcpy"], "worst_case": _row_case(worst),
            "worst_path": worst["path"]}


def _row_case(r: dict[str, Any]) -> str:
    blocks = "" if r["prefill_block_size"] == r["decode_block_size"] else \
        f" blocks {r['prefill_block_size']}->{r['decode_block_size']}"
    return f"{r['layout']} TP {r['prefill_tp']}->{r['decode_tp']}{blocks}"


def _worst_cases(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of case (converted, block sizes) and path, the case that costs the most
    against its native counterpart."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "vs_native" not in r:
            continue
        key = f"{'converted' if r['converted'] else 'block sizes'}, {r['path']}"
        if r["vs_native"] < out.get(key, {}).get("vs_native", math.inf):
            out[key] = {"vs_native": r["vs_native"], "within_1_5x": r["vs_native"] >= 2 / 3,
                        "case": _row_case(r)}
    return out


def _netns() -> Any:
    from kvxfer.harness import netns

    return netns


def _rows_across(cases: list[tuple[str, int, int, int, int]], args: argparse.Namespace
                 ) -> list[dict[str, Any]]:
    """The cases over UCX_TLS=tcp with prefill and decode in two namespaces."""
    netns = _netns()
    entries = ",".join(_case_name(case) for case in cases)
    with netns.VethPair() as pair:
        argv = ["ip", "netns", "exec", pair.decode, sys.executable, "-m", "kvxfer.cli",
                "bench", "transfer", "--json", "--cases", entries, "--tokens",
                str(args.tokens), "--repeats", str(args.repeats), "--read-lanes",
                str(args.read_lanes), "--layers", str(args.layers), "--kv-heads",
                str(args.kv_heads), "--head-size", str(args.head_size), "--block-size",
                str(args.block_size), "--dtype", args.dtype, "--host-reads", "off",
                "--prefill-netns", pair.prefill,
                "--prefill-host", pair.inside]
        env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": netns.DEVICE}
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True,
                              timeout=60 + 30 * len(cases) * (args.repeats + 1), check=False)
    if done.returncode != 0:
        raise SystemExit(f"the decode side in namespace {pair.decode} failed "
                         f"(exit {done.returncode}); its output is above")
    return list(json.loads(done.stdout)["rows"])


def _print_tcp(default: list[dict[str, Any]], tcp: list[dict[str, Any]],
               args: argparse.Namespace, path: str) -> int:
    """The same cases over UCX's default transports and over TCP, and their ratio."""
    pairs = [{"layout": d["layout"], "prefill_tp": d["prefill_tp"],
              "decode_tp": d["decode_tp"], "bytes": d["bytes"], "default": d, "tcp": t,
              "tcp_vs_default": round(t["gb_per_s"] / d["gb_per_s"], 3)}
             for d, t in zip(default, tcp, strict=True)]
    if args.json:
        print(json.dumps({"tokens": args.tokens, "repeats": args.repeats,
                          "read_lanes": args.read_lanes, "tcp_path": path, "rows": pairs},
                         indent=2))
        return 0
    where = "between two network namespaces over a veth pair" if path == "veth" \
        else f"over 127.0.0.1 ({path})"
    print(f"KV transfer of a {args.tokens}-token request, median of {args.repeats}: UCX's "
          f"default transports (cma on one host) against UCX_TLS=tcp {where}, same run")
    print(f"{'layout':12} {'P->D':5} {'MiB':>5} {'ms':>8} {'GB/s':>6} {'tcp ms':>8} "
          f"{'tcp GB/s':>8} {'tcp/default':>11} {'xnative':>7} {'tcp xnative':>11}")
    for r in pairs:
        d, t = r["default"], r["tcp"]
        print(f"{r['layout']:12} {r['prefill_tp']}->{r['decode_tp']:<2} "
              f"{r['bytes'] / 2**20:>5.0f} {d['ms_median']:>8} {d['gb_per_s']:>6} "
              f"{t['ms_median']:>8} {t['gb_per_s']:>8} {r['tcp_vs_default']:>11} "
              f"{d.get('vs_native', ''):>7} {t.get('vs_native', ''):>11}")
    if any("vs_native" in r["tcp"] for r in pairs):
        print("xnative: the native counterpart's time over this case's, the two run in "
              "alternation (converted cases read through staging here: a host read would "
              "not cross TCP)")
    return 0
