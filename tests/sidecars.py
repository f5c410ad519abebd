"""Real ``kvxfer serve`` processes for tests: launch, wait until ready, talk, stop.

Used by the server, proxy and accuracy tests. Pairs are driven with the proxy's
own contract functions, so a test sends exactly what the proxy would. Every
sidecar is a separate OS process on 127.0.0.1 that binds port 0 for HTTP and for
its side channel; its address comes from the "... ready: URL" line it prints once
it serves (so no port chosen in advance can be lost to another program). Output
goes to a log file whose tail is shown when a sidecar fails to start.
:class:`ProxyProcess` launches ``python -m proxy`` in front of sidecars the same way.
``python -m`` commands are forked from a server that imported torch and the HTTP stack
once (:mod:`kvxfer.harness.preloaded`), unless ``fresh`` asks for a new interpreter (the
tests of the command line itself do).

Typical use, with a fixture that always stops what it started::

    @pytest.fixture(scope="module")
    def pair(tmp_path_factory):
        with SidecarGroup(tmp_path_factory.mktemp("pair")) as group:
            yield group.start([Spec("prefill"), Spec("decode", policy="fail")])
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.harness.network import Network, in_ns
from kvxfer.harness.preloaded import PreloadedProcess
from proxy.contract import decode_request, parse_prefill_answer, prefill_request

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0   # two busy cores and several sidecars importing torch at once
STOP_TIMEOUT_S = 20.0


def bearer(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header that carries ``api_key`` (none without a key)."""
    return {} if api_key is None else {"authorization": f"Bearer {api_key}"}


def write_key(path: Path) -> Path:
    """A fresh KV key file at ``path``, readable by its owner only (as kvxfer wants it)."""
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def new_api_key() -> str:
    """A random HTTP API key, as a deployment would generate one."""
    return f"sk-{secrets.token_urlsafe(24)}"


def free_port() -> int:
    """A TCP port nothing listens on right now (the caller may still lose a race)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Spec:
    """How to launch one sidecar; ``extra`` are further ``kvxfer serve`` flags."""

    role: str = "both"
    layout: str = "LBHNC"
    tp: int = 1
    policy: str = "recompute"
    num_blocks: int = 256
    block_size: int = 16
    extra: tuple[str, ...] = ()
    api_key: str | None = None  # --api-key; the test's client then sends it on every call

    def argv(self) -> list[str]:
        key = ["--api-key", self.api_key] if self.api_key is not None else []
        return [sys.executable, "-m", "kvxfer.cli", "serve", "--role", self.role,
                "--port", "0", "--side-channel-port", "0", "--tp", str(self.tp),
                "--kv-cache-layout", self.layout, "--num-blocks", str(self.num_blocks),
                "--block-size", str(self.block_size),
                "--kv-load-failure-policy", self.policy, *key, *self.extra]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.layout}-tp{self.tp}-{self.policy}"


class Launched:
    """A launched server process that prints "... ready: URL" once it serves.

    ``argv`` must make it bind port 0; :meth:`wait_ready` reads the URL from the
    log. A client for its HTTP API is ``client``; :meth:`stop` ends it. An
    ``argv`` of ``python -m MODULE ...`` is forked preloaded unless ``fresh``.
    """

    READY = re.compile(r"ready: (http://\S+)")

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path,
                 env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, fresh: bool = False) -> None:
        self.name = name
        self.url = ""
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        self.client = httpx.Client(timeout=60.0, trust_env=False, headers=headers)
        environ = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.process: subprocess.Popen[bytes] | PreloadedProcess | None
        if not fresh and list(argv[:2]) == [sys.executable, "-m"]:
            self.log_path.touch()  # the child opens it to append, perhaps after we read it
            self.process = PreloadedProcess(argv[2], argv[3:], environ, ROOT, self.log_path)
            return
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                list(argv), cwd=ROOT, env=environ,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def port(self) -> int:
        assert self.url, f"{self.name} is not ready yet"
        return int(self.url.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, deadline: float) -> None:
        """Wait for the ready line (sets ``url``); fails at once if the process exits."""
        assert self.process is not None
        while time.monotonic() < deadline:
            found = self.READY.search(self.log_path.read_text(errors="replace"))
            if found:
                self.url = found[1]
                return
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"{self.name} exited with {code} while starting:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready within the deadline:\n{self.log_tail()}")

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.client.post(f"{self.url}{path}", json=body, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.client.get(f"{self.url}{path}", **kw)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics as {(name, sorted labels): value}."""
        text = self.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value (0.0 when absent)."""
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    STOP_SIGNAL: int = signal.SIGTERM

    def send_signal(self, sig: int | None = None) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(self.STOP_SIGNAL if sig is None else sig)

    def stop(self, sig: int | None = None) -> int | None:
        """Signal the process (default :attr:`STOP_SIGNAL`), wait, kill it if it hangs;
        its exit code."""
        if self.process is None:
            return None
        self.send_signal(sig)
        try:
            code = self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(STOP_TIMEOUT_S)
        self.client.close()
        return code

    def kill(self) -> None:
        """SIGKILL: the process vanishes without cleaning up (a crashed instance)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)


