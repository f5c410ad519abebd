"""``kvxfer demo``: a prefill sidecar, a decode sidecar and the proxy, end to end.

Sends a completion, a chat question and a streamed chat through the proxy and shows what
moved for each, from the processes' own ``/metrics``; HTTP keys are on, as deployed.

Design: docs/design/bench.md#kvxfer-demo
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HELP = "run prefill + decode sidecars behind the proxy and show requests moving between them"

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Ask:
    """One request of the demo: a completion prompt or a one-message chat."""

    text: str
    chat: bool = False
    stream: bool = False


DEFAULT_ASKS = (
    Ask("The three primary colors are"),
    Ask("What is the capital of France?", chat=True),
    Ask("In one sentence, why would anyone split prompt processing from token "
        "generation?", chat=True, stream=True),
)
STARTUP_TIMEOUT_S = 300.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a model name ({DEFAULT_MODEL}, the default, or kvxfer-tiny: "
                             "seeded noise, fast), a .gguf file or a checkpoint directory")
    parser.add_argument("--prefill-layout", default="BLHNC", help="prefill KV layout (BLHNC)")
    parser.add_argument("--decode-layout", default="LBHNC", help="decode KV layout (LBHNC)")
    parser.add_argument("--prefill-tp", type=int, default=1, help="prefill TP size (1)")
    parser.add_argument("--decode-tp", type=int, default=None,
                        help="decode TP size (default: the smallest size above 1 that splits "
                             "the model's KV heads: 3 for SmolLM2, 2 for kvxfer-tiny)")
    parser.add_argument("--port", type=int, default=0,
                        help="proxy port (default 0: a free port)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (32)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a completion prompt to send (repeatable; the last one is "
                             "streamed; default: a completion, a chat and a streamed chat)")
    parser.add_argument("--keep-running", action="store_true",
                        help="leave the deployment up after the requests, until Ctrl-C")


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path


def _new_kv_key_file() -> Path:
    """A random KV key in a new file of mode 0600 (mkstemp's); Deployment.stop removes it."""
    fd, path = tempfile.mkstemp(prefix="kvxfer-demo-kv.", suffix=".key")
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    return Path(path)


@dataclass
class Deployment:
    procs: list[Proc] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvxfer-demo.")))
    # HTTP keys: the sidecars' (which the proxy passes on) and the proxy's clients'
    sidecar_key: str = field(default_factory=lambda: f"sk-{secrets.token_urlsafe(24)}")
    proxy_key: str = field(default_factory=lambda: f"sk-{secrets.token_urlsafe(24)}")
    kv_key_file: Path = field(default_factory=_new_kv_key_file)  # signs the side channel

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KVXFER_API_KEY": self.sidecar_key,
                "KVXFER_PROXY_API_KEY": self.proxy_key,
                "KVXFER_KV_KEY_FILE": str(self.kv_key_file)}

    def start(self, name: str, argv: list[str]) -> Proc:
        """Launch ``argv``; its URL is known once it printed its ready line."""
        log = self.logs / f"{name.replace(' ', '-')}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env)
        proc = Proc(name, "", popen, log)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGINT)  # SIGTERM would drain first
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()
        self.kv_key_file.unlink(missing_ok=True)


def _port(proc: Proc) -> str:
    return proc.url.rsplit(":", 1)[1]


