"""``kvxfer bench load``: requests/s and time to first byte through the proxy under load,
for one source tree or several side by side.

Each figure is also given as a ratio to the first source's, measured in the same run; exits 1
when any request failed.

Design: docs/design/bench.md#kvxfer-bench-load
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvxfer.bench.children import Child, add_output_arguments, local_ports, started
from kvxfer.bench.proxy import KEEPALIVE_S, Call, Cell, run_cell, send
from kvxfer.bench.serving import BenchError, check_context, run_checked
from kvxfer.bench.ttft import KEY_VARIABLES, lengths, percentile

HELP = "requests/s and time to first byte through the proxy under load, source trees side by side"

DEFAULT_LENGTHS = (16, 32, 64, 128, 256)  # short: per-request costs weigh most
BLOCK_SIZE = 16  # kvxfer serve's default, then and now
REQUEST_TIMEOUT_S = 60.0
ROUTE = "/v1/completions"
ERROR_EVENT = b'data: {"error"'
TTFB, LATENCY = (50, 90, 99), (50, 99)  # the percentiles reported
FIGURES = ("rps", *(f"ttfb_p{q}_ms" for q in TTFB), *(f"latency_p{q}_ms" for q in LATENCY))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", nargs="+", type=Path, metavar="DIR",
                        help="source trees to run the servers from, in turn; ratios are to "
                             "the first (default: this checkout)")
    for flag, default, text in (
            ("--requests", 500, "measured requests per source and round"),
            ("--concurrency", 16, "requests in flight"),
            ("--rounds", 2, "rounds; each runs every source once"),
            ("--warmup", 16, "unmeasured requests before each run's"),
            ("--max-tokens", 16, "tokens of each streamed answer"),
            ("--seed", 0, "seed of the prompt mix")):
        parser.add_argument(flag, type=int, default=default, metavar="N",
                            help=f"{text} (default {default})")
    parser.add_argument("--lengths", type=lengths, default=DEFAULT_LENGTHS, metavar="N,N,...",
                        help="prompt lengths in bytes, drawn in turn with --seed (default "
                             f"{','.join(map(str, DEFAULT_LENGTHS))})")
    parser.add_argument("--model", default="kvxfer-tiny", help="model (default kvxfer-tiny)")
    add_output_arguments(parser)


# -- source trees -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A tree the servers run from; ``label`` is its short commit when it is a git tree's top."""

    path: Path
    label: str
    commit: str | None = None
    modified: bool = False  # uncommitted changes: what runs is not quite ``commit``