class Sidecar(Launched):
    """A launched ``kvxfer serve`` process and a client for its HTTP API."""

    # SIGTERM drains (several seconds); tests of draining send it explicitly
    STOP_SIGNAL = signal.SIGINT

    def __init__(self, spec: Spec, log_dir: Path, env: dict[str, str] | None = None,
                 fresh: bool = False) -> None:
        super().__init__(spec.name, spec.argv(), log_dir, env, bearer(spec.api_key), fresh)
        self.spec = spec

    def health(self) -> dict[str, Any]:
        response = self.get("/health")
        assert response.status_code == 200, f"{self.spec.name} /health: {response.text}"
        return dict(response.json())

    def wait_for(self, what: str, check: Any, timeout: float = 20.0) -> dict[str, Any]:
        """Poll /health until ``check(health)`` is true; AssertionError names ``what``."""
        health: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = self.health()
            if check(health):
                return health
            time.sleep(0.05)
        raise AssertionError(f"{self.spec.name}: {what} not reached within {timeout} s; "
                             f"last /health: {health}")


class SidecarGroup:
    """Sidecars started together and always stopped together (a context manager);
    ``fresh``: each in a new interpreter (see :class:`Launched`)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None,
                 fresh: bool = False) -> None:
        self.log_dir = log_dir
        self.env = env
        self.fresh = fresh
        self.sidecars: list[Sidecar] = []

    def start(self, specs: Sequence[Spec], timeout: float = READY_TIMEOUT_S) -> list[Sidecar]:
        """Launch all ``specs`` at once, then wait until every one is healthy."""
        return self.wait_ready(self.launch(specs), timeout)

    def launch(self, specs: Sequence[Spec]) -> list[Sidecar]:
        """Launch all ``specs`` at once without waiting (then :meth:`wait_ready`)."""
        launched = [Sidecar(spec, self.log_dir, self.env, self.fresh) for spec in specs]
        self.sidecars += launched
        return launched

    @staticmethod
    def wait_ready(sidecars: list[Sidecar], timeout: float = READY_TIMEOUT_S) -> list[Sidecar]:
        """Wait until every one of ``sidecars`` (launched) serves."""
        deadline = time.monotonic() + timeout
        for sidecar in sidecars:
            sidecar.wait_ready(deadline)
        return sidecars

    def start_one(self, spec: Spec) -> Sidecar:
        return self.start([spec])[0]

    def close(self) -> None:
        for sidecar in self.sidecars:
            sidecar.send_signal()
        for sidecar in self.sidecars:
            sidecar.stop()
        self.sidecars.clear()

    def __enter__(self) -> SidecarGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@contextlib.contextmanager
def sidecars(log_dir: Path, specs: Sequence[Spec]) -> Iterator[list[Sidecar]]:
    """Start ``specs`` and stop them on exit, also when the body fails."""
    with SidecarGroup(log_dir) as group:
        yield group.start(specs)


# -- sidecars on other "hosts": network namespaces (kvxfer.harness.network) ----------------

@dataclass(frozen=True)
class NsSpec(Spec):
    """A sidecar launched inside a namespace (``ip netns exec`` execs it: same PID)."""

    netns: str = ""

    def argv(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *super().argv()]


def at(launched: Launched, address: str) -> None:
    """Point ``launched``'s client at ``address``: it printed its wildcard bind."""
    launched.url = f"http://{address}:{launched.port}"


def health_inside(network: Network, role: str, sidecar: Sidecar) -> dict[str, Any]:
    """/health asked from inside ``role``'s namespace, over its loopback (works while
    its link is down)."""
    code = ("import sys, urllib.request; print(urllib.request.urlopen("
            f"'http://127.0.0.1:{sidecar.port}/health', timeout=5).read().decode())")
    out = in_ns(network.ns(role), sys.executable, "-c", code).stdout
    return dict(json.loads(out))


# -- driving a pair the way the proxy does ------------------------------------------------

def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The proxy's prefill call: one token, not streamed, ``do_remote_decode``."""
    return prefill_request(body)


