"""``kvxfer bench trust``: what signing costs a decode, signed and unsigned in one run.

A crossover of freshly started pairs, with a bootstrap interval for the ratio; the target is
a ratio under 1.02. Nothing is asserted.

Design: docs/design/bench.md#kvxfer-bench-trust
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from kvxfer.bench.serving import BenchError, _post, _prompt, launched, role_cpu

HELP = "decode time to first token with the kv key (signing) on vs off, in one run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=1000,
                        help="prompt length (default 1000)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="measured requests per side (default 20)")
    parser.add_argument("--model", default="kvxfer-tiny", help="model (default kvxfer-tiny)")
    parser.add_argument("--num-blocks", type=int, default=512,
                        help="KV cache blocks per sidecar (default 512)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not bind the prefills to CPU 0 and the decodes to CPU 1 "
                             "(by default both pairs get the same placement, so that it "
                             "cannot favour one)")
    parser.add_argument("--phases", type=int, default=4,
                        help="crossover phases, each with freshly started pairs, the signed "
                             "one started first on even phases (default 4; even)")
    parser.add_argument("--control", action="store_true",
                        help="A/A run: the 'signed' pair gets no key either, so the ratio "
                             "shows the noise floor between two pairs on this machine")


@contextmanager
def _sidecar(role: str, args: argparse.Namespace, key_file: str | None) -> Iterator[str]:
    argv = [sys.executable, "-m", "kvxfer.cli", "--log-level", "ERROR", "serve", "--role",
            role, "--model", args.model, "--port", "0", "--num-blocks", str(args.num_blocks),
            "--kv-load-failure-policy", "fail"]
    if key_file is not None:
        argv += ["--kv-key-file", key_file]
    env = {k: v for k, v in os.environ.items() if k != "KVXFER_KV_KEY_FILE"}
    cpu = role_cpu(role, args.pin)
    with launched(argv, f"{role} sidecar ({'signed' if key_file else 'unsigned'})",
                  env, cpu) as url:
        yield url


@contextmanager
def temporary_key_file() -> Iterator[str]:
    """A fresh random key in a 0600 file, removed on exit."""
    fd, path = tempfile.mkstemp(prefix="kvxfer-kv-", suffix=".key")
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        yield path
    finally:
        os.unlink(path)


def _phase(args: argparse.Namespace, prompt: list[int], key_file: str,
           first: tuple[str, str]) -> dict[str, list[float]]:
    """One phase: start both pairs (``first[0]``'s first), warm each up, then
    ``--repeats`` rounds alternating which pair is asked first; TTFT seconds per side."""
    import httpx

    times: dict[str, list[float]] = {"signed": [], "unsigned": []}
    with ExitStack() as stack:
        keys = {"signed": None if args.control else key_file, "unsigned": None}
        pairs = {side: {role: stack.enter_context(_sidecar(role, args, keys[side]))
                        for role in ("prefill", "decode")} for side in first}
        client = stack.enter_context(httpx.Client(timeout=600, trust_env=False))
        for pair in pairs.values():  # warm-up: handshake and NIXL connection
            _ttft(client, pair, prompt)
        for i in range(args.repeats):
            for side in first if i % 2 == 0 else first[::-1]:
                try:
                    times[side].append(_ttft(client, pairs[side], prompt))
                except BenchError as exc:
                    raise BenchError(f"{side} pair, request {i}: {exc}") from None
    return times


def _ttft(client: Any, pair: dict[str, str], prompt: list[int]) -> float:
    """Seconds from sending the decode request to the first token it computes: its
    second (the first is the prefill's, answered before the claim and the READ)."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # one chunk per token
    answer = _post(client, f"{pair['prefill']}/v1/completions",
                   {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    start = time.perf_counter()
    with client.stream("POST", f"{pair['decode']}/v1/completions",
                       json={**body, "stream": True,
                             "kv_transfer_params": answer["kv_transfer_params"]}) as response:
        if response.status_code != 200:
            raise BenchError(f"the decode answered {response.status_code}: "
                             f"{response.read()[:300]!r}")
        first, chunks = None, 0
        for line in response.iter_lines():  # to the end: the request finishes
            chunks += line.startswith("data: {")
            if first is None and chunks == 2:
                first = time.perf_counter() - start
    if first is None:
        raise BenchError("the decode streamed no token")
    return first


def crossover_ratio(rounds: list[list[float]]) -> float:
    """The geometric mean over phases of each phase's median per-round ratio."""
    return math.exp(statistics.fmean(math.log(statistics.median(r)) for r in rounds))


def bootstrap_interval(rounds: list[list[float]], resamples: int = 2000, seed: int = 0
                       ) -> tuple[float, float]:
    """95% interval of :func:`crossover_ratio`: phases resampled with replacement, then
    each chosen phase's per-round ratios (so both the pair-to-pair and the request-to-
    request spread widen it)."""
    rng = random.Random(seed)
    draws = sorted(crossover_ratio([rng.choices(phase, k=len(phase))
                                    for phase in rng.choices(rounds, k=len(rounds))])
                   for _ in range(resamples))
    return draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def _primitives() -> dict[str, float]:
    """Microseconds per call of each signing step (and its unsigned counterpart)."""
    from kvxfer.wire.compat import CompatInfo, compat_hash
    from kvxfer.wire.envelope import decode_envelope, encode_message
    from kvxfer.wire.messages import MetadataRequest
    from kvxfer.wire.notification import ReadDone, decode_notif, encode_notif
    from kvxfer.wire.replay import ReplayGuard
    from kvxfer.wire.tickets import LeaseClaims, sign_ticket, verify_ticket

    key = secrets.token_bytes(32)
    compat = CompatInfo("m", "float32", "float32", 64, 8, 32)
    claims = LeaseClaims("prefill-0123456789ab", "127.0.0.1", 5600, secrets.token_urlsafe(16),
                         tuple(range(63)), 1000, 1, time.time() + 120)
    ticket = sign_ticket(key, claims)
    done = ReadDone(claims.lease_id, "decode-0123456789ab", 0, 1, True)
    request = MetadataRequest("decode-0123456789ab", (0,))
    digest, guard = compat_hash(compat), ReplayGuard()

    def per_call(work: Any, n: int = 2000) -> float:
        start = time.perf_counter()
        for _ in range(n):
            work()
        return 1e6 * (time.perf_counter() - start) / n

    return {
        "ticket_sign_us": per_call(lambda: sign_ticket(key, claims)),
        "ticket_verify_us": per_call(lambda: verify_ticket(key, claims, ticket)),
        "message_unsigned_round_trip_us": per_call(lambda: decode_envelope(
            encode_message(request, compat=compat), expected_hash=digest, peer="p")),
        "message_signed_round_trip_us": per_call(lambda: decode_envelope(
            encode_message(request, compat=compat, hmac_key=key), expected_hash=digest,
            peer="p", hmac_key=key, replay=guard)),
        "notif_unsigned_round_trip_us": per_call(lambda: decode_notif(encode_notif(done))),
        "notif_signed_round_trip_us": per_call(
            lambda: decode_notif(encode_notif(done, key), hmac_key=key)),
    }


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if min(args.prompt_tokens, args.repeats) < 1 or args.phases < 2 or args.phases % 2:
        print("--prompt-tokens and --repeats must be >= 1 and --phases even, >= 2",
              file=sys.stderr)
        return 2
    prompt = _prompt(args.prompt_tokens)
    times: dict[str, list[float]] = {"signed": [], "unsigned": []}
    rounds: list[list[float]] = []  # per phase: signed / unsigned of each round
    try:
        with temporary_key_file() as key_file:
            for phase in range(args.phases):
                # Crossover: which pair starts first alternates, so an order effect cancels.
                first = ("signed", "unsigned") if phase % 2 == 0 else ("unsigned", "signed")
                got = _phase(args, prompt, key_file, first)
                rounds.append([a / b for a, b in zip(got["signed"], got["unsigned"],
                                                      strict=True)])
                for side in times:
                    times[side] += got[side]
    except BenchError as exc:
        print(f"kvxfer bench trust: {exc}", file=sys.stderr)
        return 1
    signed, unsigned = (statistics.median(times[s]) for s in ("signed", "unsigned"))
    ratio, phase_ratios = crossover_ratio(rounds), [statistics.median(r) for r in rounds]
    low, high = bootstrap_interval(rounds)
    result = {"config": {"model": args.model, "prompt_tokens": args.prompt_tokens,
                         "repeats": args.repeats, "phases": args.phases, "control": args.control,
                         "pinned": args.pin},
              "decode_ttft_ms_signed": 1000 * signed, "decode_ttft_ms_unsigned": 1000 * unsigned,
              "ratio_signed_to_unsigned": ratio, "ratio_interval_95": [low, high],
              "target_shown": high < 1.02, "phase_ratios": phase_ratios,
              "primitives": _primitives()}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvxfer bench trust (model={args.model}, prompt_tokens={args.prompt_tokens}, "
          f"repeats={args.repeats}{', control: both unsigned' if args.control else ''}, "
          f"medians)")
    print(f"  decode time to first token, unsigned  {1000 * unsigned:10.2f} ms")
    print(f"  decode time to first token, signed    {1000 * signed:10.2f} ms")
    print(f"  ratio signed / unsigned (crossover)   {ratio:10.4f}  (target < 1.02)")
    verdict = ("shown: the whole interval is below 1.02" if high < 1.02 else
               "not resolved here: the interval is wider than the target" if high - low > 0.02
               else "not shown: the interval reaches 1.02")
    print(f"  95% bootstrap interval                {low:10.4f} .. {high:.4f}  ({verdict})")
    print(f"  per phase (signed pair started first on even phases): "
          f"{', '.join(f'{r:.4f}' for r in phase_ratios)}")
    for name, value in result["primitives"].items():
        print(f"  {name:<36} {value:10.2f}")
    return 0
