"""``kvxfer bench proxy``: the latency the proxy adds, and the load it carries.

Starts a stub prefill, a stub decode (``python -m proxy.stub``) and the proxy
(``python -m proxy``), each its own process on loopback, then drives them with
an async httpx load generator in this process. Per answer mode (JSON, or SSE
of ``--chunks`` events) and per concurrency it measures three targets:

- ``decode``: the decode stub alone, called with fixed ``kv_transfer_params``;
- ``prefill+decode``: the client calls the prefill stub, then the decode stub,
  itself: the work the proxy does, without the proxy;
- ``proxy``: the same request through the proxy.

"Added" latency is proxy minus each baseline at p50. Stubs answer at once, so
the numbers are the HTTP and Python overhead of each hop, measured with a
client that shares the machine with everything else. Each cell stops after
``--requests`` requests or ``--max-seconds``, whichever comes first; the command
exits 1 if any request failed (the table names the first error of each cell).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HELP = "latency the proxy adds over direct prefill/decode calls, and requests/s under load"

TARGETS = ("decode", "prefill+decode", "proxy")
MODES = ("json", "stream")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=400,
                        help="requests per target, mode and concurrency (default 400)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="concurrent clients to test (default 1 8 32 64)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="answer modes (default json stream)")
    parser.add_argument("--chunks", type=int, default=16,
                        help="SSE events per streamed answer (default 16)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="unmeasured requests per target and mode first (default 20)")
    parser.add_argument("--max-seconds", type=float, default=20.0,
                        help="time cap per measured cell, seconds (default 20)")


@dataclass
class Cell:
    """What one target did at one concurrency in one mode; times in seconds."""

    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    elapsed: float = 0.0

    def fail(self, why: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or why


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "chunks"):
        if getattr(args, name) < 1:
            print(f"--{name} must be at least 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if min(args.concurrency) < 1:
        print(f"--concurrency values must be at least 1, got {args.concurrency}",
              file=sys.stderr)
        return 2
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    with deployment(args.chunks) as urls:
        result = asyncio.run(measure(urls, args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 1 if any(row["errors"] for row in result["rows"]) else 0


# -- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def deployment(chunks: int) -> Iterator[dict[str, str]]:
    """Stub prefill, stub decode and proxy processes; all stopped on exit, Ctrl-C included."""
    import proxy

    # The children import the same proxy package as this process, wherever it lies.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(proxy.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
    commands = {
        "prefill": ["-m", "proxy.stub", "--role", "prefill", "--port", str(ports["prefill"])],
        "decode": ["-m", "proxy.stub", "--role", "decode", "--port", str(ports["decode"]),
                   "--chunks", str(chunks)],
        "proxy": ["-m", "proxy", "--port", str(ports["proxy"]), "--prefiller-ports",
                  str(ports["prefill"]), "--decoder-ports", str(ports["decode"]),
                  "--log-level", "warning"]}
    with ExitStack() as stack:  # unwinds in reverse: proxy first, Ctrl-C included
        for name, command in commands.items():
            log = stack.enter_context(tempfile.TemporaryFile())
            # A session of their own: Ctrl-C reaches only us, and we stop them in order.
            process = subprocess.Popen([sys.executable, *command], env=env,
                                       stdout=subprocess.DEVNULL, stderr=log,
                                       start_new_session=True)
            stack.callback(stop, process)
            wait_healthy(name, process, log, f"http://127.0.0.1:{ports[name]}/health")
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}


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


# -- load ----------------------------------------------------------------------------------

async def measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from proxy.contract import prefill_request

    rows: list[dict[str, Any]] = []
    async with AsyncExitStack() as stack:
        # One client per worker: a shared httpx pool costs O(connections^2) per call
        # (httpcore's pool bookkeeping), which would make the load generator the bottleneck.
        clients = [await stack.enter_async_context(httpx.AsyncClient(timeout=30.0,
                                                                     trust_env=False))
                   for _ in range(max(args.concurrency))]
        answer = await clients[0].post(urls["prefill"] + "/v1/completions",
                                       json=prefill_request({"prompt": PROMPT}))
        params = answer.json()["kv_transfer_params"]
        for mode in args.modes:
            body = {"model": "stub-model", "prompt": PROMPT, "max_tokens": args.chunks,
                    "stream": mode == "stream"}
            calls = targets(urls, body, params)
            for target in TARGETS:
                await run_cell(clients[:4], calls[target], args.warmup, args.max_seconds)
            for concurrency in args.concurrency:
                for target in TARGETS:
                    cell = await run_cell(clients[:concurrency], calls[target], args.requests,
                                          args.max_seconds)
                    rows.append(summarize(mode, target, concurrency, cell))
    return {"requests": args.requests, "chunks": args.chunks, "cpus": os.cpu_count(),
            "rows": rows, "added_p50_ms": added_latency(rows)}


def targets(urls: dict[str, str], body: dict[str, Any], params: dict[str, Any]
            ) -> dict[str, Callable[[Any], Awaitable[float | None]]]:
    """Per target, a call returning the time to its first body byte (None: not streamed)."""
    import msgspec

    from proxy.contract import decode_request, prefill_request

    route = "/v1/completions"
    decode_body = msgspec.json.encode(decode_request(body, params))
    prefill_body = msgspec.json.encode(prefill_request(body))
    proxy_body = msgspec.json.encode(body)
    stream = body["stream"] is True

    async def decode(client: Any) -> float | None:
        return await send(client, urls["decode"] + route, decode_body, stream)

    async def sequential(client: Any) -> float | None:
        start = time.perf_counter()
        answer = await client.post(urls["prefill"] + route, content=prefill_body,
                                   headers={"content-type": "application/json"})
        check(answer.status_code, answer.content)
        leased = msgspec.json.encode(decode_request(body, answer.json()["kv_transfer_params"]))
        prefilled = time.perf_counter() - start
        first = await send(client, urls["decode"] + route, leased, stream)
        return None if first is None else prefilled + first

    async def proxied(client: Any) -> float | None:
        return await send(client, urls["proxy"] + route, proxy_body, stream)

    return {"decode": decode, "prefill+decode": sequential, "proxy": proxied}


async def send(client: Any, url: str, content: bytes, stream: bool) -> float | None:
    """POST ``content``; read the whole answer; seconds to its first body chunk if streamed."""
    headers = {"content-type": "application/json"}
    if not stream:
        answer = await client.post(url, content=content, headers=headers)
        check(answer.status_code, answer.content)
        return None
    start = time.perf_counter()
    first: float | None = None
    received = b""
    async with client.stream("POST", url, content=content, headers=headers) as answer:
        async for chunk in answer.aiter_raw():
            first = time.perf_counter() - start if first is None else first
            received += chunk
        check(answer.status_code, received)
    if not received.endswith(b"data: [DONE]\n\n"):
        raise ValueError(f"stream from {url} did not end with [DONE]: {received[-80:]!r}")
    return first


def check(status: int, content: bytes) -> None:
    if status != 200:
        raise ValueError(f"HTTP {status}: {content[:200]!r}")


async def run_cell(clients: list[Any], call: Callable[[Any], Awaitable[float | None]],
                   requests: int, max_seconds: float) -> Cell:
    """``requests`` calls from one worker per client, stopping early at ``max_seconds``."""
    import httpx

    cell = Cell()
    issued = 0
    start = time.perf_counter()
    deadline = start + max_seconds

    async def worker(client: Any) -> None:
        nonlocal issued
        while issued < requests and time.perf_counter() < deadline:
            issued += 1
            began = time.perf_counter()
            try:
                first = await call(client)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                cell.fail(f"{type(exc).__name__}: {exc}")
                continue
            cell.latencies.append(time.perf_counter() - began)
            if first is not None:
                cell.first_bytes.append(first)

    await asyncio.gather(*(worker(client) for client in clients))
    cell.elapsed = time.perf_counter() - start
    return cell


# -- report --------------------------------------------------------------------------------


def percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)] * 1e3, 3)


def summarize(mode: str, target: str, concurrency: int, cell: Cell) -> dict[str, Any]:
    done = len(cell.latencies)
    return {"mode": mode, "target": target, "concurrency": concurrency,
            "requests": done + cell.errors, "errors": cell.errors,
            "first_error": cell.first_error,
            "rps": round(done / cell.elapsed, 1) if cell.elapsed > 0 else None,
            "p50_ms": percentile_ms(cell.latencies, 50),
            "p99_ms": percentile_ms(cell.latencies, 99),
            "ttfb_p50_ms": percentile_ms(cell.first_bytes, 50)}


def added_latency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Proxy p50 minus each baseline's p50, per mode and concurrency (milliseconds)."""
    by_key = {(r["mode"], r["concurrency"], r["target"]): r for r in rows}
    added = []
    for (mode, concurrency, target), row in by_key.items():
        if target != "proxy" or row["p50_ms"] is None:
            continue
        entry: dict[str, Any] = {"mode": mode, "concurrency": concurrency}
        for base in ("decode", "prefill+decode"):
            base_p50 = by_key[(mode, concurrency, base)]["p50_ms"]
            entry[f"vs_{base}"] = None if base_p50 is None else round(row["p50_ms"] - base_p50, 3)
        added.append(entry)
    return added


