"""``kvxfer bench ttft``: time to first and second token, one instance next to P/D.

Medians and p90 per prompt length and target, and a verdict against issue 25's targets; exits
1 only when requests failed. A further transfer mode is one more entry of :data:`MODES`, with
its processes started in :func:`deployment`.

Design: docs/design/bench.md#kvxfer-bench-ttft
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxfer.bench.children import Child, add_output_arguments, local_ports, started
from kvxfer.bench.serving import (
    BenchError,
    _metrics,
    _prompt,
    check_context,
    run_checked,
    stream_events,
)

HELP = "time to first and second token and inter-token latency, one instance vs P/D"

BASELINE = "one"
# the baseline first; "pd" and "push" are P/D at every length ("push": the decode reserves,
# the prefill writes each layer into it); "deployed" is pull behind a proxy routing as it
# does by default (a prompt too short for P/D to pay goes to the decode alone)
MODES = {BASELINE: "one instance", "pd": "P/D (proxy)", "push": "P/D push (proxy)",
         "deployed": "P/D as deployed"}
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_LENGTHS = (20, 50, 120, 500, 1000, 2000)
TTFT_LIMIT = 1.05  # issue 25: P/D median TTFT at most 1.05x one instance's
BLOCK_SIZE = 16  # kvxfer serve's default
REQUEST_TIMEOUT_S = 600.0
# The bench runs without keys: none a caller's environment holds may reach the children.
KEY_VARIABLES = ("KVXFER_API_KEY", "KVXFER_PROXY_API_KEY", "KVXFER_KV_KEY_FILE")
TRANSFER_S = "kvxfer_kv_transfer_duration_seconds_sum"
READ_WAIT_S = "kvxfer_kv_read_wait_seconds_sum"
METRICS = ("ttft_ms", "tt2t_ms", "itl_ms")
SIDECARS = ("both", "prefill", "decode", "decode-push")  # a name's role comes before "-"
PROXIES = ("proxy", "proxy-push", "proxy-deployed")
EVERY_LENGTH = ("--pd-min-tokens", "0")  # P/D itself, however short the prompt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"model of every sidecar, a name from `kvxfer models` "
                             f"(default {DEFAULT_MODEL}; kvxfer-tiny is the fast one)")
    parser.add_argument("--lengths", type=lengths, default=DEFAULT_LENGTHS, metavar="N,N,...",
                        help="prompt lengths in tokens, comma-separated (default "
                             f"{','.join(map(str, DEFAULT_LENGTHS))})")
    parser.add_argument("--repeats", type=int, default=6,
                        help="measured requests per target and length (default 6)")
    parser.add_argument("--max-tokens", type=int, default=8,
                        help="tokens of each streamed answer, 2 or more (default 8)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw TTFT against prompt length, one line per target "
                             "(needs matplotlib: pip install matplotlib)")
    add_output_arguments(parser)


def lengths(text: str) -> tuple[int, ...]:
    """``--lengths``: distinct prompt lengths, ascending; each of 2 tokens or more (a P/D
    decode reads all but the last token's KV)."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}"
                                         ) from None
    if not values or values[0] < 2:
        raise argparse.ArgumentTypeError(f"prompt lengths must be 2 tokens or more, got {text!r}")
    return tuple(values)


class RequestFailed(RuntimeError):
    """A measured request got no answer, an error, or too few tokens; the message says which."""


# -- statistics (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One streamed answer; seconds, from sending the request."""

    ttft: float
    tt2t: float
    itl: float  # the mean gap between the tokens after the first
    transfer: float | None  # the decode's KV read; None: no decode behind the target
    read_wait: float | None = None  # the decode's arrival to its READ's start (claim...)


def sample(sent: float, token_times: Sequence[float], transfer: float | None,
           read_wait: float | None = None) -> Sample:
    """The :class:`Sample` of a request sent at ``sent`` whose tokens arrived at
    ``token_times`` (one entry per token, same clock)."""
    if len(token_times) < 2:
        raise RequestFailed(f"streamed {len(token_times)} token(s); 2 or more are timed")
    first, second, last = token_times[0], token_times[1], token_times[-1]
    return Sample(first - sent, second - sent, (last - first) / (len(token_times) - 1),
                  transfer, read_wait)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolated linearly between the
    nearest ranks (numpy's default); p50 is the median."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread_ms(seconds: Sequence[float], qs: Sequence[int] = (50, 90)
              ) -> dict[str, float] | None:
    """``{"p50": ms, "p90": ms}`` (or the percentiles ``qs``) of durations in seconds;
    None for none."""
    if not seconds:
        return None
    return {f"p{q}": round(1000 * percentile(seconds, q), 3) for q in qs}


