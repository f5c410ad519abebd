"""``kvxfer bench soak``: mixed load through the proxy while workers fail, every answer checked.

Exit status 0 only with no wrong 200, nothing past its deadline, nothing held, every worker
back and a success.

Design: docs/design/bench.md#kvxfer-bench-soak
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvxfer.bench.children import (
    STOP_TIMEOUT_S,
    Child,
    Keys,
    add_output_arguments,
    new_keys,
    started,
)
from kvxfer.bench.proxy import free_port, percentile_ms
from kvxfer.bench.serving import BenchError
from kvxfer.harness.network import UCX_ENV, Network, why_not
from kvxfer.transfer.faults import ENV as LOSS_ENV

HELP = "mixed load through the proxy under injected faults, every answer checked"

KINDS = ("kill", "stop", "term", "lease")
LINK = "link"  # with --netns: a worker's interface down for --stop-seconds, then up
WORKERS = ("prefill-0", "decode-0", "prefill-1", "decode-1")
SHORT_TTL = "prefill-1"  # the prefill with --lease-ttl; the other's leases last LONG_TTL s:
LONG_TTL = 20.0  # a lease whose decode was killed after claiming it ends in the settle
HELD = ("used_blocks", "leases", "requests_in_flight")
DRAIN_BOUND_S = 45.0  # a SIGTERMed sidecar's drain (its --drain-timeout is 30 s) and exit
EXAMPLES = 5  # wrong answers kept verbatim in the report
OK, WRONG = "ok", "wrong"  # outcomes of a 200 ("unchecked" when the reference failed)
EXPIRED = r'kvxfer_kv_leases_released_total\{reason="expired"\}'  # samples of /metrics
RECOMPUTED = "kvxfer_kv_recomputes_total"
LOSSY = {"pull": "prefill-0", "push": "decode-0"}  # loses --lose-share of its "done"s
DROPPED = r'kvxfer_kv_notifications_failed_total\{reason="dropped"\}'

PREFIX = ("You are the soak's assistant. Answer in one short sentence, keep to the facts "
          "you were given and never repeat the question. ") * 2
QUESTIONS = tuple(f"Question {i}: what comes after {7 * i}?" for i in range(8))
UNRELATED = ("Hi", "Count to five:", "Zebra", "A list of colours, then birds: " * 9,
             "0123456789 " * 30)

FLAGS = (  # (flag, type, default, help)
    ("--duration", float, 60.0, "seconds of load"),
    ("--clients", int, 3, "client threads, each sending one request after another"),
    ("--deadline", float, 30.0, "seconds a request may take, also its client timeout"),
    ("--fault-interval", float, 6.0, "seconds between fault starts (more while a fault lasts)"),
    ("--restart-pause", float, 1.0, "seconds a killed worker stays down"),
    ("--stop-seconds", float, 3.0, "seconds a stop fault lasts; a lease fault, --lease-ttl more"),
    ("--lease-ttl", float, 2.0, f"--lease-ttl of {SHORT_TTL}; lease faults let its leases expire"),
    ("--lose-share", float, 0.5, f"share of the 'done' notifications and reports prefill-0 "
                                 f"(decode-0 in push mode) loses on purpose ({LOSS_ENV}; 0: none)"),
    ("--settle-timeout", float, 30.0, "longest wait after the load for idle workers"),
    ("--seed", int, 0, "seed of the request mix"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kind, default, text in FLAGS:
        metavar = "SHARE" if flag == "--lose-share" else "SECONDS" if kind is float else "N"
        parser.add_argument(flag, type=kind, default=default, metavar=metavar,
                            help=text if default is None else f"{text} (default {default})")
    parser.add_argument("--model", default="kvxfer-tiny", help="model (default kvxfer-tiny)")
    parser.add_argument("--kv-transfer-mode", choices=("pull", "push"), default="pull",
                        help="how the KV moves: the decodes read it (pull, the default), or "
                             "reserve blocks the prefills write it into (push)")
    parser.add_argument("--netns", action="store_true",
                        help="run each worker and the proxy on a 'host' of its own (network "
                             "namespaces joined by a bridge, UCX over TCP; needs root) and "
                             f"add the {LINK!r} fault: a worker's link down for "
                             "--stop-seconds, then up")
    add_output_arguments(parser)


@contextmanager
def deployment(args: argparse.Namespace, keys: Keys, log_dir: Path
               ) -> Iterator[tuple[dict[str, Child], Network | None]]:
    """The reference, workers and proxy, ready; all stopped on exit, Ctrl-C included. With
    ``--netns`` each worker and the proxy run on a "host" of their own (the network, also
    removed on exit); the reference stays on this host's loopback."""
    import proxy

    env = {k: v for k, v in os.environ.items()
           if k not in ("KVXFER_API_KEY", "KVXFER_PROXY_API_KEY", "KVXFER_KV_KEY_FILE")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(proxy.__file__).resolve().parent.parent),
                                         env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    ports: set[int] = set()
    while len(ports) < 8:  # 6 HTTP, 2 side channels: distinct
        ports.add(free_port())
    http, side = sorted(ports)[:6], sorted(ports)[6:]
    names = ("reference", *WORKERS)
    with ExitStack() as stack:
        network = stack.enter_context(Network((*WORKERS, "proxy"))) if args.netns else None

        def host(name: str) -> tuple[list[str], str, list[str]]:  # argv prefix, address, flags
            if network is None or name == "reference":
                return [], "127.0.0.1", []
            return ["ip", "netns", "exec", network.ns(name)], network.address(name), \
                ["--host", "0.0.0.0"]

        children = {}
        for i, name in enumerate(names):
            role = "both" if name == "reference" else name.split("-")[0]
            prefix, address, listen = host(name)
            elsewhere = ["--side-channel-host", address, "--no-host-reads"] \
                if network is not None and role == "prefill" else []
            argv = [*prefix, sys.executable, "-m", "kvxfer.cli", "serve", "--role", role,
                    "--model", args.model, "--port", str(http[i]), *listen, *elsewhere,
                    "--api-key-file", keys.files["api"], "--kv-key-file", keys.files["kv"],
                    *(["--enable-prefix-caching"] if role != "both" else []),
                    *(["--kv-load-failure-policy", "recompute", "--kv-transfer-mode",
                       args.kv_transfer_mode] if role == "decode" else []),
                    *(["--side-channel-port", str(side[int(name[-1])])] if role == "prefill"
                      else []),
                    *(["--lease-ttl", str(args.lease_ttl if name == SHORT_TTL else LONG_TTL)]
                      if role == "prefill" else [])]
            extra = {**(UCX_ENV if prefix else {}),
                     **({LOSS_ENV: f"notification={args.lose_share},done={args.lose_share}"}
                        if name == LOSSY[args.kv_transfer_mode] and args.lose_share > 0 else {})}
            children[name] = Child(name, argv, f"http://{address}:{http[i]}", {**env, **extra},
                                   log_dir)
        upstream = {role: [n for n in WORKERS if n.startswith(role)]
                    for role in ("prefill", "decode")}
        prefix, address, listen = host("proxy")
        children["proxy"] = Child("proxy", [
            *prefix, sys.executable, "-m", "proxy", "--port", str(http[5]), *listen,
            "--prefiller-hosts", *(host(n)[1] for n in upstream["prefill"]),
            "--prefiller-ports", *(str(http[names.index(n)]) for n in upstream["prefill"]),
            "--decoder-hosts", *(host(n)[1] for n in upstream["decode"]),
            "--decoder-ports", *(str(http[names.index(n)]) for n in upstream["decode"]),
            "--api-key-file", keys.files["client"], "--upstream-api-key-file",
            keys.files["api"], "--prefill-timeout", "3", "--health-interval", "1",
            "--kv-transfer-mode", args.kv_transfer_mode],
            f"http://{address}:{http[5]}", env, log_dir)
        with started([[children[n] for n in names], [children["proxy"]]]):
            yield children, network


