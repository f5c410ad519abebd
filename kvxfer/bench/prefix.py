"""``kvxfer bench prefix``: what the prefix cache buys a shared system prompt, in one run.

Three prefill/decode pairs (no prefix cache, on the decode only, on both), each figure's
ratio to no cache measured in the same run. Nothing is asserted.

Design: docs/design/bench.md#kvxfer-bench-prefix
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from kvxfer.bench.serving import BenchError, _metrics, _post, launched, role_cpu, run_checked

HELP = "time to first token and KV bytes moved for a shared system prompt, prefix cache " \
       "off vs on, in one run"

CONFIGS = {"off": (False, False), "decode": (False, True), "both": (True, True)}
BYTES = "kvxfer_kv_transfer_bytes_total"
READ_S = "kvxfer_kv_transfer_duration_seconds_sum"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system-tokens", type=int, default=1000,
                        help="tokens of the system prompt every request starts with "
                             "(default 1000)")
    parser.add_argument("--user-tokens", type=int, default=24,
                        help="tokens of each request's own part after it (default 24)")
    parser.add_argument("--requests", type=int, default=20,
                        help="measured requests per configuration (default 20)")
    parser.add_argument("--model", default="kvxfer-tiny", help="model (default kvxfer-tiny)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="block size of every sidecar (default 16)")
    parser.add_argument("--num-blocks", type=int, default=1024,
                        help="KV cache blocks per sidecar (default 1024)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"which pairs to run, comma-separated, off always among them "
                             f"(default {','.join(CONFIGS)})")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not bind the prefills to one CPU and the decodes to another")


@contextmanager
def _sidecar(role: str, cache: bool, args: argparse.Namespace) -> Iterator[str]:
    argv = [sys.executable, "-m", "kvxfer.cli", "--log-level", "ERROR", "serve", "--role",
            role, "--model", args.model, "--port", "0", "--block-size", str(args.block_size),
            "--num-blocks", str(args.num_blocks), "--kv-load-failure-policy", "fail"]
    if cache:
        argv.append("--enable-prefix-caching")
    cpu = role_cpu(role, args.pin)
    with launched(argv, f"{role} sidecar (prefix cache {'on' if cache else 'off'})",
                  None, cpu) as url:
        yield url


def prompts(args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    """(warm-up prompt, measured prompts). Ids below 128 (valid for the byte model and
    any BPE vocabulary); request ``i``'s own part starts with a token of its own."""
    system = [1] + [32 + (7 * i) % 95 for i in range(args.system_tokens - 1)]
    own = [[32 + (i + 3 * j) % 95 for j in range(args.user_tokens)]
           for i in range(args.requests)]
    warmup = [1] + [32 + (11 * i + 5) % 95 for i in range(args.system_tokens
                                                          + args.user_tokens - 1)]
    return warmup, [system + tail for tail in own]


