"""``kvxfer bench serve``: what the sidecars of the built-in engine do on this machine.

Starts a ``both``, a ``prefill`` and a ``decode`` sidecar (``kvxfer serve``, each
its own process on loopback, HTTP port chosen by the sidecar) and measures, over
real HTTP:

- prompt processing: a ``--prompt-tokens`` prompt with ``max_tokens=1`` on the
  ``both`` instance, in prompt tokens per second;
- decoding, one request: a streamed ``--decode-tokens`` answer, tokens per second
  after the first token; and ``--batch`` such requests at once, aggregate;
- the KV transfer of a ``--prompt-tokens`` prompt: prefill (``do_remote_decode``)
  then decode with the returned params, read from the decode's /metrics
  (``kvxfer_kv_transfer_duration_seconds`` and bytes), after one warm-up pair
  that pays the handshake. The end-to-end time of the decode request is shown too.

Every number is a median over ``--repeats`` runs; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

HELP = "prefill/decode throughput of the built-in model and the KV transfer time, via sidecars"

READY_PREFIX = "kvxfer serve ready: "
START_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=1000,
                        help="prompt length for prefill and transfer (default 1000)")
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="tokens generated per decode request (default 128)")
    parser.add_argument("--batch", type=int, default=8,
                        help="concurrent decode requests for the batched figure (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (default 3)")
    parser.add_argument("--tp", type=int, default=1, help="TP of every sidecar (default 1)")
    parser.add_argument("--kv-cache-layout", default="LBHNC", help="layout (default LBHNC)")
    parser.add_argument("--num-blocks", type=int, default=1024,
                        help="KV cache blocks per sidecar (default 1024)")


@contextmanager
def sidecar(role: str, args: argparse.Namespace) -> Iterator[str]:
    """A ``kvxfer serve`` process; yields its base URL, terminates it on exit."""
    argv = [sys.executable, "-m", "kvxfer.cli", "--log-level", "WARNING", "serve",
            "--role", role, "--port", "0", "--tp", str(args.tp), "--kv-cache-layout",
            args.kv_cache_layout, "--num-blocks", str(args.num_blocks),
            "--kv-load-failure-policy", "fail"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
    try:
        yield _wait_ready(process, role)
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(20)


def _wait_ready(process: subprocess.Popen[str], role: str) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    for line in process.stdout:  # ends when the process exits
        if line.startswith(READY_PREFIX):
            return line[len(READY_PREFIX):].split()[0]
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"the {role} sidecar did not become ready (exit code {process.poll()})")


def _prompt(tokens: int) -> list[int]:
    """BOS and ``tokens - 1`` printable bytes: exactly ``tokens`` ids for the tiny model."""
    return [256] + [32 + (7 * i) % 95 for i in range(tokens - 1)]


def run(args: argparse.Namespace) -> int:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    if min(args.prompt_tokens, args.decode_tokens, args.batch, args.repeats) < 1:
        print("--prompt-tokens, --decode-tokens, --batch and --repeats must be >= 1",
              file=sys.stderr)
        return 2
    with ExitStack() as stack:
        urls = {role: stack.enter_context(sidecar(role, args))
                for role in ("both", "prefill", "decode")}
        client = stack.enter_context(httpx.Client(timeout=300, trust_env=False))
        results = {
            "prefill_tokens_per_s": _median(args.repeats, lambda: _prefill(client, urls, args)),
            "decode_tokens_per_s": _median(args.repeats, lambda: _decode(client, urls, args)),
            f"decode_tokens_per_s_batch{args.batch}":
                _median(args.repeats, lambda: _batch(client, urls, args)),
            **_transfer(client, urls, args),
        }
    config = {"tp": args.tp, "layout": args.kv_cache_layout,
              "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens}
    if args.json:
        print(json.dumps({"config": config, "results": results}, indent=2))
    else:
        print(f"kvxfer bench serve ({', '.join(f'{k}={v}' for k, v in config.items())})")
        for key, value in results.items():
            print(f"  {key:<32} {value:12.3f}")
    return 0


def _median(repeats: int, measure: Any) -> float:
    return float(statistics.median(measure() for _ in range(repeats)))


def _post(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(url, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
    return dict(response.json())


def _prefill(client: Any, urls: dict[str, str], args: argparse.Namespace) -> float:
    start = time.perf_counter()
    _post(client, f"{urls['both']}/v1/completions",
          {"prompt": _prompt(args.prompt_tokens), "max_tokens": 1, "temperature": 0})
    return float(args.prompt_tokens) / (time.perf_counter() - start)


def _stream_rate(client: Any, url: str, tokens: int) -> tuple[int, float]:
    """(tokens after the first, seconds they took) of one streamed greedy answer."""
    body = {"prompt": "Decode speed", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    first = last = 0.0
    count = 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
                count += 1
    return count - 1, last - first


def _decode(client: Any, urls: dict[str, str], args: argparse.Namespace) -> float:
    tokens, seconds = _stream_rate(client, urls["both"], args.decode_tokens)
    return tokens / seconds


def _batch(client: Any, urls: dict[str, str], args: argparse.Namespace) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(args.batch) as pool:
        done = list(pool.map(lambda _: _stream_rate(client, urls["both"], args.decode_tokens),
                             range(args.batch)))
    return sum(t + 1 for t, _ in done) / (time.perf_counter() - start)


def _transfer(client: Any, urls: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    body = {"prompt": _prompt(args.prompt_tokens), "max_tokens": 1, "temperature": 0}
    seconds, ends = [], []
    moved = 0.0
    for attempt in range(args.repeats + 1):  # the first pair pays the handshake
        before = _metrics(client, urls["decode"])
        answer = _post(client, f"{urls['prefill']}/v1/completions", {
            **body, "kv_transfer_params": {"do_remote_decode": True}})
        start = time.perf_counter()
        _post(client, f"{urls['decode']}/v1/completions",
              {**body, "kv_transfer_params": answer["kv_transfer_params"]})
        end = time.perf_counter() - start
        after = _metrics(client, urls["decode"])
        if attempt:
            seconds.append(after["kvxfer_kv_transfer_duration_seconds_sum"]
                           - before["kvxfer_kv_transfer_duration_seconds_sum"])
            moved = after["kvxfer_kv_transfer_bytes_total"] - before[
                "kvxfer_kv_transfer_bytes_total"]
            ends.append(end)
    transfer = statistics.median(seconds)
    return {"transfer_ms": 1000 * transfer, "transfer_MiB": moved / 2**20,
            "transfer_GB_per_s": moved / transfer / 1e9,
            "decode_request_ms_with_transfer": 1000 * statistics.median(ends)}


def _metrics(client: Any, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get(f"{url}/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if not s.labels}
