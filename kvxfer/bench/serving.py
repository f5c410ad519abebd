"""``kvxfer bench serve``: what the sidecars of the reference engine do on this machine.

Prompt processing, decoding and the KV transfer per ``--model`` and ``--tp``, as medians,
each model's figures as ratios to the first model's. Nothing is asserted.

Design: docs/design/bench.md#kvxfer-bench-serve
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import IO, Any, TypeVar

HELP = "prefill/decode throughput and KV transfer time of the reference engine, via sidecars"

DEFAULT_MODELS = ("smollm2-135m-instruct", "kvxfer-tiny")
DEFAULT_TPS = (1, 3)

READY_PREFIX = "kvxfer serve ready: "
START_TIMEOUT_S = 120.0
T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=1000,
                        help="prompt length for prefill and transfer (default 1000)")
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="tokens generated per decode request (default 128)")
    parser.add_argument("--batch", type=int, default=8,
                        help="concurrent decode requests for the batched figure (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (default 3)")
    parser.add_argument("--model", action="append", default=None,
                        help="model to measure (repeatable; default: "
                             f"{' and '.join(DEFAULT_MODELS)}); the first is the baseline")
    parser.add_argument("--tp", type=int, action="append", default=None,
                        help="TP size of the sidecars (repeatable; default: "
                             f"{' and '.join(map(str, DEFAULT_TPS))})")
    parser.add_argument("--kv-cache-layout", default="LBHNC", help="layout (default LBHNC)")
    parser.add_argument("--num-blocks", type=int, default=1024,
                        help="KV cache blocks per sidecar (default 1024)")


@contextmanager
def sidecar(role: str, model: str, tp: int, args: argparse.Namespace) -> Iterator[str]:
    """A ``kvxfer serve`` process; yields its base URL, terminates it on exit."""
    argv = [sys.executable, "-m", "kvxfer.cli", "--log-level", "WARNING", "serve",
            "--role", role, "--model", model, "--port", "0", "--tp", str(tp),
            "--kv-cache-layout", args.kv_cache_layout, "--num-blocks", str(args.num_blocks),
            "--kv-load-failure-policy", "fail"]
    with launched(argv, f"{role} sidecar ({model}, TP {tp})") as url:
        yield url


def role_cpu(role: str, pin: bool) -> int | None:
    """With ``pin`` and two CPUs or more, the CPU a benchmark binds ``role``'s sidecars
    to: prefills the first allowed one, decodes the second (else None: unbound)."""
    allowed = sorted(os.sched_getaffinity(0))
    if not pin or len(allowed) < 2:
        return None
    return allowed[0 if role == "prefill" else 1]


@contextmanager
def launched(argv: list[str], what: str, env: dict[str, str] | None = None,
             cpu: int | None = None) -> Iterator[str]:
    """Run ``argv`` (a ``kvxfer serve``) with its output in a temporary log file, so that
    nothing can block on a full pipe; yield its URL from the ready line, stop it on exit.
    ``cpu``: bind the process (all its threads) to that CPU, set before it starts."""
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   env=env, preexec_fn=pin)
        try:
            yield _wait_ready(process, log, what)
        finally:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(20)


def _wait_ready(process: subprocess.Popen[str], log: IO[str], what: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        log.seek(0)
        output = log.read()
        for line in output.splitlines():
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].split()[0]
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    log.seek(0)
    tail = log.read().strip().splitlines()[-3:]
    raise BenchError(f"the {what} did not become ready (exit code {process.poll()}): "
                     + " / ".join(tail))


class BenchError(RuntimeError):
    """A sidecar did not start or a request failed; the message says which."""


def run_checked(name: str, check: Callable[[], T], measure: Callable[[T], dict[str, Any]],
                report: Callable[[dict[str, Any]], None]) -> int:
    """A bench's exit status: 2 where ``check()`` refused the arguments (a
    :class:`BenchError`), 1 where ``measure`` failed or requests did (``failed_requests``,
    where it counts them), 130 on Ctrl-C (every process it started is stopped by then),
    else 0; ``report`` writes what was measured."""
    try:
        checked = check()
    except BenchError as exc:
        print(f"kvxfer bench {name}: {exc}", file=sys.stderr)
        return 2
    try:
        measured = measure(checked)
    except BenchError as exc:
        print(f"kvxfer bench {name}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kvxfer bench {name}: interrupted", file=sys.stderr)
        return 130
    report(measured)
    return 1 if measured.get("failed_requests") else 0


def check_context(model: str, lengths: list[int], max_tokens: int, extra: int = 0) -> None:
    """:class:`BenchError` where the longest of ``lengths`` plus ``extra`` prompt tokens and
    ``max_tokens`` output tokens is past ``model``'s context (read without its weights)."""
    from kvxfer.engine.checkpoint import CheckpointError
    from kvxfer.engine.model_names import model_config

    try:
        context = model_config(model).max_position_embeddings
    except (CheckpointError, OSError) as exc:
        raise BenchError(f"--model {model}: {exc}") from None
    longest = max(lengths) + extra + max_tokens
    if longest > context:
        raise BenchError(f"--lengths {max(lengths)} plus --max-tokens {max_tokens} is {longest} "
                         f"tokens, past {model}'s context of {context}")


def _prompt(tokens: int) -> list[int]:
    """Exactly ``tokens`` ids, each below 128: valid for the byte model and any BPE
    vocabulary, and the same prompt for every model."""
    return [1] + [32 + (7 * i) % 95 for i in range(tokens - 1)]