def _request(client: Any, pair: dict[str, str], prompt: list[int]) -> dict[str, float]:
    """One request as the proxy sends it: TTFT, the decode's part of it, bytes read."""
    # one chunk per token: the first is the prefill's, the second the decode's first own
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    before = _metrics(client, pair["decode"])
    start = time.perf_counter()
    answer = _post(client, f"{pair['prefill']}/v1/completions",
                   {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    decode_start = time.perf_counter()
    first, chunks = None, 0
    with client.stream("POST", f"{pair['decode']}/v1/completions",
                       json={**body, "stream": True,
                             "kv_transfer_params": answer["kv_transfer_params"]}) as response:
        if response.status_code != 200:
            raise BenchError(f"the decode answered {response.status_code}: "
                             f"{response.read()[:300]!r}")
        for line in response.iter_lines():  # to the end: the request finishes
            chunks += line.startswith("data: {")
            if first is None and chunks == 2:
                first = time.perf_counter()
    if first is None:
        raise BenchError("the decode streamed no token")
    after = _metrics(client, pair["decode"])
    return {"ttft_s": first - start, "decode_ttft_s": first - decode_start,
            "bytes": after.get(BYTES, 0.0) - before.get(BYTES, 0.0),
            "read_s": after.get(READ_S, 0.0) - before.get(READ_S, 0.0)}


def _run_pairs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    import httpx

    warmup, measured = prompts(args)
    with ExitStack() as stack:
        urls = _enter_all(stack, {(name, role): _sidecar(role, cache, args)
                                  for name in args.configs
                                  for role, cache in zip(("prefill", "decode"), CONFIGS[name],
                                                         strict=True)})
        pairs = {name: {role: urls[name, role] for role in ("prefill", "decode")}
                 for name in args.configs}
        client = stack.enter_context(httpx.Client(timeout=600, trust_env=False))
        for pair in pairs.values():
            _request(client, pair, warmup)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in pairs}
        names = list(pairs)
        for i, prompt in enumerate(measured):
            for name in names[i % len(names):] + names[:i % len(names)]:
                try:
                    runs[name].append(_request(client, pairs[name], prompt))
                except BenchError as exc:
                    raise BenchError(f"{name}, request {i}: {exc}") from None
        return {name: _summary(runs[name], _metrics(client, pairs[name]["decode"]),
                               _metrics(client, pairs[name]["prefill"])) for name in pairs}


def _enter_all(stack: ExitStack, managers: dict[Any, AbstractContextManager[str]]
               ) -> dict[Any, str]:
    """Enter every manager at once (the sidecars start in parallel) and exit them at once
    when ``stack`` closes (each drains for seconds after SIGTERM), also when one of them
    failed to start."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = {key: pool.submit(manager.__enter__) for key, manager in managers.items()}
    urls, errors = {}, []
    for key, future in futures.items():
        try:
            urls[key] = future.result()
        except BaseException as exc:
            errors.append(exc)

    def exit_all(*_: object) -> None:
        with ThreadPoolExecutor(len(managers)) as pool:
            for key in urls:
                pool.submit(managers[key].__exit__, None, None, None)

    stack.callback(exit_all)
    if errors:
        raise errors[0]
    return urls


def _summary(runs: list[dict[str, float]], decode: dict[str, float],
             prefill: dict[str, float]) -> dict[str, Any]:
    def ms(key: str, part: list[dict[str, float]]) -> float:
        return 1000 * statistics.median(r[key] for r in part)

    warm = runs[1:] or runs
    return {"ttft_ms": ms("ttft_s", runs), "ttft_ms_first": 1000 * runs[0]["ttft_s"],
            "ttft_ms_warm": ms("ttft_s", warm), "decode_ttft_ms": ms("decode_ttft_s", runs),
            "read_ms_warm": ms("read_s", warm),
            "bytes_moved": sum(r["bytes"] for r in runs),
            "bytes_moved_first": runs[0]["bytes"],
            "bytes_moved_warm_median": statistics.median(r["bytes"] for r in warm),
            "reads_skipped": decode.get("kvxfer_kv_reads_skipped_total", 0.0),
            "decode_cache_hit_tokens": decode.get("kvxfer_prefix_cache_hits_total", 0.0),
            "prefill_cache_hit_tokens": prefill.get("kvxfer_prefix_cache_hits_total", 0.0)}


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)

    def check() -> None:
        if min(args.system_tokens, args.user_tokens, args.requests) < 1 or args.requests > 95:
            raise BenchError("--system-tokens, --user-tokens and --requests must be >= 1, "
                             "--requests <= 95")
        args.configs = ["off", *(c for c in dict.fromkeys(args.configs.split(","))
                                 if c != "off")]
        unknown = [c for c in args.configs if c not in CONFIGS]
        if unknown:
            raise BenchError(f"--configs: unknown {', '.join(unknown)} (choose from "
                             f"{', '.join(CONFIGS)})")

    def measure(_: None) -> dict[str, Any]:
        configs = _run_pairs(args)
        off = configs["off"]
        for name, result in configs.items():
            if name != "off":
                result["ratio_to_off"] = {k: v / off[k] for k, v in result.items()
                                          if isinstance(v, float) and off.get(k)}
        return {"config": {"model": args.model, "system_tokens": args.system_tokens,
                           "user_tokens": args.user_tokens, "requests": args.requests,
                           "block_size": args.block_size, "pinned": args.pin,
                           "configs": args.configs},
                "configs": configs}

    def report(measured: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(measured, indent=2))
        else:
            _print_table(measured)

    return run_checked("prefix", check, measure, report)


ROWS = (("ttft_ms", "time to first token, median (ms)", 1.0),
        ("ttft_ms_first", "  the first (cold) request (ms)", 1.0),
        ("ttft_ms_warm", "  the others, median (ms)", 1.0),
        ("decode_ttft_ms", "decode's part of it, median (ms)", 1.0),
        ("read_ms_warm", "  its KV read, warm median (ms)", 1.0),
        ("bytes_moved", "KV read, all requests (MiB)", 2**-20),
        ("bytes_moved_warm_median", "  per warm request, median (MiB)", 2**-20),
        ("reads_skipped", "reads skipped (full hits)", 1.0),
        ("decode_cache_hit_tokens", "decode prefix cache hits (tokens)", 1.0),
        ("prefill_cache_hit_tokens", "prefill prefix cache hits (tokens)", 1.0))


def _print_table(report: dict[str, Any]) -> None:
    config, configs = report["config"], report["configs"]
    print(f"kvxfer bench prefix ({', '.join(f'{k}={v}' for k, v in config.items())}; "
          f"cache off / on the decode / on both, ratio to off in brackets)")
    others = [name for name in configs if name != "off"]
    print(f"  {'':36} {'off':>12} " + " ".join(f"{name:>22}" for name in others))
    for key, label, scale in ROWS:
        cells = [f"{scale * configs['off'][key]:12.2f}"]
        for name in others:
            ratio = configs[name].get("ratio_to_off", {}).get(key)
            cells.append(f"{scale * configs[name][key]:12.2f}" +
                         (f" ({ratio:6.3f}x)" if ratio is not None else " " * 10))
        print(f"  {label:36} {' '.join(cells)}")