def events(response: httpx.Response) -> list[Any]:
    """The SSE ``data:`` payloads of a whole response, ``[DONE]`` as the string."""
    assert response.headers["content-type"].startswith("text/event-stream"), response.headers
    out: list[Any] = []
    for block in response.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), f"not an SSE data event: {block!r}"
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def disaggregated(prefill: Sidecar, decode: Sidecar, path: str, body: dict[str, Any],
                  request_id: str | None = None) -> tuple[httpx.Response, httpx.Response]:
    """Prefill then decode with the proxy's own contract functions (``proxy.contract``):
    (prefill answer, decode answer). The prefill's answer must pass the proxy's check."""
    headers = {"x-request-id": request_id} if request_id else {}
    first = prefill.post(path, prefill_request(body), headers=headers)
    assert first.status_code == 200, f"prefill answered {first.status_code}: {first.text}"
    params = parse_prefill_answer(first.content, prefill.url)
    second = decode.post(path, decode_request(body, params), headers=headers)
    return first, second


# -- the proxy in front of sidecars ---------------------------------------------------------

class ProxyProcess(Launched):
    """A launched ``python -m proxy`` in front of given sidecars, and a client for it.

    A separate OS process on 127.0.0.1 bound to port 0; ``extra`` are further proxy
    flags (``--health-interval`` ...). ``api_key`` is the proxy's own ``--api-key``
    (its client does not send it by default: tests choose per call, :attr:`auth`
    is the header); the sidecars' key, when they have one, is passed as
    ``--upstream-api-key`` (through the environment, as a deployment would)
    unless ``pass_key`` is false.
    Output goes to a log file whose tail is shown when the proxy fails to start.
    Call :meth:`stop`.
    """

    def __init__(self, log_dir: Path, prefills: Sequence[Sidecar], decodes: Sequence[Sidecar],
                 extra: Sequence[str] = (), api_key: str | None = None,
                 pass_key: bool = True) -> None:
        self.prefill_urls = [s.url for s in prefills]
        self.decode_urls = [s.url for s in decodes]
        self.auth = bearer(api_key)
        upstream = {s.spec.api_key for s in [*prefills, *decodes]} - {None}
        assert len(upstream) <= 1, "the sidecars behind one proxy share one key"
        env = {"KVXFER_API_KEY": upstream.pop()} if upstream and pass_key else None
        key = ["--api-key", api_key] if api_key is not None else []
        super().__init__("proxy", [
            sys.executable, "-m", "proxy", "--port", "0",
            "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", *(str(s.port) for s in prefills),
            "--decoder-hosts", "127.0.0.1", "--decoder-ports", *(str(s.port) for s in decodes),
            *key, *extra], log_dir, env)

    def wait_ready(self, deadline: float) -> None:
        """The ready line, then /health answering and naming exactly our instances."""
        super().wait_ready(deadline)
        while not self._ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"proxy at {self.url} does not list its instances:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        """/health answers 200 and lists exactly our instances (not another proxy's)."""
        try:
            response = self.client.get(f"{self.url}/health", timeout=2.0, headers=self.auth)
        except httpx.TransportError:
            return False
        if response.status_code != 200:
            return False
        urls = [i["url"] for i in response.json().get("instances", [])]
        return urls == self.prefill_urls + self.decode_urls

    def health(self) -> dict[str, Any]:
        """/health's body: 200 when every role has a healthy instance, 503 otherwise."""
        response = self.get("/health", headers=self.auth)
        assert response.status_code in (200, 503), f"proxy /health: {response.text}"
        return dict(response.json())

    def instance(self, url: str) -> dict[str, Any]:
        """One instance's state as /health reports it."""
        found = [i for i in self.health()["instances"] if i["url"] == url]
        assert len(found) == 1, f"proxy /health lists {url} {len(found)} times"
        return dict(found[0])

    def metric(self, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
        """One sample of the proxy's /metrics (0.0 when absent)."""
        response = self.get("/metrics", headers=self.auth if headers is None else headers)
        assert response.status_code == 200, f"proxy /metrics: {response.text}"
        want = tuple(sorted(labels.items()))
        return next((s.value for family in text_string_to_metric_families(response.text)
                     for s in family.samples
                     if s.name == name and tuple(sorted(s.labels.items())) == want), 0.0)


def start_proxies(proxies: Sequence[ProxyProcess], timeout: float = READY_TIMEOUT_S) -> None:
    """Wait until every one of ``proxies`` (launched already, in parallel) is ready."""
    deadline = time.monotonic() + timeout
    for proxy in proxies:
        proxy.wait_ready(deadline)


def streamed(response: httpx.Response) -> tuple[str, list[Any]]:
    """A stream's text and its chunks' logprobs, in order."""
    assert response.status_code == 200, response.text
    text, logprobs = "", []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            for choice in chunk["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if choice.get("logprobs"):
                    logprobs.append(choice["logprobs"])
    return text, logprobs
