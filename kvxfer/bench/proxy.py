"""``kvxfer bench proxy``: the latency the proxy adds, and the load it carries.

Stub sidecars, the proxy and a bare app, in interleaved rounds; "added" latency is the
proxy's p50 minus the baseline's of the same round. Exits 1 if any request failed.

Design: docs/design/bench.md#kvxfer-bench-proxy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HELP = "latency the proxy adds over direct prefill/decode calls, and requests/s under load"

TARGETS = ("decode", "prefill+decode", "proxy")
FLOOR = "hop"
MODES = ("json", "stream")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
PROMPT = "the quick brown fox jumps over the lazy dog " * 8
TARGET_ADDED_MS = 1.0  # the target: added p50 under 1 ms
# Idle load-generator connections are dropped sooner than uvicorn closes them (5 s),
# so no request is ever sent on a connection the server is closing.
KEEPALIVE_S = 3.0
ROUTE = "/v1/completions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proxy-arg", action="append", default=[], metavar="FLAG",
                        help="a further kvxfer-proxy flag, repeated for each, e.g. "
                             "--proxy-arg=--policy=round_robin or --proxy-arg=--tokenizer=byte "
                             "(the kv_aware policy then tokenizes every prompt)")
    parser.add_argument("--requests", type=int, default=3000,
                        help="requests per target, mode and concurrency, over all rounds "
                             "(default 3000)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="concurrent clients to test (default 1 8 32 64)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="answer modes (default json stream)")
    parser.add_argument("--chunks", type=int, default=16,
                        help="SSE events per streamed answer (default 16)")
    parser.add_argument("--warmup", type=int, default=50,
                        help="unmeasured requests per target and mode first (default 50)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds over all cells (default 5)")
    parser.add_argument("--max-seconds", type=float, default=5.0,
                        help="time cap per cell and round, seconds (default 5)")
    parser.add_argument("--time-limit", type=float, default=90.0,
                        help="start no further round after this many seconds of measuring "
                             "(default 90; the first round always runs)")


@dataclass
class Cell:
    """What one target did at one concurrency in one mode in one round; times in seconds."""

    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    elapsed: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds, by process

    def fail(self, why: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or why


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "chunks", "rounds"):
        if getattr(args, name) < 1:
            print(f"--{name} must be at least 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if min(args.concurrency) < 1:
        print(f"--concurrency values must be at least 1, got {args.concurrency}",
              file=sys.stderr)
        return 2
    with deployment(args.chunks, args.proxy_arg) as (urls, pids):
        result = asyncio.run(measure(urls, pids, args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 1 if any(row["errors"] for row in result["rows"] + result["floor"]) else 0


# -- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def deployment(chunks: int, proxy_args: Sequence[str] = ()
               ) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    """Stub prefill, stub decode, proxy and hop processes: (URL, PID) by name.

    All are stopped on exit, Ctrl-C included.
    """
    import proxy

    # The children import the same packages as this process, wherever they lie.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(proxy.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    ports = {name: free_port() for name in ("prefill", "decode", "proxy", FLOOR)}
    commands = {
        "prefill": ["-m", "proxy.stub", "--role", "prefill", "--port", str(ports["prefill"])],
        "decode": ["-m", "proxy.stub", "--role", "decode", "--port", str(ports["decode"]),
                   "--chunks", str(chunks)],
        "proxy": ["-m", "proxy", "--port", str(ports["proxy"]), "--prefiller-ports",
                  str(ports["prefill"]), "--decoder-ports", str(ports["decode"]),
                  "--log-level", "warning", *proxy_args],
        FLOOR: ["-m", "kvxfer.bench.hop", "--port", str(ports[FLOOR])]}
    pids: dict[str, int] = {}
    with ExitStack() as stack:  # unwinds in reverse: hop and proxy first, Ctrl-C included
        for name, command in commands.items():
            log = stack.enter_context(tempfile.TemporaryFile())
            # A session of their own: Ctrl-C reaches only us, and we stop them in order.
            process = subprocess.Popen([sys.executable, *command], env=env,
                                       stdout=subprocess.DEVNULL, stderr=log,
                                       start_new_session=True)
            stack.callback(stop, process)
            pids[name] = process.pid
            wait_healthy(name, process, log, f"http://127.0.0.1:{ports[name]}/health")
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}, pids


def wait_healthy(name: str, process: subprocess.Popen[bytes], log: IO[bytes], url: str) -> None:
    """Poll ``url`` until it answers 200; raise with the child's stderr if it dies or stalls."""
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{name} process exited with status {process.returncode}:\n"
                               f"{log.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not answer 200 at {url} within {START_TIMEOUT_S} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process ("client") and each child.

    Children are read from ``/proc``; where that does not exist only "client" is given.
    """
    used = {"client": time.process_time()}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for name, pid in pids.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        used[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return used


# -- load ----------------------------------------------------------------------------------

Call = Callable[[Any], Awaitable[float | None]]


async def measure(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace
                  ) -> dict[str, Any]:
    import aiohttp
    import msgspec

    from proxy.contract import prefill_request

    rounds = min(args.rounds, args.requests)
    cells: dict[tuple[str, str, int], list[Cell]] = {}
    sessions: dict[str, Any] = {}
    try:
        for target in (*TARGETS, FLOOR):  # one pool per target: no target waits on another's
            sessions[target] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=30.0), auto_decompress=False)
        answer, _ = await send(sessions["prefill+decode"], urls["prefill"] + ROUTE,
                               msgspec.json.encode(prefill_request({"prompt": PROMPT})), False)
        params = msgspec.json.decode(answer)["kv_transfer_params"]
        calls = {mode: targets(urls, mode, args.chunks, params) for mode in args.modes}
        for mode in args.modes:
            for target, call in calls[mode].items():
                await run_cell(sessions[target], call, min(4, args.warmup), args.warmup,
                               args.max_seconds, pids)
        started = time.perf_counter()
        last_round = 0.0
        for number in range(rounds):
            elapsed = time.perf_counter() - started
            if number > 0 and elapsed + last_round > args.time_limit:
                break
            share = args.requests // rounds + (number < args.requests % rounds)
            await measure_round(number, share, sessions, calls, cells, pids, args)
            last_round = time.perf_counter() - started - elapsed
    finally:
        for session in sessions.values():
            await session.close()
    done_rounds = len(next(iter(cells.values())))
    rows = [summarize(mode, target, concurrency, runs)
            for (mode, target, concurrency), runs in cells.items() if target != FLOOR]
    floor = [summarize(mode, target, concurrency, runs)
             for (mode, target, concurrency), runs in cells.items() if target == FLOOR]
    return {"requests": args.requests, "rounds": done_rounds, "chunks": args.chunks,
            "cpus": os.cpu_count(), "server": server_description(), "rows": rows,
            "floor": floor, "added_p50_ms": added_latency(cells)}


async def measure_round(number: int, share: int, sessions: dict[str, Any],
                        calls: dict[str, dict[str, Call]],
                        cells: dict[tuple[str, str, int], list[Cell]], pids: dict[str, int],
                        args: argparse.Namespace) -> None:
    """Every cell once; within a cell the targets run back to back, in a rotating order."""
    for concurrency in args.concurrency:
        for mode in args.modes:
            names = list(calls[mode])
            turn = number % len(names)
            for target in names[turn:] + names[:turn]:
                cell = await run_cell(sessions[target], calls[mode][target], concurrency,
                                      share, args.max_seconds, pids)
                cells.setdefault((mode, target, concurrency), []).append(cell)


def targets(urls: dict[str, str], mode: str, chunks: int, params: dict[str, Any]
            ) -> dict[str, Call]:
    """Per target, a call returning the time to its first body byte (None: not streamed)."""
    import msgspec

    from proxy.contract import decode_request, prefill_request

    stream = mode == "stream"
    body = {"model": "stub-model", "prompt": PROMPT, "max_tokens": chunks, "stream": stream}
    decode_body = msgspec.json.encode(decode_request(body, params))
    prefill_body = msgspec.json.encode(prefill_request(body))
    proxy_body = msgspec.json.encode(body)

    async def decode(session: Any) -> float | None:
        return (await send(session, urls["decode"] + ROUTE, decode_body, stream))[1]

    async def sequential(session: Any) -> float | None:
        start = time.perf_counter()
        answer, _ = await send(session, urls["prefill"] + ROUTE, prefill_body, False)
        leased = msgspec.json.encode(decode_request(
            body, msgspec.json.decode(answer)["kv_transfer_params"]))
        prefilled = time.perf_counter() - start
        first = (await send(session, urls["decode"] + ROUTE, leased, stream))[1]
        return None if first is None else prefilled + first

    async def proxied(session: Any) -> float | None:
        return (await send(session, urls["proxy"] + ROUTE, proxy_body, stream))[1]

    async def hop(session: Any) -> float | None:
        return (await send(session, urls[FLOOR] + ROUTE, proxy_body, False))[1]

    calls: dict[str, Call] = {"decode": decode, "prefill+decode": sequential, "proxy": proxied}
    if not stream:
        calls[FLOOR] = hop
    return calls


async def send(session: Any, url: str, content: bytes, stream: bool
               ) -> tuple[bytes, float | None]:
    """POST ``content``, read the whole answer: (body, seconds to its first chunk if streamed)."""
    start = time.perf_counter()
    first: float | None = None
    async with session.post(url, data=content,
                            headers={"content-type": "application/json"}) as answer:
        if not stream:
            received = await answer.read()
        else:
            parts = []
            async for chunk in answer.content.iter_any():
                first = time.perf_counter() - start if first is None else first
                parts.append(chunk)
            received = b"".join(parts)
    if answer.status != 200:
        raise ValueError(f"HTTP {answer.status} from {url}: {received[:200]!r}")
    if stream and not received.endswith(b"data: [DONE]\n\n"):
        raise ValueError(f"stream from {url} did not end with [DONE]: {received[-80:]!r}")
    return received, first


async def run_cell(session: Any, call: Call, concurrency: int, requests: int,
                   max_seconds: float, pids: dict[str, int]) -> Cell:
    """``requests`` calls from ``concurrency`` workers, stopping early at ``max_seconds``."""
    import aiohttp

    cell = Cell()
    issued = 0
    cpu_before = cpu_seconds(pids)
    start = time.perf_counter()
    deadline = start + max_seconds

    async def worker() -> None:
        nonlocal issued
        while issued < requests and time.perf_counter() < deadline:
            issued += 1
            began = time.perf_counter()
            try:
                first = await call(session)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                cell.fail(f"{type(exc).__name__}: {exc}")
                continue
            cell.latencies.append(time.perf_counter() - began)
            if first is not None:
                cell.first_bytes.append(first)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cell.elapsed = time.perf_counter() - start
    cpu_after = cpu_seconds(pids)
    cell.cpu_s = {name: cpu_after[name] - cpu_before[name]
                  for name in cpu_after if name in cpu_before}
    return cell


def server_description() -> str:
    from proxy.server import server_options

    options = server_options()
    return f"uvicorn with {options['loop']} + {options['http']}, aiohttp upstream client"


# -- report --------------------------------------------------------------------------------


def percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)] * 1e3, 3)


def summarize(mode: str, target: str, concurrency: int, runs: list[Cell]) -> dict[str, Any]:
    """One target's cell over all rounds: latencies pooled, rates and CPU per round's median."""
    latencies = [x for c in runs for x in c.latencies]
    first_bytes = [x for c in runs for x in c.first_bytes]
    errors = sum(c.errors for c in runs)
    done = [len(c.latencies) for c in runs]
    cpu: dict[str, float] = {}
    for name in runs[0].cpu_s:
        per_request = [c.cpu_s.get(name, 0.0) / n for c, n in zip(runs, done, strict=True) if n]
        if per_request:
            cpu[name] = round(statistics.median(per_request) * 1e3, 3)
    return {"mode": mode, "target": target, "concurrency": concurrency,
            "requests": len(latencies) + errors, "errors": errors,
            "first_error": next((c.first_error for c in runs if c.first_error), None),
            "rps": round(statistics.median(n / c.elapsed for c, n in zip(runs, done, strict=True)
                                           if c.elapsed > 0), 1) if latencies else None,
            "p50_ms": percentile_ms(latencies, 50), "p99_ms": percentile_ms(latencies, 99),
            "ttfb_p50_ms": percentile_ms(first_bytes, 50),
            "round_p50_ms": [percentile_ms(c.latencies, 50) for c in runs],
            "cpu_ms_per_request": cpu}


def paired_difference(runs: list[Cell], bases: list[Cell]) -> list[float]:
    """Per round, p50 of ``runs`` minus p50 of ``bases`` (ms); rounds lacking either left out."""
    differences = []
    for run, base in zip(runs, bases, strict=True):
        mine, theirs = percentile_ms(run.latencies, 50), percentile_ms(base.latencies, 50)
        if mine is not None and theirs is not None:
            differences.append(round(mine - theirs, 3))
    return differences


def added_latency(cells: dict[tuple[str, str, int], list[Cell]]) -> list[dict[str, Any]]:
    """Per mode and concurrency: the proxy's p50 minus each baseline's of the same round."""
    added = []
    for (mode, target, concurrency), runs in cells.items():
        if target != "proxy":
            continue
        entry: dict[str, Any] = {"mode": mode, "concurrency": concurrency}
        for base in ("decode", "prefill+decode"):
            differences = paired_difference(runs, cells[(mode, base, concurrency)])
            entry[f"vs_{base}"] = (round(statistics.median(differences), 3) if differences
                                   else None)
            entry[f"vs_{base}_range"] = ([min(differences), max(differences)] if differences
                                         else None)
        baseline = entry["vs_prefill+decode"]
        entry["under_target"] = baseline is not None and baseline < TARGET_ADDED_MS
        floor = cells.get(("json", FLOOR, concurrency))
        entry["hop_p50_ms"] = (percentile_ms([x for c in floor for x in c.latencies], 50)
                               if floor else None)
        added.append(entry)
    return added


def print_report(result: dict[str, Any]) -> None:
    print(f"proxy overhead: {result['server']}; stub upstreams; {result['rounds']} interleaved "
          f"rounds, {result['requests']} requests per cell in all; {result['chunks']}-event "
          f"streams; {result['cpus']} CPUs shared by all processes")
    print("p50: all rounds pooled [lowest..highest round p50]; req/s: median round; "
          "cpu: ms of CPU per request, median round")
    print(f"{'mode':6} {'conc':>4} {'target':15} {'reqs':>5} {'errs':>4} {'req/s':>7} "
          f"{'p50 ms':>7} {'[rounds]':>15} {'p99 ms':>8} {'ttfb50':>7}  cpu ms/req")
    rows = sorted(result["rows"] + result["floor"], key=lambda r: (
        MODES.index(r["mode"]), r["concurrency"], (*TARGETS, FLOOR).index(r["target"])))
    for r in rows:
        spread = [x for x in r["round_p50_ms"] if x is not None]
        rounds = f"[{min(spread):g}..{max(spread):g}]" if spread else "-"
        cpu = " ".join(f"{name}={value:g}" for name, value in r["cpu_ms_per_request"].items()
                       if value > 0)
        print(f"{r['mode']:6} {r['concurrency']:>4} {r['target']:15} {r['requests']:>5} "
              f"{r['errors']:>4} {_num(r['rps']):>7} {_num(r['p50_ms']):>7} {rounds:>15} "
              f"{_num(r['p99_ms']):>8} {_num(r['ttfb_p50_ms']):>7}  {cpu}")
    print(f"\nadded p50 latency of the proxy, ms (proxy p50 minus the same round's baseline p50: "
          f"median [lowest..highest]); target < {TARGET_ADDED_MS:g} ms over prefill+decode")
    print(f"{'mode':6} {'conc':>4} {'vs prefill+decode':>24} {'< target':>8} "
          f"{'vs decode':>10} {'hop p50':>8}")
    for a in sorted(result["added_p50_ms"], key=lambda a: (MODES.index(a["mode"]),
                                                           a["concurrency"])):
        span = a["vs_prefill+decode_range"]
        text = (f"{a['vs_prefill+decode']:g} [{span[0]:g}..{span[1]:g}]" if span else "-")
        print(f"{a['mode']:6} {a['concurrency']:>4} {text:>24} "
              f"{'yes' if a['under_target'] else 'NO':>8} {_num(a['vs_decode']):>10} "
              f"{_num(a['hop_p50_ms']):>8}")
    errors = [r for r in rows if r["first_error"]]
    for r in errors:
        print(f"first error, {r['mode']} {r['target']} x{r['concurrency']}: {r['first_error']}")
    print()
    for line in verdict(result):
        print(line)


def verdict(result: dict[str, Any]) -> list[str]:
    """The issue's target, read per concurrency: where added p50 is under it, and errors."""
    added = result["added_p50_ms"]
    met = sorted({a["concurrency"] for a in added if a["under_target"]
                  and all(b["under_target"] for b in added
                          if b["concurrency"] == a["concurrency"])})
    highest = max(a["concurrency"] for a in added)
    failed = sum(r["errors"] for r in result["rows"] + result["floor"]
                 if r["concurrency"] == highest)
    return [f"added p50 under {TARGET_ADDED_MS:g} ms (every mode) at concurrency: "
            f"{' '.join(map(str, met)) or 'none'}; of "
            f"{' '.join(str(c) for c in sorted({a['concurrency'] for a in added}))}",
            f"errors at the highest concurrency ({highest}): {failed}"]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