def _git(path: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source(path: Path) -> Source:
    path = path.resolve()
    missing = [p for p in ("kvxfer/cli.py", "proxy/__main__.py") if not (path / p).is_file()]
    if missing:
        raise BenchError(f"--source {path} is not a kvxfer tree: it has no {', '.join(missing)}")
    top = _git(path, "rev-parse", "--show-toplevel")
    commit = _git(path, "rev-parse", "--short", "HEAD") if top and Path(top) == path else None
    if commit is None:
        return Source(path, path.name)
    return Source(path, commit, commit, bool(_git(path, "status", "--porcelain")))


def distinct(sources: Sequence[Source]) -> list[Source]:
    """The same sources, a label met again numbered (``abc1234#2``): labels key the report."""
    seen: dict[str, int] = {}
    named = []
    for s in sources:
        seen[s.label] = seen.get(s.label, 0) + 1
        named.append(s if seen[s.label] == 1 else replace(s, label=f"{s.label}#{seen[s.label]}"))
    return named


# -- processes --------------------------------------------------------------------------------


def num_blocks(args: argparse.Namespace) -> int:
    """KV blocks per sidecar: twice ``--concurrency`` of the longest request (a prefill's
    lease ends just after its decode read it), at least ``kvxfer serve``'s default 256."""
    longest: int = max(args.lengths) + 1 + args.max_tokens  # BOS, prompt bytes, answer
    return max(256, 2 * int(args.concurrency) * math.ceil(longest / BLOCK_SIZE))


def argvs(args: argparse.Namespace, port: dict[str, int]) -> dict[str, list[str]]:
    """Every process's command line by name, in flags c31bd58 and later trees all accept."""
    sidecars = {role: [sys.executable, "-m", "kvxfer.cli", "--log-level", "WARNING", "serve",
                       "--role", role, "--model", args.model, "--port", str(port[role]),
                       "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks(args)),
                       "--kv-load-failure-policy", "fail"]
                for role in ("prefill", "decode")}
    proxy = [sys.executable, "-m", "proxy", "--port", str(port["proxy"]),
             "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(port["prefill"]),
             "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(port["decode"]),
             "--request-timeout", str(REQUEST_TIMEOUT_S), "--log-level", "warning"]
    return {**sidecars, "proxy": proxy}


@contextmanager
def deployment(tree: Source, args: argparse.Namespace, log_dir: Path
               ) -> Iterator[dict[str, Child]]:
    """The sidecars, then the proxy, run from ``tree`` and ready; stopped on exit, Ctrl-C
    included (each in a session of its own: only we get the SIGINT)."""
    port = local_ports(("prefill", "decode", "proxy"))
    # Only the tree's own packages: a caller's PYTHONPATH could point at another tree.
    env = {k: v for k, v in os.environ.items() if k not in (*KEY_VARIABLES, "PYTHONPATH")}
    env.update(PYTHONPATH=str(tree.path), PYTHONUNBUFFERED="1")
    # `env -C`: python -m puts its working directory first on sys.path, so it is the tree too.
    children = {name: Child(name, ["env", "-C", str(tree.path), *argv],
                            f"http://127.0.0.1:{port[name]}", env, log_dir)
                for name, argv in argvs(args, port).items()}
    with started([[children["prefill"], children["decode"]], [children["proxy"]]]):
        yield children


# -- load -------------------------------------------------------------------------------------


def request_bodies(args: argparse.Namespace) -> list[bytes]:
    """``--requests`` encoded completion bodies, each prompt distinct, its length drawn from
    ``--lengths`` with ``--seed``: the same for every source and round."""
    rng = random.Random(args.seed)
    alphabet = string.ascii_lowercase + " "
    return [json.dumps({"model": args.model, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True,
                        "prompt": "".join(rng.choices(alphabet, k=rng.choice(args.lengths)))
                        }).encode() for _ in range(args.requests)]


def caller(url: str, bodies: Sequence[bytes]) -> Call:
    """A call for :func:`run_cell`: the next body in turn, streamed; its time to first byte."""
    turn = itertools.cycle(bodies)

    async def call(session: Any) -> float | None:
        received, first = await send(session, url, next(turn), True)
        if ERROR_EVENT in received:
            at = received.index(ERROR_EVENT)
            raise ValueError(f"stream from {url} carried an error: {received[at:at + 200]!r}")
        return first

    return call


@dataclass(frozen=True)
class Run:
    """One source's run in one round (0 first): the measured requests, the warm-up's failures."""

    round: int
    cell: Cell
    warmup_failures: int = 0


async def load(url: str, pids: dict[str, int], bodies: Sequence[bytes],
               args: argparse.Namespace) -> tuple[Cell, Cell]:
    """The warm-up's and the measured requests' :class:`Cell`, on one connection pool."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                     timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
                                     ) as session:
        warm = await run_cell(session, caller(url, bodies), args.concurrency, args.warmup,
                              math.inf, pids)
        return warm, await run_cell(session, caller(url, bodies), args.concurrency,
                                    args.requests, math.inf, pids)


def one_run(tree: Source, number: int, bodies: Sequence[bytes], args: argparse.Namespace,
            log_root: Path) -> Run:
    head = f"round {number + 1}/{args.rounds}, {tree.label}"
    log_dir = log_root / f"{tree.label}-round{number + 1}"
    log_dir.mkdir(parents=True, exist_ok=True)
    _progress(f"{head}: starting from {tree.path}")
    started = time.monotonic()
    with deployment(tree, args, log_dir) as children:
        pids = {name: child.process.pid for name, child in children.items()}
        _progress(f"{head}: ready after {time.monotonic() - started:.1f} s, " + ", ".join(
            f"{name} {child.url}" for name, child in children.items()))
        warm, cell = asyncio.run(load(children["proxy"].url + ROUTE, pids, bodies, args))
    got = figures([cell])
    _progress(f"{head}: {got['rps']} req/s, time to first byte p50 {got['ttfb_p50_ms']} ms, "
              f"{cell.errors + warm.errors} failed")
    return Run(number, cell, warm.errors)


# -- report (pure) ----------------------------------------------------------------------------


def _ms(seconds: Sequence[float], q: int) -> float | None:
    return round(1000 * percentile(seconds, q), 1) if seconds else None


def figures(cells: Sequence[Cell]) -> dict[str, float | None]:
    """:data:`FIGURES` of ``cells``: the median cell's successes per second, and percentiles
    (ms) of all their successful requests pooled; None where none succeeded."""
    rates = [len(c.latencies) / c.elapsed for c in cells if c.elapsed > 0 and c.latencies]
    first = [x for c in cells for x in c.first_bytes]
    total = [x for c in cells for x in c.latencies]
    return {"rps": round(statistics.median(rates), 2) if rates else None,
            **{f"ttfb_p{q}_ms": _ms(first, q) for q in TTFB},
            **{f"latency_p{q}_ms": _ms(total, q) for q in LATENCY}}


def cpu_ms(cell: Cell) -> dict[str, float]:
    """CPU ms per measured request of each process ("client": this one)."""
    done = len(cell.latencies) + cell.errors
    return {name: round(1000 * used / done, 2) for name, used in cell.cpu_s.items()} if done else {}


def run_report(run: Run) -> dict[str, Any]:
    c = run.cell
    return {"round": run.round + 1, "requests": len(c.latencies) + c.errors,
            "failures": c.errors, "warmup_failures": run.warmup_failures,
            "first_error": c.first_error, "elapsed_s": round(c.elapsed, 3),
            **figures([c]), "cpu_ms_per_request": cpu_ms(c)}


def source_report(tree: Source, runs: Sequence[Run]) -> dict[str, Any]:
    per_run = [cpu_ms(r.cell) for r in runs]
    names = sorted({name for cpu in per_run for name in cpu})
    return {"label": tree.label, "path": str(tree.path), "commit": tree.commit,
            "modified": tree.modified, **figures([r.cell for r in runs]),
            "failures": sum(r.cell.errors + r.warmup_failures for r in runs),
            "cpu_ms_per_request": {n: statistics.median(c[n] for c in per_run if n in c)
                                   for n in names},
            "runs": [run_report(r) for r in runs]}


def with_ratios(sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each source with ``ratio_to_first``: each figure over the first source's (None where
    either is missing). Requests/s: above 1 is better; times: below 1 is better."""
    base = sources[0]
    return [{**s, "ratio_to_first": {
        f: round(s[f] / base[f], 3) if s[f] is not None and base[f] else None for f in FIGURES}}
        for s in sources]


def _label(s: dict[str, Any]) -> str:
    return str(s["label"]) + (" (modified)" if s["modified"] else "")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _row(label: str, width: int, values: dict[str, Any], fmt: str) -> str:
    return f"{label:{width}} " + " ".join(f"{_num(values[f], fmt):>{w}}" for f, w in
                                          zip(FIGURES, (7, 9, 7, 7, 10, 7), strict=True))


def table_lines(report: dict[str, Any]) -> list[str]:
    c, sources = report["config"], report["sources"]
    width = max(len(_label(s)) for s in sources) + 2
    lines = [f"kvxfer bench load: {c['model']}, one prefill and one decode behind the proxy, no "
             f"keys; {c['requests']} streamed completions per run at concurrency "
             f"{c['concurrency']} after {c['warmup']} warm-up, {c['rounds']} round(s); prompts "
             f"of {'/'.join(map(str, c['lengths']))} bytes (seed {c['seed']}), "
             f"{c['max_tokens']} tokens each; {c['cpus']} CPUs",
             "req/s: the median run; times in ms, all runs pooled; TTFB: time to first "
             "streamed byte",
             f"{'source':{width}} {'req/s':>7} {'TTFB p50':>9} {'p90':>7} {'p99':>7} "
             f"{'total p50':>10} {'p99':>7} {'failed':>7}  req/s of each run"]
    lines += [_row(_label(s), width, s, ".1f") + f" {s['failures']:>7}  ["
              + " ".join(_num(r["rps"], ".1f") for r in s["runs"]) + "]" for s in sources]
    lines.append(f"\nratio to {_label(sources[0])} (req/s: higher is better; times: lower is "
                 f"better)")
    lines += [_row(_label(s), width, s["ratio_to_first"], ".3f") for s in sources]
    lines.append("\nCPU ms per request, median run")
    lines += [f"{_label(s):{width}} " + "  ".join(f"{name} {value:g}" for name, value in
                                                  s["cpu_ms_per_request"].items())
              for s in sources]
    return lines + [f"first error, {s['label']} round {r['round']}: {r['first_error']}"
                    for s in sources for r in s["runs"] if r["first_error"]]


# -- the command ------------------------------------------------------------------------------


def _progress(text: str) -> None:
    print(f"kvxfer bench load: {text}", file=sys.stderr, flush=True)


def check_args(args: argparse.Namespace) -> list[Source]:
    """The sources to run; :class:`BenchError` for arguments that cannot run."""
    import kvxfer

    small = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in
             ("requests", "concurrency", "rounds", "max_tokens") if getattr(args, n) < 1]
    if small or args.warmup < 0:
        raise BenchError(f"must be 1 or more (--warmup 0 or more): "
                         f"{', '.join(small) or f'--warmup {args.warmup}'}")
    check_context(args.model, args.lengths, args.max_tokens, extra=1)
    here = Path(kvxfer.__file__).resolve().parent.parent  # this checkout
    return distinct([source(p) for p in args.source or [here]])