def summarize(samples: Sequence[Sample], failures: Sequence[str]) -> dict[str, Any]:
    """One target's figures at one length (milliseconds)."""
    transfers = [s.transfer for s in samples if s.transfer is not None]
    return {"requests": len(samples) + len(failures), "failed": len(failures),
            "first_error": failures[0] if failures else None,
            "ttft_ms": spread_ms([s.ttft for s in samples]),
            "tt2t_ms": spread_ms([s.tt2t for s in samples]),
            "itl_ms": spread_ms([s.itl for s in samples]),
            "transfer_ms": spread_ms(transfers),
            "read_wait_ms": spread_ms([s.read_wait for s in samples if s.read_wait is not None],
                                      (50, 99))}


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """``other``'s TTFT, TT2T and ITL over ``base``'s, p50 and p90 (``ttft_p50`` ...)."""
    found = {}
    for metric in METRICS:
        for q in ("p50", "p90"):
            if base[metric] and other[metric] and base[metric][q] > 0:
                found[f"{metric[:-3]}_{q}"] = round(other[metric][q] / base[metric][q], 4)
    return found


def verdict(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any] | None:
    """``other`` against issue 25's targets, on medians (ms): TTFT at most
    :data:`TTFT_LIMIT` x ``base``'s; TT2T at most ``base``'s plus ``other``'s transfer
    (0 without one) plus one decode step (``base``'s ITL). None: something unmeasured."""
    if not all(s[m] for s in (base, other) for m in METRICS):
        return None
    ttft, tt2t = other["ttft_ms"]["p50"], other["tt2t_ms"]["p50"]
    transfer = other["transfer_ms"]["p50"] if other["transfer_ms"] else 0.0
    ttft_limit = TTFT_LIMIT * base["ttft_ms"]["p50"]
    tt2t_parts = (base["tt2t_ms"]["p50"], transfer, base["itl_ms"]["p50"])
    tt2t_limit = sum(tt2t_parts)
    return {"ttft": {"ms": ttft, "limit_ms": round(ttft_limit, 3), "ok": ttft <= ttft_limit},
            "tt2t": {"ms": tt2t, "limit_ms": round(tt2t_limit, 3), "ok": tt2t <= tt2t_limit,
                     "one_instance_ms": tt2t_parts[0], "transfer_ms": transfer,
                     "decode_step_ms": tt2t_parts[2]}}