def run(args: argparse.Namespace) -> int:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    if min(args.prompt_tokens, args.decode_tokens, args.batch, args.repeats) < 1:
        print("--prompt-tokens, --decode-tokens, --batch and --repeats must be >= 1",
              file=sys.stderr)
        return 2
    models, tps = args.model or list(DEFAULT_MODELS), args.tp or list(DEFAULT_TPS)
    cells: list[dict[str, Any]] = []
    try:
        for model in models:
            for tp in tps:
                reason = _not_applicable(model, tp)
                results = None if reason else _measure(model, tp, args, httpx)
                cells.append({"model": model, "tp": tp, "results": results,
                              "not_applicable": reason})
                if not args.json:
                    print(f"  measured {model} TP {tp}" if results else
                          f"  skipped {model} TP {tp}: {reason}", file=sys.stderr)
    except BenchError as exc:
        print(f"kvxfer bench serve: {exc}", file=sys.stderr)
        return 1
    config = {"layout": args.kv_cache_layout, "prompt_tokens": args.prompt_tokens,
              "decode_tokens": args.decode_tokens, "batch": args.batch,
              "baseline": models[0]}
    _add_ratios(cells, models[0])
    if args.json:
        print(json.dumps({"config": config, "cells": cells}, indent=2))
    else:
        _print_table(config, cells)
    return 0


def _not_applicable(model: str, tp: int) -> str | None:
    """Why ``model`` cannot run at TP ``tp`` (None when it can), without loading weights."""
    from kvxfer.engine.model_names import model_config
    from kvxfer.engine.transformer import check_tp

    try:
        check_tp(model_config(model), tp)
    except ValueError as exc:
        return str(exc)
    return None


def _measure(model: str, tp: int, args: argparse.Namespace, httpx: Any) -> dict[str, float]:
    with ExitStack() as stack:
        urls = {role: stack.enter_context(sidecar(role, model, tp, args))
                for role in ("both", "prefill", "decode")}
        client = stack.enter_context(httpx.Client(timeout=600, trust_env=False))
        return {
            "prefill_tokens_per_s": _median(args.repeats, lambda: _prefill(client, urls, args)),
            "decode_tokens_per_s": _median(args.repeats, lambda: _decode(client, urls, args)),
            f"decode_tokens_per_s_batch{args.batch}":
                _median(args.repeats, lambda: _batch(client, urls, args)),
            **_transfer(client, urls, args),
        }


def _add_ratios(cells: list[dict[str, Any]], baseline: str) -> None:
    """``ratio_to_baseline``: each figure over the baseline model's at the same TP."""
    base = {c["tp"]: c["results"] for c in cells if c["model"] == baseline and c["results"]}
    for cell in cells:
        ref = base.get(cell["tp"])
        if cell["results"] and ref and cell["model"] != baseline:
            cell["ratio_to_baseline"] = {k: v / ref[k] for k, v in cell["results"].items()
                                         if ref.get(k)}


def _print_table(config: dict[str, Any], cells: list[dict[str, Any]]) -> None:
    print(f"kvxfer bench serve ({', '.join(f'{k}={v}' for k, v in config.items())})")
    for cell in cells:
        print(f"\n{cell['model']}, TP {cell['tp']}")
        if not cell["results"]:
            print(f"  not applicable: {cell['not_applicable']}")
            continue
        ratios = cell.get("ratio_to_baseline", {})
        for key, value in cell["results"].items():
            ratio = f"  ({ratios[key]:.3f}x baseline)" if key in ratios else ""
            print(f"  {key:<32} {value:12.3f}{ratio}")


def _median(repeats: int, measure: Any) -> float:
    return float(statistics.median(measure() for _ in range(repeats)))


def _post(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(url, json=body)
    if response.status_code != 200:
        raise BenchError(f"{url} answered {response.status_code}: {response.text[:300]}")
    return dict(response.json())


def _prefill(client: Any, urls: dict[str, str], args: argparse.Namespace) -> float:
    start = time.perf_counter()
    _post(client, f"{urls['both']}/v1/completions",
          {"prompt": _prompt(args.prompt_tokens), "max_tokens": 1, "temperature": 0})
    return float(args.prompt_tokens) / (time.perf_counter() - start)


def _stream_rate(client: Any, url: str, tokens: int) -> tuple[int, float]:
    """(tokens after the first, seconds they took) of one streamed greedy answer."""
    # logprobs: one chunk per token, even while a token's text is held back (half a
    # UTF-8 character, or text that could still become a stop string).
    body = {"prompt": "Decode speed", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    first = last = 0.0
    count = 0
    for last, _ in stream_events(client, url, body):
        first = first or last
        count += 1
    if count < 2:
        raise BenchError(f"{url} streamed {count} chunk(s) for {tokens} tokens: nothing to "
                         f"time a decode rate on (use --decode-tokens 4 or more)")
    return count - 1, last - first


def stream_events(client: Any, url: str, body: dict[str, Any]
                  ) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST a streamed completion to ``url``: (``perf_counter`` when it came, the event) for
    each JSON event; BenchError for an answer other than 200."""
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise BenchError(f"{url} answered {response.status_code}: "
                             f"{response.read()[:300]!r}")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                yield time.perf_counter(), json.loads(line[len("data: "):])


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
        # two tokens: the first is the prefill's; the decode reads the KV for the second
        _post(client, f"{urls['decode']}/v1/completions",
              {**body, "max_tokens": 2, "kv_transfer_params": answer["kv_transfer_params"]})
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