def print_table(result: dict[str, Any]) -> None:
    print(f"proxy overhead, stub upstreams, {result['requests']} requests per cell, "
          f"{result['chunks']}-event streams, {result['cpus']} CPUs shared by all processes")
    print(f"{'mode':6} {'target':15} {'conc':>4} {'reqs':>5} {'errs':>4} {'req/s':>8} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'ttfb50':>8}")
    for r in result["rows"]:
        print(f"{r['mode']:6} {r['target']:15} {r['concurrency']:>4} {r['requests']:>5} "
              f"{r['errors']:>4} {_num(r['rps']):>8} {_num(r['p50_ms']):>8} "
              f"{_num(r['p99_ms']):>8} {_num(r['ttfb_p50_ms']):>8}")
    print("\nadded p50 latency of the proxy (ms)")
    print(f"{'mode':6} {'conc':>4} {'vs decode':>10} {'vs prefill+decode':>18}")
    for a in result["added_p50_ms"]:
        print(f"{a['mode']:6} {a['concurrency']:>4} {_num(a['vs_decode']):>10} "
              f"{_num(a['vs_prefill+decode']):>18}")
    for r in result["rows"]:
        if r["first_error"]:
            print(f"first error, {r['mode']} {r['target']} x{r['concurrency']}: "
                  f"{r['first_error']}")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