def _port_busy(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


READY = re.compile(r"ready: (http://\S+)")


def _wait_ready(proc: Proc, timeout: float) -> str | None:
    """Wait for the process's "... ready: URL" line (both kvxfer serve and the proxy print
    one) and set ``proc.url``; an error message if it died or never got there. Every
    process binds port 0 (unless the user chose the proxy's), so no port can be lost to
    another program between choosing and binding it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = READY.search(proc.log.read_text(errors="replace"))
        if found:
            proc.url = found[1]
            return None
        if proc.popen.poll() is not None:
            tail = proc.log.read_text(errors="replace").strip().splitlines()[-8:]
            return f"{proc.name} exited with code {proc.popen.returncode}:\n  " + \
                "\n  ".join(tail)
        time.sleep(0.1)
    return f"{proc.name} was not ready after {timeout:.0f} s (log: {proc.log})"


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _scrape(url: str, key: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5.0, headers=_bearer(key)).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def _total(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
           **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in metrics.items() if n == name and want <= set(lab))


class Snapshot:
    """Metrics of the decode sidecar and the proxy at one moment."""

    def __init__(self, decode_url: str, proxy_url: str, deployment: Deployment) -> None:
        self.decode = _scrape(decode_url, deployment.sidecar_key)
        self.proxy = _scrape(proxy_url, deployment.proxy_key)

    def moved(self, before: Snapshot) -> dict[str, float]:
        def delta(source: str, name: str, **labels: str) -> float:
            now, then = getattr(self, source), getattr(before, source)
            return _total(now, name, **labels) - _total(then, name, **labels)

        return {
            "bytes": delta("decode", "kvxfer_kv_transfer_bytes_total"),
            "descriptors": delta("decode", "kvxfer_kv_transfer_descriptors_total"),
            "transfer_s": delta("decode", "kvxfer_kv_transfer_duration_seconds_sum"),
            "prefill_s": delta("proxy", "kvxfer_proxy_upstream_latency_seconds_sum",
                               role="prefill"),
            "recomputes": delta("decode", "kvxfer_kv_recomputes_total"),
        }


def _print_moved(moved: dict[str, float], prompt_tokens: int, block_size: int,
                 ttft_s: float | None) -> None:
    blocks = math.ceil(prompt_tokens / block_size)
    rate = moved["bytes"] / moved["transfer_s"] / 1e9 if moved["transfer_s"] else 0.0
    print(f"    moved: {blocks} blocks ({prompt_tokens} prompt tokens), "
          f"{moved['bytes'] / 1024:.1f} KiB in {int(moved['descriptors'])} descriptors, "
          f"{moved['transfer_s'] * 1e3:.2f} ms ({rate:.2f} GB/s)")
    if moved["recomputes"]:
        print("    (the transfer failed and the decode recomputed the prompt)")
    if ttft_s is not None:  # the decode answers the prefill's token before it reads
        handover_s = max(0.0, ttft_s - moved["prefill_s"])
        print(f"    time to first token {ttft_s * 1e3:.1f} ms = prefill "
              f"{moved['prefill_s'] * 1e3:.1f} ms + hand-over to the decode "
              f"{handover_s * 1e3:.1f} ms (the KV transfer runs after it)")


def _printable(text: str) -> str:
    """The answer as one line, unprintable characters shown as a middle dot."""
    return "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)


def _send(client: Any, proxy_url: str, ask: Ask, max_tokens: int
          ) -> tuple[int, float | None]:
    """Send one request through the proxy, print the answer; (prompt tokens, TTFT)."""
    import json

    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
    if ask.chat:
        body["messages"] = [{"role": "user", "content": ask.text}]
    else:
        body["prompt"] = ask.text
    route = f"{proxy_url}/v1/{'chat/completions' if ask.chat else 'completions'}"
    print(f"\n> {'(chat) ' if ask.chat else ''}{ask.text}")
    if not ask.stream:
        answer = client.post(route, json=body)
        answer.raise_for_status()
        data = answer.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if ask.chat else choice["text"]
        print(f"< {_printable(text)}")
        return int(data["usage"]["prompt_tokens"]), None
    body.update(stream=True, stream_options={"include_usage": True})
    started, ttft, prompt_tokens = time.perf_counter(), None, 0
    print("< (streamed) ", end="", flush=True)
    with client.stream("POST", route, json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                prompt_tokens = int(chunk["usage"]["prompt_tokens"])
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") if ask.chat \
                    else choice.get("text")
                if text:
                    ttft = ttft or time.perf_counter() - started
                    print(_printable(text), end="", flush=True)
    print()
    return prompt_tokens, ttft


def _decode_tp(model: str) -> int:
    """The smallest TP size above 1 that splits ``model``'s KV heads (1 if none does)."""
    from kvxfer.engine.model_names import model_config

    heads = model_config(model).num_key_value_heads
    return next((tp for tp in range(2, heads + 1) if heads % tp == 0), 1)


def run(args: argparse.Namespace) -> int:
    import httpx

    if args.port and _port_busy(args.port):
        print(f"kvxfer demo: port {args.port} on 127.0.0.1 is busy; pick another with --port "
              f"(or --port 0 for any free port)", file=sys.stderr)
        return 2
    python = [sys.executable, "-m"]
    if args.decode_tp is None:
        try:
            args.decode_tp = _decode_tp(args.model)
        except ValueError as exc:  # an unknown name or a bad file: say so before starting
            print(f"kvxfer demo: {exc}", file=sys.stderr)
            return 2
    common = ["--model", args.model, "--host", "127.0.0.1"]
    deployment = Deployment()
    serve = [*python, "kvxfer.cli", "--log-level", "WARNING", "serve", "--port", "0", *common]
    plan: list[tuple[str, str, Any]] = [
        ("prefill sidecar", f"{args.prefill_layout}, TP {args.prefill_tp}",
         lambda: [*serve, "--role", "prefill", "--tp", str(args.prefill_tp),
                  "--kv-cache-layout", args.prefill_layout]),
        ("decode sidecar", f"{args.decode_layout}, TP {args.decode_tp}",
         lambda: [*serve, "--role", "decode", "--tp", str(args.decode_tp),
                  "--kv-cache-layout", args.decode_layout]),
        ("proxy", "round robin",
         lambda: [*python, "proxy", "--host", "127.0.0.1", "--port", str(args.port),
                  "--prefiller-hosts", "127.0.0.1",
                  "--prefiller-ports", _port(procs["prefill sidecar"]),
                  "--decoder-hosts", "127.0.0.1",
                  "--decoder-ports", _port(procs["decode sidecar"]), "--log-level", "warning"]),
    ]
    env_layout = os.environ.pop("KVXFER_KV_CACHE_LAYOUT", None)  # flags above are explicit
    procs: dict[str, Proc] = {}
    clean = False  # keep the logs unless the demo ran through or the user stopped it
    try:
        for step, (name, detail, argv) in enumerate(plan, start=1):
            started = time.monotonic()
            print(f"[{step}/3] starting {name} ({detail}) ...", end=" ", flush=True)
            procs[name] = deployment.start(name, argv())
            error = _wait_ready(procs[name], STARTUP_TIMEOUT_S)
            if error:
                print("failed")
                print(f"kvxfer demo: {error}", file=sys.stderr)
                return 1
            print(f"ready on {procs[name].url} in {time.monotonic() - started:.1f} s")
        proxy_url, decode_url = procs["proxy"].url, procs["decode sidecar"].url
        block_size = int(httpx.get(f"{decode_url}/health", timeout=5,
                                   headers=_bearer(deployment.sidecar_key)).json().get(
                                       "block_size", 16))
        asks = [Ask(p, stream=i == len(args.prompt) - 1) for i, p in enumerate(args.prompt)] \
            if args.prompt else list(DEFAULT_ASKS)
        if args.model == "kvxfer-tiny":
            print("\nThe built-in model has seeded random weights: its text is noise, but exactly "
                  "the noise a single instance produces (scripts/run_accuracy_test.sh checks "
                  "that).")
        print("\nEach answer is generated by the decode sidecar from KV it read out of the "
              "prefill sidecar; the first transfer also pays the one-time handshake.")
        with httpx.Client(timeout=300, headers=_bearer(deployment.proxy_key)) as client:
            for ask in asks:
                before = Snapshot(decode_url, proxy_url, deployment)
                tokens, ttft = _send(client, proxy_url, ask, args.max_tokens)
                _print_moved(Snapshot(decode_url, proxy_url, deployment).moved(before), tokens,
                             block_size, ttft)
        print(f"\nproxy: {proxy_url}  (try: curl -s {proxy_url}/v1/completions -H "
              f"'Authorization: Bearer {deployment.proxy_key}' -H "
              f"'content-type: application/json' -d '{{\"prompt\": \"Hi\", "
              f"\"max_tokens\": 8}}')")
        if args.keep_running:
            print("running; press Ctrl-C to stop")
            while all(p.popen.poll() is None for p in deployment.procs):
                time.sleep(0.5)
            print("a process exited; stopping", file=sys.stderr)
            return 1
        clean = True
        return 0
    except httpx.HTTPError as exc:
        print(f"\nkvxfer demo: request failed: {exc} (logs in {deployment.logs})",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; stopping", file=sys.stderr)
        clean = True
        return 130
    finally:
        if env_layout is not None:
            os.environ["KVXFER_KV_CACHE_LAYOUT"] = env_layout
        print("stopping the sidecars and the proxy ...", file=sys.stderr)
        deployment.stop()
        if clean:
            shutil.rmtree(deployment.logs, ignore_errors=True)
        else:
            print(f"logs kept in {deployment.logs}", file=sys.stderr)