def fetch(url: str, key: str) -> str | None:
    """GET ``url`` with the bearer ``key``: the body of a 200, else None."""
    import httpx

    try:
        answer = httpx.get(url, headers={"authorization": f"Bearer {key}"}, timeout=5.0,
                           trust_env=False)
    except httpx.HTTPError:
        return None
    return answer.text if answer.status_code == 200 else None


def request_mix(rng: random.Random, model: str) -> tuple[str, str, dict[str, Any]]:
    """One request of the mix: (its kind, e.g. "chat stream n2 prefix", path, body)."""
    chat, stream, n, shared = (rng.random() < 0.5, rng.random() < 0.5,
                               rng.choice((1, 1, 2)), rng.random() < 0.6)
    system, user = (PREFIX, rng.choice(QUESTIONS)) if shared else ("", rng.choice(UNRELATED))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice((4, 8, 12)),
                            "temperature": 0, "n": n, "stream": stream}
    if chat:
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}]
    else:
        body["prompt"] = system + user
    kind = " ".join(("chat" if chat else "completion", "stream" if stream else "whole",
                     f"n{n}", "prefix" if shared else "other"))
    return kind, "/v1/chat/completions" if chat else "/v1/completions", body


def send(client: Any, url: str, body: dict[str, Any], headers: dict[str, str],
         deadline: float) -> tuple[dict[int, str] | None, str]:
    """POST ``body``: ({choice index: text}, "") for a whole 200 answer, else (None, the
    failure's class: "STATUS type", "stream type", or a transport failure's name)."""
    import httpx

    start = time.monotonic()
    try:
        with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                return None, f"{response.status_code} {_error_type(response.read())}"
            if not body["stream"]:
                return {c["index"]: _text(c) for c in json.loads(response.read())["choices"]}, ""
            texts: dict[int, str] = {}
            done = False
            for line in response.iter_lines():  # to the end: leaving early closes the stream
                if time.monotonic() - start > deadline:
                    return None, "DeadlineExceeded"
                done = done or line == "data: [DONE]"
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        return None, f"stream {event['error'].get('type')}"
                    for choice in event["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + _text(choice)
            return (texts, "") if done else (None, "IncompleteStream")
    except httpx.HTTPError as exc:  # timeouts and transport failures
        return None, type(exc).__name__
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, "MalformedAnswer"


def _text(choice: dict[str, Any]) -> str:
    """A choice's text: completion ``text``, chat ``message`` or stream ``delta`` content."""
    part = choice.get("message") or choice.get("delta") or {}
    return str(choice.get("text") or part.get("content") or "")


def _error_type(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return "(no error body)"


@dataclass(frozen=True)
class Outcome:
    """A request: kind, when sent and ended (monotonic s), :data:`OK`, :data:`WRONG` or why."""

    kind: str
    sent: float
    ended: float
    result: str


class Load:
    """The client threads' shared state: outcomes, reference answers, wrong examples."""

    def __init__(self, children: dict[str, Child], keys: Keys, args: argparse.Namespace,
                 t0: float) -> None:
        self.proxy, self.reference = children["proxy"].url, children["reference"].url
        self.keys, self.args, self.t0 = keys, args, t0
        self.outcomes: list[Outcome] = []
        self.wrong: list[dict[str, Any]] = []
        self.references: dict[str, dict[int, str]] = {}
        self.stop = threading.Event()

    def client(self, number: int) -> None:
        """One client thread's loop, until :attr:`stop`."""
        import httpx

        rng = random.Random(self.args.seed * 1000 + number)
        with httpx.Client(timeout=self.args.deadline, trust_env=False) as client:
            counter = itertools.count()
            while not self.stop.is_set():
                self.outcomes.append(self._one(client, rng, f"soak-{number}-{next(counter)}"))

    def _one(self, client: Any, rng: random.Random, request_id: str) -> Outcome:
        kind, path, body = request_mix(rng, self.args.model)
        headers = {"authorization": f"Bearer {self.keys.client}", "x-request-id": request_id}
        sent = time.monotonic()
        got = send(client, self.proxy + path, body, headers, self.args.deadline)
        return self._judge(client, request_id, kind, path, body, sent, *got)

    def _judge(self, client: Any, request_id: str, kind: str, path: str, body: dict[str, Any],
               sent: float, texts: dict[int, str] | None, failure: str) -> Outcome:
        """The outcome of a request answered just now: ``texts`` checked, or ``failure``."""
        ended = time.monotonic()
        if texts is None:
            return Outcome(kind, sent, ended, failure)
        expected = self._expected(client, path, body)
        result = "unchecked" if expected is None else OK if texts == expected else WRONG
        if result == WRONG and len(self.wrong) < EXAMPLES:
            self.wrong.append({"request_id": request_id, "kind": kind, "path": path,
                               "sent_s": round(sent - self.t0, 3), "body": body,
                               "expected": expected, "got": texts})
        return Outcome(kind, sent, ended, result)

    def probe(self, prefill: str, decode: str, number: int) -> None:
        """A request sure to meet an expired lease: prefilled at ``prefill`` (short TTL),
        sent to the stopped ``decode`` on a connection of its own, checked as any other
        (kind "probe")."""
        import httpx

        from proxy.contract import decode_request, prefill_request

        body = {"model": self.args.model, "prompt": f"Probe {number}, " * 12, "max_tokens": 8,
                "temperature": 0, "stream": False}
        headers = {"authorization": f"Bearer {self.keys.sidecar}"}
        with httpx.Client(timeout=self.args.deadline, trust_env=False) as client:
            sent = time.monotonic()
            try:
                params = client.post(f"{prefill}/v1/completions", json=prefill_request(body),
                                     headers=headers).json()["kv_transfer_params"]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                got: tuple[dict[int, str] | None, str] = (None, f"prefill {type(exc).__name__}")
            else:
                got = send(client, f"{decode}/v1/completions", decode_request(body, params),
                           headers, self.args.deadline)
            self.outcomes.append(self._judge(client, f"probe-{number}", "probe",
                                             "/v1/completions", body, sent, *got))

    def _expected(self, client: Any, path: str, body: dict[str, Any]) -> dict[int, str] | None:
        """The reference's answer to ``body``: asked once per body (3 tries; None: all failed)."""
        key = path + json.dumps(body, sort_keys=True)
        headers = {"authorization": f"Bearer {self.keys.sidecar}"}
        for _ in range(3 if key not in self.references else 0):
            texts, _ = send(client, self.reference + path, body, headers, self.args.deadline)
            if texts is not None:
                self.references[key] = texts
                break
        return self.references.get(key)

    def recovery(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the end of the first right answer sent after it."""
        ends = [o.ended for o in list(self.outcomes) if o.sent >= moment and o.result == OK]
        return min(ends) - moment if ends else None


def schedule(number: int, kinds: tuple[str, ...] = KINDS) -> tuple[str, str]:
    """Fault ``number``: ``kinds`` in turn, each on the next worker every round (lease: a
    decode)."""
    kind, turn = kinds[number % len(kinds)], number // len(kinds)
    if kind == "lease":
        return kind, ("decode-1", "decode-0")[turn % 2]
    return kind, WORKERS[(kinds.index(kind) + turn) % len(WORKERS)]


@dataclass
class Fault:
    """One injected fault; times in seconds since the load began."""

    kind: str
    target: str
    pid: int
    began_s: float
    ended_s: float = 0.0
    note: str = ""


class Faults:
    """The fault thread: injects :func:`schedule`'s faults until the run's last interval."""

    def __init__(self, children: dict[str, Child], load: Load,
                 network: Network | None = None) -> None:
        self.children, self.load, self.keys, self.args = children, load, load.keys, load.args
        self.network = network  # --netns: link faults too
        self.kinds = KINDS if network is None else (*KINDS, LINK)
        self.t0 = load.t0
        self.done: list[Fault] = []
        self.lossy = LOSSY[self.args.kv_transfer_mode]
        self.lost = 0.0  # notifications it lost, summed over its runs (see count_lost)
        self.error: BaseException | None = None
        self.abort = threading.Event()

    def run(self) -> None:
        interval = self.args.fault_interval
        next_at, until = self.t0 + interval, self.t0 + self.args.duration - interval
        try:
            while next_at <= until and not self.abort.wait(max(0.0, next_at - time.monotonic())):
                self.inject(*schedule(len(self.done), self.kinds))
                next_at = max(next_at + interval, time.monotonic() + 1.0)
        except BaseException as exc:  # the main thread raises it again
            self.error = exc

    def inject(self, kind: str, name: str) -> None:
        child = self.children[name]
        fault = Fault(kind, name, child.process.pid, time.monotonic() - self.t0)
        if kind in ("kill", "term"):
            if name == self.lossy:  # its counters start again at 0
                self.count_lost()
            child.process.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
            fault.note = child.wait_exit(STOP_TIMEOUT_S if kind == "kill" else DRAIN_BOUND_S)
            self.abort.wait(self.args.restart_pause if kind == "kill" else 0)
            child.start()
            child.wait_ready()
            fault.note += f"; restarted as pid {child.process.pid}"
            fault.ended_s = time.monotonic() - self.t0
        elif kind == LINK:
            fault.note = self._cut(name)
            fault.ended_s = time.monotonic() - self.t0
        else:
            fault.note = self._stop(fault, child)
        self.done.append(fault)
        print(f"soak {fault.began_s:6.1f} s  fault {len(self.done)}: {kind} {name} (pid "
              f"{fault.pid}): {fault.note}; back after {fault.ended_s - fault.began_s:.1f} s",
              file=sys.stderr)

    def _cut(self, name: str) -> str:
        """Take ``name``'s interface down for --stop-seconds (the cable pulled), then up."""
        assert self.network is not None
        self.network.link(name, up=False)
        try:
            self.abort.wait(self.args.stop_seconds)
        finally:
            self.network.link(name, up=True)
        return f"link down {self.args.stop_seconds:g} s"

    def _stop(self, fault: Fault, child: Child) -> str:
        """SIGSTOP, SIGCONT; a lease fault also sends :meth:`Load.probe` and, once it is
        answered, counts the leases the short-TTL prefill let expire and the recomputes."""
        lease = fault.kind == "lease"
        seconds = self.args.stop_seconds + (self.args.lease_ttl if lease else 0)
        before = [self._count(SHORT_TTL, EXPIRED), self._count(child.name, RECOMPUTED)]
        probe = threading.Thread(target=self.load.probe, daemon=True, args=(
            self.children[SHORT_TTL].url, child.url, len(self.done)))
        child.process.send_signal(signal.SIGSTOP)
        if lease:
            probe.start()
        self.abort.wait(seconds)
        child.process.send_signal(signal.SIGCONT)
        fault.ended_s = time.monotonic() - self.t0
        if not lease:
            return f"stopped {seconds:g} s"
        probe.join(self.args.deadline)
        expired = self._count(SHORT_TTL, EXPIRED) - before[0]
        recomputed = self._count(child.name, RECOMPUTED) - before[1]
        return (f"stopped {seconds:g} s; {expired:g} leases expired at {SHORT_TTL}, "
                f"{child.name} recomputed {recomputed:g} prompts")

    def count_lost(self) -> None:
        """Add what the lossy worker's run lost to :attr:`lost` (before it ends; at the end)."""
        self.lost += self._count(self.lossy, DROPPED)

    def _count(self, name: str, sample: str) -> float:
        """A counter of worker ``name``'s /metrics, since it started (0: unreadable)."""
        text = fetch(f"{self.children[name].url}/metrics", self.keys.sidecar) or ""
        found = re.search(rf"^{sample} (\S+)$", text, re.MULTILINE)
        return float(found[1]) if found else 0.0


def _poll(deadline: float, check: Callable[[], bool]) -> bool:
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def settle(children: dict[str, Child], keys: Keys, timeout: float
           ) -> tuple[bool, dict[str, dict[str, int] | None]]:
    """Wait until the proxy has every instance healthy, then until every worker is idle,
    both within ``timeout``: (all back, what each worker holds then; None: no answer)."""
    deadline = time.monotonic() + timeout
    held: dict[str, dict[str, int] | None] = {}

    def health(name: str) -> dict[str, Any] | None:
        text = fetch(f"{children[name].url}/health",
                     keys.client if name == "proxy" else keys.sidecar)
        return None if text is None else dict(json.loads(text))

    def back() -> bool:
        seen = health("proxy")
        return seen is not None and all(i["healthy"] for i in seen["instances"])

    def idle() -> bool:
        for name in WORKERS:
            seen = health(name)
            held[name] = None if seen is None else {k: int(seen[k]) for k in HELD}
        return all(h is not None and not any(h.values()) for h in held.values())

    all_back = _poll(deadline, back)
    _poll(deadline, idle)
    return all_back, held


def report(load: Load, faults: Faults, all_back: bool, held: dict[str, dict[str, int] | None],
           recovery: float | None, args: argparse.Namespace) -> dict[str, Any]:
    outcomes = list(load.outcomes)
    results = Counter(o.result for o in outcomes)
    successes = results[OK]
    latencies = [o.ended - o.sent for o in outcomes if o.result == OK]
    totals = {k: sum(h[k] for h in held.values() if h) for k in HELD}
    by_kind = {kind: dict(Counter(o.result for o in outcomes if o.kind == kind))
               for kind in sorted({o.kind for o in outcomes})}
    past = sum(o.ended - o.sent > args.deadline for o in outcomes)
    checks = {"wrong_answers": results[WRONG], "past_deadline": past,
              "held_blocks": totals["used_blocks"], "held_leases": totals["leases"],
              "held_requests": totals["requests_in_flight"],
              "workers_not_back": int(not all_back) + sum(h is None for h in held.values()),
              "no_success": int(successes == 0)}
    return {
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "requests": len(outcomes), "successes": successes,
        "success_rate": successes / len(outcomes) if outcomes else 0.0,
        "errors": dict(sorted((k, v) for k, v in results.items() if k not in (OK, WRONG))),
        "wrong_answers": results[WRONG], "wrong_examples": load.wrong, "past_deadline": past,
        "latency_ms": {"p50": percentile_ms(latencies, 50), "p99": percentile_ms(latencies, 99)},
        "faults": {kind: sum(f.kind == kind for f in faults.done) for kind in faults.kinds},
        "lost_notifications": int(faults.lost),
        "fault_log": [asdict(f) for f in faults.done],
        "recovery_s": None if recovery is None else round(recovery, 3),
        "all_back": all_back, "held": held, "held_total": totals, "by_kind": by_kind,
        "failed_checks": [k for k, v in checks.items() if v]}


def print_table(r: dict[str, Any]) -> None:
    c, latency, recovery, failed = r["config"], r["latency_ms"], r["recovery_s"], r["failed_checks"]
    held = {"total": r["held_total"], **r["held"]}
    print(f"kvxfer bench soak ({c['duration']:g} s, {c['clients']} clients, a fault every "
          f"{c['fault_interval']:g} s, deadline {c['deadline']:g} s, model {c['model']}, "
          f"{c['kv_transfer_mode']})")
    for label, value in (
            ("requests", r["requests"]),
            ("successes", f"{r['successes']} ({100 * r['success_rate']:.1f}%)"),
            ("errors", ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none"),
            ("wrong answers served as 200", r["wrong_answers"]),
            ("ended past the deadline", r["past_deadline"]),
            ("latency of successes", f"p50 {latency['p50']} ms, p99 {latency['p99']} ms"),
            ("faults", ", ".join(f"{k} {v}" for k, v in r["faults"].items())),
            ("'done' lost on purpose", f"{r['lost_notifications']} notifications at "
                                       f"{LOSSY[c['kv_transfer_mode']]}, "
                                       f"and {c['lose_share']:.0%} of its reports"),
            ("recovery after the last fault", "-" if recovery is None else f"{recovery} s"),
            ("held at the end: blocks/leases/requests", "  ".join(
                f"{name} {'/'.join(map(str, h.values())) if h else 'no answer'}"
                for name, h in held.items())),
            ("verdict", f"FAIL: {', '.join(failed)}" if failed else "pass")):
        print(f"  {label:<40} {value}")


def run(args: argparse.Namespace) -> int:
    if min(args.duration, args.deadline, args.fault_interval, args.lease_ttl,
           args.clients) <= 0 or min(args.restart_pause, args.stop_seconds) < 0:
        print("durations and --clients must be positive", file=sys.stderr)
        return 2
    if not 0 <= args.lose_share <= 1:
        print(f"--lose-share must be within 0..1, got {args.lose_share}", file=sys.stderr)
        return 2
    if args.netns and (why := why_not()) is not None:
        print(f"kvxfer bench soak --netns: {why}", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="kvxfer-soak-") as root:
            log_dir = Path(args.log_dir or root)
            log_dir.mkdir(parents=True, exist_ok=True)
            keys = new_keys(Path(root))
            with deployment(args, keys, log_dir) as (children, network):
                result = soak(children, keys, args, network)
    except BenchError as exc:
        print(f"kvxfer bench soak: {exc}", file=sys.stderr)
        return 1
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=2) + "\n")
    if not args.json:
        print_table(result)
    print(json.dumps(result, indent=2 if args.json else None))  # after a table, its last line
    return 1 if result["failed_checks"] else 0


def soak(children: dict[str, Child], keys: Keys, args: argparse.Namespace,
         network: Network | None = None) -> dict[str, Any]:
    """The load and the faults for ``--duration``, recovery, settling: the report."""
    t0 = time.monotonic()
    load = Load(children, keys, args, t0)
    faults = Faults(children, load, network)
    clients = [threading.Thread(target=load.client, args=(i,), name=f"soak-client-{i}",
                                daemon=True) for i in range(args.clients)]
    injector = threading.Thread(target=faults.run, name="soak-faults", daemon=True)
    recovery = None
    try:
        for thread in [*clients, injector]:
            thread.start()
        time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
        injector.join()
        if faults.error is not None:
            raise faults.error
        if faults.done:  # load goes on until a request sent after the last fault succeeds
            end = t0 + faults.done[-1].ended_s
            _poll(time.monotonic() + args.deadline, lambda: load.recovery(end) is not None)
            recovery = load.recovery(end)
    finally:
        load.stop.set()
        faults.abort.set()
    for thread in clients:  # each ends within its request's deadline (not after Ctrl-C)
        thread.join(args.deadline + 5.0)
    all_back, held = settle(children, keys, args.settle_timeout)
    faults.count_lost()
    return report(load, faults, all_back, held, recovery, args)
