"""``kvxfer bench fleet``: two prefills and two decodes under a stream of multi-turn chats,
the same stream replayed per routing policy of the proxy and for the aggregated baseline
(four instances serving whole requests), each on fresh instances.

Each figure is also given as a ratio to round_robin's (else the first configuration's),
measured in the same run; exits 1 when any request failed.

Design: docs/design/bench.md#kvxfer-bench-fleet
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxfer.bench.children import Child, add_output_arguments, local_ports, started
from kvxfer.bench.prefix import _request as pd_request
from kvxfer.bench.serving import BenchError, _metrics, _post, check_context, run_checked
from kvxfer.bench.ttft import (
    BLOCK_SIZE,
    REQUEST_TIMEOUT_S,
    RequestFailed,
    _child_env,
    require_matplotlib,
    sample,
    spread_ms,
    stream,
)

HELP = "kv-aware routing vs round robin vs aggregated serving under multi-turn chats"


@dataclass(frozen=True)
class Setup:
    """One configuration: the proxy's ``--policy`` over 2 prefills and 2 decodes (None: 4
    ``--role both`` instances, no proxy), and whether the proxy keeps its default
    ``--pd-min-tokens`` (``split``) or takes 0 (always P/D)."""

    policy: str | None
    split: bool = False


CONFIGS = {"kv_aware": Setup("kv_aware"), "round_robin": Setup("round_robin"),
           "kv_aware+split": Setup("kv_aware", split=True), "aggregated": Setup(None)}
BASELINE = "round_robin"  # ratios are to it when it runs, else to the first configuration
# Every prompt starts with id 1 (SmolLM2's BOS; a control byte to kvxfer-tiny), then ids in
# [32, 127): below 128, valid for the byte model and any BPE vocabulary alike.
START, FIRST_ID, END_ID = 1, 32, 127
ANSWER_ID = 46  # an earlier answer, in a later turn's prompt: this id, --max-tokens times
WARM_TOKENS = 40
BELIEVED_TIMEOUT_S = 30.0
ROUTED = "kvxfer_proxy_routed_total"
QUERIES, HITS = "kvxfer_prefix_cache_queries_total", "kvxfer_prefix_cache_hits_total"
BYTES = "kvxfer_kv_transfer_bytes_total"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="kvxfer-tiny",
                        help="model of every sidecar (default kvxfer-tiny, the fast one; "
                             "smollm2-135m-instruct for real figures)")
    for flag, default, text in (
            ("--sessions", 6, "chat sessions"),
            ("--turns", 4, "turns of each session, sent one after another"),
            ("--systems", 2, "distinct system prompts; session s starts with system s mod N"),
            ("--system-tokens", 400, "tokens of each system prompt"),
            ("--user-tokens", 32, "tokens of each turn's user part"),
            ("--max-tokens", 8, "tokens of each streamed answer, 2 or more"),
            ("--concurrency", 4, "requests in flight at most"),
            ("--seed", 0, "seed of the stream's tokens and order")):
        parser.add_argument(flag, type=int, default=default, metavar="N",
                            help=f"{text} (default {default})")
    parser.add_argument("--num-blocks", type=int, metavar="N",
                        help="KV cache blocks of every instance (default: enough to cache the "
                             "whole stream beside the requests in flight; fewer puts the "
                             "caches under pressure)")
    parser.add_argument("--configs", default=",".join(CONFIGS), metavar="NAME,...",
                        help=f"configurations to run, in order (default {','.join(CONFIGS)})")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw TTFT and prefill tokens computed per configuration "
                             "(needs matplotlib)")
    add_output_arguments(parser)


# -- the stream (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Chats:
    """The stream's shape, as the arguments give it."""

    sessions: int
    turns: int
    systems: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    seed: int


@dataclass(frozen=True)
class Turn:
    """One request of the stream: turn ``turn`` (0 first) of session ``session``."""

    session: int
    turn: int
    prompt: tuple[int, ...]