def length_report(length: int, summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One prompt length: every target's figures, and the others against the baseline."""
    base = summaries[BASELINE]
    return {"prompt_tokens": length, "modes": summaries,
            "vs_one": {mode: {"ratios": ratios(base, s), "verdict": verdict(base, s)}
                       for mode, s in summaries.items() if mode != BASELINE}}


# -- output (pure) ----------------------------------------------------------------------------


def _pair(spread: dict[str, float] | None) -> str:
    return f"{spread['p50']:9.1f} {spread['p90']:9.1f}" if spread else f"{'-':>9} {'-':>9}"


def _ratio(found: dict[str, float], key: str) -> str:
    return f"{found[key]:6.3f}x" if key in found else f"{'':7}"


def table_lines(report: dict[str, Any]) -> list[str]:
    """The table: a row per length and target (ms, p50 and p90; ratios of medians)."""
    c = report["config"]
    pair, ratio = f"{'p50':>9} {'p90':>9}", f"{'ratio':>7}"
    lines = [f"kvxfer bench ttft (model {c['model']}, {c['repeats']} requests per target and "
             f"length, {c['max_tokens']} tokens each; ms; ratios of medians to one instance)",
             (f"{'':25} {'time to 1st token':^19} {'':7} {'time to 2nd token':^19} {'':7} "
              f"{'inter-token':^19} {'KV transfer':^19}").rstrip(),
             f"{'tokens':>6}  {'target':<17} {pair} {ratio} {pair} {ratio} {pair} {pair}  failed"]
    for row in report["lengths"]:
        for mode, s in row["modes"].items():
            found = row["vs_one"].get(mode, {}).get("ratios", {})
            lines.append(f"{row['prompt_tokens']:>6}  {MODES[mode]:<17} {_pair(s['ttft_ms'])} "
                         f"{_ratio(found, 'ttft_p50')} {_pair(s['tt2t_ms'])} "
                         f"{_ratio(found, 'tt2t_p50')} {_pair(s['itl_ms'])} "
                         f"{_pair(s['transfer_ms'])}  {s['failed']}")
            if s["first_error"]:
                lines.append(f"{'':27}first failure: {s['first_error']}")
    return lines


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """One line per length and non-baseline target: each figure against its target."""
    lines = []
    for row in report["lengths"]:
        for mode, versus in row["vs_one"].items():
            head = f"{MODES[mode]}, {row['prompt_tokens']} tokens:"
            v = versus["verdict"]
            if v is None:
                lines.append(f"{head} not judged (requests failed)")
                continue
            t, s = v["ttft"], v["tt2t"]
            lines.append(
                f"{head} TTFT {t['ms']:.1f} ms, target <= {t['limit_ms']:.1f} ({TTFT_LIMIT}x "
                f"one instance): {'ok' if t['ok'] else 'OVER'}; TT2T {s['ms']:.1f} ms, target "
                f"<= {s['limit_ms']:.1f} (one instance {s['one_instance_ms']:.1f} + transfer "
                f"{s['transfer_ms']:.1f} + a decode step {s['decode_step_ms']:.1f}): "
                f"{'ok' if s['ok'] else 'OVER'}")
            wait = row["modes"][mode].get("read_wait_ms")
            if wait:
                lines.append(f"{'':2}decode-side overhead before the READ (lease check, claim, "
                             f"blocks): p50 {wait['p50']:.2f} ms, p99 {wait['p99']:.2f} ms")
    judged = report["lengths"][0]["vs_one"] if report["lengths"] else {}
    lines.extend(pays_line(report, mode) for mode in judged)
    return lines


def pays_from(report: dict[str, Any], mode: str) -> int | None:
    """The shortest measured prompt from which ``mode``'s median TTFT is at most one
    instance's at every longer length measured (None: at none, or not judged)."""
    found = None
    for row in sorted(report["lengths"], key=lambda r: -r["prompt_tokens"]):
        ratio = row["vs_one"][mode]["ratios"].get("ttft_p50")
        if ratio is None or ratio > 1.0:
            break
        found = row["prompt_tokens"]
    return found


def pays_line(report: dict[str, Any], mode: str) -> str:
    length = pays_from(report, mode)
    if length is None:
        return f"{MODES[mode]} is not faster than one instance at the longest prompt measured"
    return (f"{MODES[mode]} pays from {length} tokens on (median TTFT at most one instance's): "
            f"kvxfer-proxy --pd-min-tokens {length} sends shorter prompts to a decode alone")


def require_matplotlib() -> None:
    """Fail before measuring, not after, when ``--plot`` cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or install "
                         "kvxfer with its bench extra)") from None


def write_plot(report: dict[str, Any], path: str) -> None:
    """TTFT against prompt length: per target its median (solid) and p90 (dashed), and
    the TTFT target, :data:`TTFT_LIMIT` x one instance's median (dotted)."""
    require_matplotlib()
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache, once
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for mode, label in MODES.items():
        points = [(r["prompt_tokens"], r["modes"][mode]["ttft_ms"]) for r in report["lengths"]
                  if mode in r["modes"] and r["modes"][mode]["ttft_ms"]]
        x = [n for n, _ in points]
        line = axes.plot(x, [s["p50"] for _, s in points], marker="o", label=f"{label}, p50")
        axes.plot(x, [s["p90"] for _, s in points], linestyle="--",
                  color=line[0].get_color(), label=f"{label}, p90")
    base = [(r["prompt_tokens"], r["modes"][BASELINE]["ttft_ms"]) for r in report["lengths"]
            if r["modes"][BASELINE]["ttft_ms"]]
    axes.plot([n for n, _ in base], [TTFT_LIMIT * s["p50"] for _, s in base], linestyle=":",
              color="grey", label=f"target: {TTFT_LIMIT}x one instance's p50")
    axes.set(xscale="log", yscale="log", xlabel="prompt length (tokens)",
             ylabel="time to first token (ms)",
             title=f"kvxfer bench ttft: {report['config']['model']}")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.set_xticks([r["prompt_tokens"] for r in report["lengths"]])
    axes.xaxis.set_major_formatter(plain)
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.yaxis.set_major_formatter(plain)
    axes.yaxis.set_minor_formatter(plain)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- processes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where one mode's requests go, and the decode whose /metrics times its KV reads."""

    url: str
    decode: str | None = None


def num_blocks(longest: int, max_tokens: int) -> int:
    """KV blocks per sidecar: two of the longest requests at once (a prefill's lease ends
    just after its decode answered), at least ``kvxfer serve``'s default 256."""
    return max(256, 2 * math.ceil((longest + max_tokens) / BLOCK_SIZE))


def _child_env() -> dict[str, str]:
    """This environment without keys, this checkout's packages first on the path."""
    import proxy

    env = {k: v for k, v in os.environ.items() if k not in KEY_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(proxy.__file__).resolve().parent.parent),
                                         env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"  # the ready line, at once
    return env


def _argvs(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, list[str]]:
    """The command line of every process, by name (the proxy's is named "proxy")."""
    blocks = num_blocks(max(args.lengths), args.max_tokens)
    sidecars = {name: [sys.executable, "-m", "kvxfer.cli", "--log-level", "WARNING", "serve",
                       "--role", name.split("-")[0], "--model", args.model,
                       "--port", str(ports[name]), "--block-size", str(BLOCK_SIZE),
                       "--num-blocks", str(blocks), "--kv-load-failure-policy", "fail",
                       "--kv-transfer-mode", "push" if name.endswith("push") else "pull"]
                for name in SIDECARS}
    # No retry and no prefill timeout: a slow or failed request shows as it is. Every
    # proxy fronts the same prefill; pull's two share a decode.
    proxies = {proxy: [sys.executable, "-m", "proxy", "--port", str(ports[proxy]),
                       "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
                       str(ports["prefill"]), "--decoder-hosts", "127.0.0.1",
                       "--decoder-ports", str(ports[decode]), "--kv-transfer-mode", mode,
                       "--retries", "0", "--prefill-timeout", str(REQUEST_TIMEOUT_S),
                       *routing, "--health-timeout", "30", "--log-level", "warning"]
               for proxy, decode, mode, routing in (
                   ("proxy", "decode", "pull", EVERY_LENGTH),
                   ("proxy-push", "decode-push", "push", EVERY_LENGTH),
                   ("proxy-deployed", "decode", "pull", ()))}
    return {**sidecars, **proxies}


@contextmanager
def deployment(args: argparse.Namespace, log_dir: Path) -> Iterator[dict[str, Target]]:
    """The sidecars, then the proxy, ready: each mode's :class:`Target`. All are stopped
    on exit, Ctrl-C included (each runs in a session of its own: only we get the SIGINT)."""
    names = (*SIDECARS, *PROXIES)
    port = local_ports(names)
    url = {name: f"http://127.0.0.1:{port[name]}" for name in names}
    env = _child_env()
    children = {name: Child(name, argv, url[name], env, log_dir)
                for name, argv in _argvs(args, port).items()}
    with started([[children[n] for n in SIDECARS], [children[n] for n in PROXIES]]):
        yield {BASELINE: Target(url["both"]), "pd": Target(url["proxy"], url["decode"]),
               "push": Target(url["proxy-push"], url["decode-push"]),
               "deployed": Target(url["proxy-deployed"], url["decode"])}


# -- measuring --------------------------------------------------------------------------------


def _tokens(event: dict[str, Any]) -> int:
    """Tokens one SSE chunk carries: its logprobs' tokens (one a token, text or not)."""
    count = 0
    for choice in event.get("choices", ()):
        logprobs = choice.get("logprobs") or {}
        count += len(logprobs.get("tokens") or ()) or int(bool(choice.get("text")))
    return count


def stream(client: Any, url: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """POST a streamed completion: (when sent, when each token arrived), perf_counter s."""
    times: list[float] = []
    sent = time.perf_counter()
    try:
        for now, event in stream_events(client, url, body):
            if "error" in event:
                raise RequestFailed(f"{url} streamed an error: {event['error']}")
            times.extend([now] * _tokens(event))
    except BenchError as exc:
        raise RequestFailed(str(exc)) from None
    return sent, times


def measure_one(client: Any, target: Target, prompt: list[int], max_tokens: int) -> Sample:
    """One request to ``target``; its decode's KV read from /metrics around it."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    try:
        before = _metrics(client, target.decode) if target.decode else {}
        sent, times = stream(client, target.url, body)
        after = _metrics(client, target.decode) if target.decode else {}
    except httpx.HTTPError as exc:  # a process gone or stalled: this request failed
        raise RequestFailed(f"{type(exc).__name__}: {exc}") from None
    def moved(name: str) -> float | None:
        return after.get(name, 0.0) - before.get(name, 0.0) if target.decode else None

    return sample(sent, times, moved(TRANSFER_S), moved(READ_WAIT_S))


def measure_length(client: Any, targets: dict[str, Target], length: int,
                   args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--repeats`` requests per target of one length, alternating: each target's summary."""
    samples: dict[str, list[Sample]] = {mode: [] for mode in targets}
    failures: dict[str, list[str]] = {mode: [] for mode in targets}
    modes, prompt = list(targets), _prompt(length)
    for repeat in range(args.repeats):
        shift = repeat % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            try:
                samples[mode].append(measure_one(client, targets[mode], prompt,
                                                 args.max_tokens))
            except RequestFailed as exc:
                failures[mode].append(str(exc))
    return {mode: summarize(samples[mode], failures[mode]) for mode in modes}


def measure(targets: dict[str, Target], args: argparse.Namespace) -> list[dict[str, Any]]:
    """A warm-up request per target, then every length: one :func:`length_report` each."""
    import httpx

    rows = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        for mode, target in targets.items():
            try:
                measure_one(client, target, _prompt(args.lengths[0]), args.max_tokens)
            except RequestFailed as exc:
                raise BenchError(f"the warm-up request to {MODES[mode]} failed: {exc}") from None
        for length in args.lengths:
            started = time.monotonic()
            summaries = measure_length(client, targets, length, args)
            rows.append(length_report(length, summaries))
            medians = (f"{MODES[m]} {s['ttft_ms']['p50']:.1f} ms" if s["ttft_ms"] else
                       f"{MODES[m]} failed" for m, s in summaries.items())
            _progress(f"{length} tokens, median TTFT: {', '.join(medians)} "
                      f"({time.monotonic() - started:.1f} s)")
    return rows


# -- the command ------------------------------------------------------------------------------


def _progress(text: str) -> None:
    print(f"kvxfer bench ttft: {text}", file=sys.stderr, flush=True)


def check_args(args: argparse.Namespace) -> None:
    """Raise :class:`BenchError` for arguments that cannot run (the model's context
    included, read without loading its weights)."""
    if args.repeats < 1 or args.max_tokens < 2:
        raise BenchError(f"--repeats must be 1 or more (got {args.repeats}) and --max-tokens "
                         f"2 or more (got {args.max_tokens})")
    check_context(args.model, args.lengths, args.max_tokens)


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    def check() -> None:
        check_args(args)
        if args.plot:
            require_matplotlib()

    return run_checked("ttft", check, lambda _: _run(args), lambda report: _write(report, args))


def _run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvxfer-ttft-") as root:
        log_dir = Path(args.log_dir or root)
        log_dir.mkdir(parents=True, exist_ok=True)
        _progress(f"starting {', '.join(MODES.values())} with {args.model} (logs in "
                  f"{log_dir if args.log_dir else 'a temporary folder'})")
        started = time.monotonic()
        with deployment(args, log_dir) as targets:
            _progress(f"ready after {time.monotonic() - started:.1f} s; measuring "
                      f"{len(args.lengths)} lengths, {args.repeats} requests per target each")
            rows = measure(targets, args)
    config = {"model": args.model, "lengths": list(args.lengths), "repeats": args.repeats,
              "max_tokens": args.max_tokens, "block_size": BLOCK_SIZE, "baseline": BASELINE,
              "modes": MODES, "ttft_limit": TTFT_LIMIT}
    failed = sum(s["failed"] for row in rows for s in row["modes"].values())
    return {"config": config, "lengths": rows, "failed_requests": failed}


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        write_plot(report, args.plot)
        _progress(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print("\n".join(table_lines(report)))
    print("\nverdict (medians):")
    print("\n".join(f"  {line}" for line in verdict_lines(report)))