def run(args: argparse.Namespace) -> int:
    def report(measured: dict[str, Any]) -> None:
        if args.json_file:
            Path(args.json_file).write_text(json.dumps(measured, indent=2) + "\n")
        print(json.dumps(measured, indent=2) if args.json else "\n".join(table_lines(measured)))

    return run_checked("load", lambda: check_args(args), lambda trees: measure(trees, args),
                       report)


def measure(trees: list[Source], args: argparse.Namespace) -> dict[str, Any]:
    """Every round runs every source once, the first of a round rotating."""
    bodies = request_bodies(args)
    runs: dict[str, list[Run]] = {tree.label: [] for tree in trees}
    with tempfile.TemporaryDirectory(prefix="kvxfer-load-") as root:
        log_root = Path(args.log_dir or root).resolve()
        for number in range(args.rounds):
            shift = number % len(trees)
            for tree in trees[shift:] + trees[:shift]:
                runs[tree.label].append(one_run(tree, number, bodies, args, log_root))
    sources = with_ratios([source_report(tree, runs[tree.label]) for tree in trees])
    config = {"model": args.model, "requests": args.requests, "concurrency": args.concurrency,
              "rounds": args.rounds, "warmup": args.warmup, "max_tokens": args.max_tokens,
              "lengths": list(args.lengths), "seed": args.seed, "num_blocks": num_blocks(args),
              "cpus": os.cpu_count()}
    return {"config": config, "sources": sources,
            "failed_requests": sum(s["failures"] for s in sources)}