def build_stream(chats: Chats) -> list[Turn]:
    """Every turn in sending order: turn-major, the sessions shuffled anew each turn (so
    that no policy gets session affinity from the order by chance). Turn k's prompt: its
    session's system prompt, then each earlier turn's user part and answer (a fixed filler
    of ``answer_tokens``, not the generated tokens: every prompt is known up front), then
    its own user part. Ids: :data:`START`, then ids drawn with ``seed``."""
    rng = random.Random(chats.seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(FIRST_ID, END_ID) for _ in range(count)]

    systems = [[START, *ids(chats.system_tokens - 1)] for _ in range(chats.systems)]
    users = [[ids(chats.user_tokens) for _ in range(chats.turns)]
             for _ in range(chats.sessions)]
    answer = [ANSWER_ID] * chats.answer_tokens

    def prompt(session: int, turn: int) -> tuple[int, ...]:
        tokens = list(systems[session % chats.systems])
        for earlier in users[session][:turn]:
            tokens += earlier + answer
        return tuple(tokens + users[session][turn])

    return [Turn(s, t, prompt(s, t)) for t in range(chats.turns)
            for s in rng.sample(range(chats.sessions), chats.sessions)]


def stream_shares(turns: Sequence[Turn], block_size: int) -> dict[str, int]:
    """What the stream's prompts share, each against the prompts sent before it:
    ``shared_tokens``, its tokens that begin an earlier prompt (the longest common prefix);
    ``cacheable_tokens``, of its ``looked_up_tokens`` (all but the last, which an engine
    always computes) those in whole blocks of that prefix: what a prefix cache shared by
    every instance, and never evicting, could hit at most; ``new_blocks``, the blocks it
    adds to such a cache (those past its shared whole blocks, a partial one included)."""
    trie: dict[int, Any] = {}
    found = dict.fromkeys(("prompts", "prompt_tokens", "shared_tokens", "looked_up_tokens",
                           "cacheable_tokens", "new_blocks"), 0)
    for turn in turns:
        node, shared, matching = trie, 0, True
        for token in turn.prompt:
            matching = matching and token in node
            shared += matching
            node = node.setdefault(token, {})
        length = len(turn.prompt)
        found["prompts"] += 1
        found["prompt_tokens"] += length
        found["shared_tokens"] += shared
        found["looked_up_tokens"] += length - 1
        found["cacheable_tokens"] += min(shared // block_size * block_size, length - 1)
        found["new_blocks"] += math.ceil(length / block_size) - shared // block_size
    return found


def num_blocks(turns: Sequence[Turn], chats: Chats, concurrency: int) -> int:
    """Blocks for one instance to cache the whole stream (:func:`stream_shares`) beside twice
    ``concurrency`` of the longest request (a prefill's lease ends after its decode read it),
    at least ``kvxfer serve``'s default 256."""
    longest = max(len(t.prompt) for t in turns) + chats.answer_tokens
    cached = stream_shares(turns, BLOCK_SIZE)["new_blocks"]
    return max(256, cached + 2 * concurrency * math.ceil(longest / BLOCK_SIZE))


# -- figures (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """A request of the stream: when it was sent, each token came (perf_counter s), or why not."""

    turn: Turn
    sent: float
    token_times: tuple[float, ...] = ()
    error: str | None = None


def figures(outcomes: Sequence[Outcome], wall_s: float, used: dict[str, dict[str, float]],
            routed: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    """One configuration's figures. ``used``: each instance's /metrics counters over the
    stream, by name (``prefill-0``, ``both-2``...); ``routed``: the proxy's requests by path
    and reason (None: no proxy). Tokens computed: prefix cache lookups less hits (a prompt's
    last token, always computed, is not looked up); a decode's are read or computed alone."""
    samples, failures = [], []
    for o in outcomes:
        try:
            if o.error is not None:
                raise RequestFailed(o.error)
            samples.append(sample(o.sent, o.token_times, None))
        except RequestFailed as exc:
            failures.append(f"session {o.turn.session} turn {o.turn.turn}: {exc}")

    def total(name: str, role: str | None = None) -> float:
        return sum(c.get(name, 0.0) for n, c in used.items()
                   if role is None or n.startswith(role))

    def uncached(role: str) -> int | None:
        if not any(n.startswith(role) for n in used):
            return None
        return round(total(QUERIES, role) - total(HITS, role))

    ttft, itl = spread_ms([s.ttft for s in samples]), spread_ms([s.itl for s in samples])
    tokens = sum(len(o.token_times) for o in outcomes if o.error is None)
    queries = total(QUERIES)
    return {
        "requests": len(outcomes), "failed": len(failures),
        "first_error": failures[0] if failures else None, "wall_s": round(wall_s, 3),
        "output_tokens": tokens,
        **{f"ttft_p{q}_ms": ttft[f"p{q}"] if ttft else None for q in (50, 90)},
        **{f"itl_p{q}_ms": itl[f"p{q}"] if itl else None for q in (50, 90)},
        "requests_per_s": round(len(samples) / wall_s, 3) if wall_s > 0 else None,
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "prefill_tokens_computed": uncached("both") if routed is None else uncached("prefill"),
        "decode_tokens_uncached": uncached("decode"),
        "kv_bytes_read": None if routed is None else round(total(BYTES, "decode")),
        "prefix_hit_rate": round(total(HITS) / queries, 4) if queries else None,
        "pd_requests": None if routed is None else round(sum(routed.get("pd", {}).values())),
        "decode_only_requests": None if routed is None
        else round(sum(routed.get("decode", {}).values())),
        "routed": routed}


ROWS = (("ttft_p50_ms", "time to first token p50 (ms)", ".1f", 1.0),
        ("ttft_p90_ms", "  p90 (ms)", ".1f", 1.0),
        ("itl_p50_ms", "inter-token latency p50 (ms)", ".2f", 1.0),
        ("itl_p90_ms", "  p90 (ms)", ".2f", 1.0),
        ("requests_per_s", "throughput (requests/s)", ".2f", 1.0),
        ("output_tokens_per_s", "  (output tokens/s)", ".1f", 1.0),
        ("prefill_tokens_computed", "prefill tokens computed", ".0f", 1.0),
        ("decode_tokens_uncached", "decodes: tokens read or computed", ".0f", 1.0),
        ("kv_bytes_read", "KV read by decodes (MiB)", ".2f", 2**-20),
        ("prefix_hit_rate", "prefix hit rate, all instances", ".1%", 1.0),
        ("pd_requests", "routed P/D (requests)", ".0f", 1.0),
        ("decode_only_requests", "routed to a decode alone", ".0f", 1.0))
FIGURES = tuple(row[0] for row in ROWS)  # each with a ratio, as the table shows it


def with_ratios(configs: dict[str, dict[str, Any]], baseline: str) -> None:
    """Each configuration's ``ratios``: every figure over ``baseline``'s (None: not both)."""
    base = configs[baseline]
    for result in configs.values():
        result["ratios"] = {f: round(result[f] / base[f], 3)
                            if result[f] is not None and base[f] else None for f in FIGURES}


def _cell(value: float | None, ratio: float | None, fmt: str, scale: float) -> str:
    text = "-" if value is None else format(scale * value, fmt)
    return f"{text:>10}" + (f" ({ratio:5.2f}x)" if ratio is not None else " " * 9)


def table_lines(report: dict[str, Any]) -> list[str]:
    c, s, configs = report["config"], report["stream"], report["configs"]
    lines = [
        f"kvxfer bench fleet: {c['model']}, fresh instances for each configuration, prefix "
        f"caching on each ({c['num_blocks']} blocks of {c['block_size']}): 2 prefills and 2 "
        f"decodes behind the proxy with its --policy (kv_aware+split keeps its default "
        f"--pd-min-tokens, the others 0: always P/D); aggregated: 4 --role both instances, "
        f"each session sent whole to one of them in turn by the client (session affinity)",
        f"stream: {c['sessions']} sessions x {c['turns']} turns = {s['prompts']} requests at "
        f"concurrency {c['concurrency']} (turn-major, sessions shuffled each turn, seed "
        f"{c['seed']}; a turn is sent once its session's previous one ended); {c['systems']} "
        f"system prompt(s) of {c['system_tokens']} tokens (session s: system s mod "
        f"{c['systems']}); {c['user_tokens']} user tokens a turn; answers of "
        f"{c['max_tokens']} tokens, greedy, held in later turns' prompts as a fixed filler "
        f"of as many tokens; prompts sent as token ids",
        f"prefix share: {s['shared_tokens'] / s['prompt_tokens']:.1%} of its "
        f"{s['prompt_tokens']} prompt tokens begin an earlier prompt; a cache of "
        f"{c['block_size']}-token blocks shared by all instances could hit at most "
        f"{s['cacheable_tokens'] / s['looked_up_tokens']:.1%} of the tokens looked up",
        f"in brackets: ratio to {report['baseline']}",
        f"{'':34}" + "".join(f"{name:>19}" for name in configs)]
    for key, label, fmt, scale in ROWS:
        lines.append(f"{label:34}" + "".join(_cell(r[key], r["ratios"][key], fmt, scale)
                                              for r in configs.values()))
    lines.append(f"{'failed requests':34}" + "".join(f"{r['failed']:>10}{'':9}"
                                                     for r in configs.values()))
    if any(r["decode_only_requests"] for r in configs.values()):
        lines.append("a prompt routed to a decode alone is computed there: among the decodes' "
                     "tokens, not the prefills'")
    return lines + [f"first failure, {name}: {r['first_error']}"
                    for name, r in configs.items() if r["first_error"]]


def write_plot(report: dict[str, Any], path: str) -> None:
    """Per configuration: TTFT p50 and p90 (bars, left), prefill tokens computed (right)."""
    require_matplotlib()
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["configs"])
    results = [report["configs"][n] for n in names]
    x = range(len(names))
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    for offset, q in ((-0.2, 50), (0.2, 90)):
        left.bar([i + offset for i in x], [r[f"ttft_p{q}_ms"] or 0 for r in results], 0.4,
                 label=f"p{q}")
    left.set(ylabel="time to first token (ms)", title="time to first token")
    left.legend()
    right.bar(list(x), [r["prefill_tokens_computed"] or 0 for r in results], 0.6,
              color="tab:green")
    right.set(ylabel="tokens", title="prefill tokens computed")
    for axes in (left, right):
        axes.set_xticks(list(x), names, rotation=15)
        axes.grid(True, axis="y", alpha=0.3)
    c = report["config"]
    figure.suptitle(f"kvxfer bench fleet: {c['model']}, {c['sessions']} sessions x "
                    f"{c['turns']} turns, concurrency {c['concurrency']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- processes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    """A configuration's URLs: its proxy's (None: aggregated), every sidecar's by name."""

    proxy: str | None
    sidecars: dict[str, str]


def sidecar_names(setup: Setup) -> list[str]:
    if setup.policy is None:
        return [f"both-{i}" for i in range(4)]
    return [f"{role}-{i}" for role in ("prefill", "decode") for i in range(2)]


def argvs(setup: Setup, model: str, blocks: int, port: dict[str, int]
          ) -> dict[str, list[str]]:
    """Every process's command line by name (the proxy's is ``proxy``)."""
    names = sidecar_names(setup)
    events = [] if setup.policy is None else ["--kv-events-port", "0"]
    found = {name: [sys.executable, "-m", "kvxfer.cli", "--log-level", "WARNING", "serve",
                    "--role", name.split("-")[0], "--model", model, "--port", str(port[name]),
                    "--block-size", str(BLOCK_SIZE), "--num-blocks", str(blocks),
                    "--kv-load-failure-policy", "fail", "--enable-prefix-caching", *events]
             for name in names}
    if setup.policy is not None:
        # no retry, no prefill timeout in the way: a slow or failed request shows as it is
        found["proxy"] = [
            sys.executable, "-m", "proxy", "--port", str(port["proxy"]),
            "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
            *(str(port[n]) for n in names if n.startswith("prefill")),
            "--decoder-hosts", "127.0.0.1", "--decoder-ports",
            *(str(port[n]) for n in names if n.startswith("decode")),
            "--policy", setup.policy, "--retries", "0",
            "--prefill-timeout", str(REQUEST_TIMEOUT_S), "--health-timeout", "30",
            *(() if setup.split else ("--pd-min-tokens", "0")), "--log-level", "warning"]
    return found


@contextmanager
def deployment(setup: Setup, model: str, blocks: int, log_dir: Path) -> Iterator[Fleet]:
    """The sidecars (in parallel), then the proxy, ready; all stopped on exit, Ctrl-C
    included (each runs in a session of its own: only we get the SIGINT)."""
    names = [*sidecar_names(setup), *(() if setup.policy is None else ("proxy",))]
    port = local_ports(names)
    url = {name: f"http://127.0.0.1:{port[name]}" for name in names}
    env = _child_env()
    children = {name: Child(name, argv, url[name], env, log_dir)
                for name, argv in argvs(setup, model, blocks, port).items()}
    sidecars = [children[n] for n in sidecar_names(setup)]
    with started([sidecars, [children[n] for n in children if n == "proxy"]]):
        try:
            yield Fleet(url.get("proxy"), {n: url[n] for n in sidecar_names(setup)})
        finally:  # all at once: each takes seconds to exit; ``started`` finds them gone
            with ThreadPoolExecutor(len(children)) as pool:
                list(pool.map(Child.stop, children.values()))


def wait_believed(client: Any, fleet: Fleet) -> None:
    """Until the proxy's /health says it believes every sidecar's KV event stream."""
    deadline = time.monotonic() + BELIEVED_TIMEOUT_S
    while True:
        health = client.get(f"{fleet.proxy}/health").json()
        believed = {i["url"] for i in health.get("instances", ())
                    if (i.get("kv_events") or {}).get("believed")}
        if believed >= set(fleet.sidecars.values()):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"the proxy believes the KV event streams of only "
                             f"{sorted(believed)} after {BELIEVED_TIMEOUT_S:g} s")
        time.sleep(0.1)


def warm_up(client: Any, fleet: Fleet) -> None:
    """One request per prefill/decode pair (it pays their handshake), or per ``both``
    instance, of tokens that share no block with the stream's."""
    def prompt(i: int) -> list[int]:
        return [START] + [FIRST_ID + (11 * j + 7 * i + 5) % (END_ID - FIRST_ID)
                        for j in range(WARM_TOKENS)]

    names = list(fleet.sidecars)
    if fleet.proxy is None:
        for i, name in enumerate(names):
            _post(client, f"{fleet.sidecars[name]}/v1/completions",
                  {"prompt": prompt(i), "max_tokens": 2, "temperature": 0})
        return
    pairs = [(p, d) for p in names if p.startswith("prefill")
             for d in names if d.startswith("decode")]
    for i, (p, d) in enumerate(pairs):
        pd_request(client, {"prefill": fleet.sidecars[p], "decode": fleet.sidecars[d]},
                   prompt(i))


def routed_counts(client: Any, proxy_url: str) -> dict[str, dict[str, float]]:
    """The proxy's ``kvxfer_proxy_routed_total``: requests by path, then reason."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(client.get(f"{proxy_url}/metrics").text):
        for s in family.samples:
            if s.name == ROUTED:
                found.setdefault(s.labels["path"], {})[s.labels["reason"]] = s.value
    return found


# -- measuring --------------------------------------------------------------------------------


def replay(turns: Sequence[Turn], send: Callable[[Turn], tuple[float, list[float]]],
           concurrency: int, done: Callable[[int], None]) -> tuple[list[Outcome], float]:
    """Send ``turns`` in their order, ``concurrency`` at most in flight, each once its
    session's previous turn ended: every outcome, and the seconds from the first sent to
    the last ended. ``done(n)`` after the n-th ended. Threads are daemons: on Ctrl-C the
    caller stops the servers and the requests in flight fail."""
    slots = threading.Semaphore(concurrency)
    ended = {(t.session, t.turn): threading.Event() for t in turns}
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def one(turn: Turn) -> None:
        try:
            sent, times = send(turn)
            outcome = Outcome(turn, sent, tuple(times))
        except Exception as exc:  # every failure, whatever its type, is the outcome
            outcome = Outcome(turn, time.perf_counter(), (), f"{type(exc).__name__}: {exc}")
        with lock:
            outcomes.append(outcome)
            count = len(outcomes)
        ended[turn.session, turn.turn].set()
        slots.release()
        done(count)

    start = time.perf_counter()
    threads = []
    for turn in turns:
        if turn.turn:
            ended[turn.session, turn.turn - 1].wait()
        slots.acquire()
        threads.append(threading.Thread(target=one, args=(turn,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return outcomes, time.perf_counter() - start


def sender(client: Any, fleet: Fleet, max_tokens: int
           ) -> Callable[[Turn], tuple[float, list[float]]]:
    """How a turn is sent: to the proxy, or (aggregated) to ``both`` instance session mod 4."""
    import httpx

    boths = list(fleet.sidecars.values())

    def send(turn: Turn) -> tuple[float, list[float]]:
        url = fleet.proxy or boths[turn.session % len(boths)]
        body = {"prompt": list(turn.prompt), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}
        try:
            return stream(client, url, body)
        except httpx.HTTPError as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None

    return send


def run_config(name: str, turns: Sequence[Turn], args: argparse.Namespace,
               log_dir: Path) -> dict[str, Any]:
    """One configuration on fresh instances: warm-up, the stream, its figures."""
    import httpx

    setup, total = CONFIGS[name], len(turns)
    marks = {max(1, round(total * q / 4)) for q in (1, 2, 3)}
    log_dir.mkdir(parents=True, exist_ok=True)
    _progress(f"{name}: starting {4 + (setup.policy is not None)} processes")
    begun = time.monotonic()
    with deployment(setup, args.model, args.num_blocks, log_dir) as fleet, \
            httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        if setup.policy == "kv_aware":
            wait_believed(client, fleet)
        warm_up(client, fleet)
        _progress(f"{name}: ready and warm after {time.monotonic() - begun:.1f} s; sending "
                  f"{total} requests")
        before = {n: _metrics(client, url) for n, url in fleet.sidecars.items()}
        outcomes, wall = replay(
            turns, sender(client, fleet, args.max_tokens), args.concurrency,
            lambda n: _progress(f"{name}: {n}/{total} answered") if n in marks else None)
        after = {n: _metrics(client, url) for n, url in fleet.sidecars.items()}
        routed = None if fleet.proxy is None else routed_counts(client, fleet.proxy)
    used = {n: {k: after[n].get(k, 0.0) - before[n].get(k, 0.0) for k in (QUERIES, HITS, BYTES)}
            for n in after}
    result = figures(outcomes, wall, used, routed)
    _progress(f"{name}: {total} requests in {wall:.1f} s, TTFT p50 {result['ttft_p50_ms']} ms, "
              f"{result['prefill_tokens_computed']} prefill tokens computed, "
              f"{result['failed']} failed")
    return result


# -- the command ------------------------------------------------------------------------------


def _progress(text: str) -> None:
    print(f"kvxfer bench fleet: {text}", file=sys.stderr, flush=True)


def check_args(args: argparse.Namespace) -> list[Turn]:
    """The stream; :class:`BenchError` for arguments that cannot run (the model's context
    included, read without loading its weights). Sets ``configs`` and ``num_blocks``."""
    small = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in
             ("sessions", "turns", "systems", "system_tokens", "user_tokens", "concurrency")
             if getattr(args, n) < 1]
    if small or args.max_tokens < 2:
        raise BenchError(f"must be 1 or more (--max-tokens 2 or more): "
                         f"{', '.join(small) or f'--max-tokens {args.max_tokens}'}")
    if args.systems > args.sessions:
        raise BenchError(f"--systems {args.systems} is more than --sessions {args.sessions}")
    names = list(dict.fromkeys(n.strip() for n in args.configs.split(",") if n.strip()))
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise BenchError(f"--configs: unknown {', '.join(unknown) or 'none given'} (choose "
                         f"from {', '.join(CONFIGS)})")
    args.configs = names
    shape = Chats(args.sessions, args.turns, args.systems, args.system_tokens,
                  args.user_tokens, args.max_tokens, args.seed)
    turns = build_stream(shape)
    check_context(args.model, [max(len(t.prompt) for t in turns)], args.max_tokens)
    args.num_blocks = args.num_blocks or num_blocks(turns, shape, args.concurrency)
    if args.plot:
        require_matplotlib()
    return turns


def measure(turns: list[Turn], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvxfer-fleet-") as root:
        log_root = Path(args.log_dir or root).resolve()
        configs = {name: run_config(name, turns, args, log_root / name) for name in args.configs}
    baseline = BASELINE if BASELINE in configs else args.configs[0]
    with_ratios(configs, baseline)
    config = {name: getattr(args, name) for name in (
        "model", "sessions", "turns", "systems", "system_tokens", "user_tokens", "max_tokens",
        "concurrency", "seed", "num_blocks", "configs")} | {"block_size": BLOCK_SIZE}
    return {"config": config, "stream": stream_shares(turns, BLOCK_SIZE), "baseline": baseline,
            "configs": configs, "failed_requests": sum(r["failed"] for r in configs.values())}


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    def report(measured: dict[str, Any]) -> None:
        if args.json_file:
            Path(args.json_file).write_text(json.dumps(measured, indent=2) + "\n")
        if args.plot:
            write_plot(measured, args.plot)
            _progress(f"plot written to {args.plot}")
        print(json.dumps(measured, indent=2) if args.json else "\n".join(table_lines(measured)))

    return run_checked("fleet", lambda: check_args(args), lambda turns: measure(turns, args),
                       report)
