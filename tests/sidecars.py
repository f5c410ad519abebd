"""Real ``kvxfer serve`` processes for tests: launch, wait for /health, talk, stop.

Used by the server, proxy and accuracy tests. Pairs are driven with the proxy's
own contract functions, so a test sends exactly what the proxy would. Every sidecar is a separate OS
process on 127.0.0.1 with a free HTTP port chosen at launch (a port taken in
the meantime by someone else is retried on another one) and its side channel
on port 0 (the listener picks). Output goes to a log file whose tail is shown
when a sidecar fails to start. :class:`ProxyProcess` launches ``python -m proxy``
in front of sidecars the same way.

Typical use, with a fixture that always stops what it started::

    @pytest.fixture(scope="module")
    def pair(tmp_path_factory):
        with SidecarGroup(tmp_path_factory.mktemp("pair")) as group:
            yield group.start([Spec("prefill"), Spec("decode", policy="fail")])
"""

from __future__ import annotations

import contextlib
import os
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

from proxy.contract import decode_request, parse_prefill_answer, prefill_request

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0   # two busy cores and several sidecars importing torch at once
STOP_TIMEOUT_S = 20.0
PORT_ATTEMPTS = 3


def free_port() -> int:
    """A TCP port nothing listens on right now (the caller may still lose a race)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def distinct_ports(count: int) -> list[int]:
    """``count`` different free ports (held together while picked, so no repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


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

    def argv(self, port: int) -> list[str]:
        return [sys.executable, "-m", "kvxfer.cli", "serve", "--role", self.role,
                "--port", str(port), "--side-channel-port", "0", "--tp", str(self.tp),
                "--kv-cache-layout", self.layout, "--num-blocks", str(self.num_blocks),
                "--block-size", str(self.block_size),
                "--kv-load-failure-policy", self.policy, *self.extra]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.layout}-tp{self.tp}-{self.policy}"


class Sidecar:
    """A launched ``kvxfer serve`` process and a client for its HTTP API."""

    def __init__(self, spec: Spec, log_dir: Path, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}-{time.monotonic_ns()}.log"
        self._env = env
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(timeout=60.0, trust_env=False)
        self._launch(port)

    def _launch(self, port: int | None = None) -> None:
        self.port = port or free_port()
        env = {**os.environ, **(self._env or {}), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.spec.argv(self.port), cwd=ROOT, env=env,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        """Poll /health until 200; relaunch on another port if the port was taken."""
        assert self.process is not None
        for _ in range(PORT_ATTEMPTS):
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    break
                if self._healthy():
                    return
                time.sleep(0.1)
            else:
                raise TimeoutError(f"{self.spec.name} on port {self.port} not healthy within "
                                   f"{READY_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            if code == 2 and f"HTTP port {self.port}" in self.log_tail(5):
                self._launch()  # lost the port race: try another one
                continue
            raise RuntimeError(f"{self.spec.name} exited with {code} while starting:\n"
                               f"{self.log_tail()}")
        raise RuntimeError(f"{self.spec.name}: no free port after {PORT_ATTEMPTS} attempts")

    def _healthy(self) -> bool:
        """/health answers 200, from this process (not another that won the port)."""
        try:
            response = self.client.get(f"{self.url}/health", timeout=2.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200 and response.json().get("pid") == self.pid

    # -- talking to it ------------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.client.post(f"{self.url}{path}", json=body, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.client.get(f"{self.url}{path}", **kw)

    def health(self) -> dict[str, Any]:
        response = self.get("/health")
        assert response.status_code == 200, f"{self.spec.name} /health: {response.text}"
        return dict(response.json())

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics as {(name, sorted labels): value}."""
        text = self.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value (0.0 when absent)."""
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

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

    # -- stopping it ----------------------------------------------------------------------
    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Signal the process, wait, kill it if it hangs; its exit code."""
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


class SidecarGroup:
    """Sidecars started together and always stopped together (a context manager)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.sidecars: list[Sidecar] = []

    def start(self, specs: Sequence[Spec], timeout: float = READY_TIMEOUT_S) -> list[Sidecar]:
        """Launch all ``specs`` at once, then wait until every one is healthy."""
        started = [Sidecar(spec, self.log_dir, self.env, port)
                   for spec, port in zip(specs, distinct_ports(len(specs)), strict=True)]
        self.sidecars += started
        deadline = time.monotonic() + timeout
        for sidecar in started:
            sidecar.wait_ready(deadline)
        return started

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


# -- driving a pair the way the proxy does ------------------------------------------------

def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The proxy's prefill call: one token, not streamed, ``do_remote_decode``."""
    return prefill_request(body)


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

class ProxyProcess:
    """A launched ``python -m proxy`` in front of given sidecars, and a client for it.

    A separate OS process on 127.0.0.1 with a free port chosen at launch (relaunched
    on another one if the port was taken meanwhile); ``extra`` are further proxy
    flags (``--api-key``, ``--health-interval`` ...). Output goes to a log file
    whose tail is shown when the proxy fails to start. Call :meth:`stop`.
    """

    def __init__(self, log_dir: Path, prefills: Sequence[Sidecar], decodes: Sequence[Sidecar],
                 extra: Sequence[str] = ()) -> None:
        self.prefill_urls = [s.url for s in prefills]
        self.decode_urls = [s.url for s in decodes]
        self._flags = ["--prefiller-hosts", "127.0.0.1",
                       "--prefiller-ports", *(str(s.port) for s in prefills),
                       "--decoder-hosts", "127.0.0.1",
                       "--decoder-ports", *(str(s.port) for s in decodes), *extra]
        self.log_path = log_dir / f"proxy-{time.monotonic_ns()}.log"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(timeout=60.0, trust_env=False)
        self._launch()

    def _launch(self) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "proxy", "--port", str(self.port), *self._flags]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, deadline: float) -> None:
        """Poll /health until it answers 200 naming our instances; relaunch on a lost port."""
        assert self.process is not None
        for _ in range(PORT_ATTEMPTS):
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    break
                if self._ready():
                    return
                time.sleep(0.1)
            else:
                raise TimeoutError(f"proxy on port {self.port} not ready within the deadline:\n"
                                   f"{self.log_tail()}")
            if "address already in use" in self.log_tail().lower():
                self._launch()  # lost the port race: try another one
                continue
            raise RuntimeError(f"proxy exited with {code} while starting:\n{self.log_tail()}")
        raise RuntimeError(f"proxy: no free port after {PORT_ATTEMPTS} attempts")

    def _ready(self) -> bool:
        """/health answers 200 and lists exactly our instances (not another proxy's)."""
        try:
            response = self.client.get(f"{self.url}/health", timeout=2.0)
        except httpx.TransportError:
            return False
        if response.status_code != 200:
            return False
        urls = [i["url"] for i in response.json().get("instances", [])]
        return urls == self.prefill_urls + self.decode_urls

    # -- talking to it ------------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.client.post(f"{self.url}{path}", json=body, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.client.get(f"{self.url}{path}", **kw)

    def health(self) -> dict[str, Any]:
        """/health's body: 200 when every role has a healthy instance, 503 otherwise."""
        response = self.get("/health")
        assert response.status_code in (200, 503), f"proxy /health: {response.text}"
        return dict(response.json())

    def instance(self, url: str) -> dict[str, Any]:
        """One instance's state as /health reports it."""
        found = [i for i in self.health()["instances"] if i["url"] == url]
        assert len(found) == 1, f"proxy /health lists {url} {len(found)} times"
        return dict(found[0])

    def metric(self, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
        """One sample of the proxy's /metrics (0.0 when absent)."""
        response = self.get("/metrics", headers=headers or {})
        assert response.status_code == 200, f"proxy /metrics: {response.text}"
        want = tuple(sorted(labels.items()))
        return next((s.value for family in text_string_to_metric_families(response.text)
                     for s in family.samples
                     if s.name == name and tuple(sorted(s.labels.items())) == want), 0.0)

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL if it hangs; its exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
        try:
            code = self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(STOP_TIMEOUT_S)
        self.client.close()
        return code


def start_proxies(proxies: Sequence[ProxyProcess], timeout: float = READY_TIMEOUT_S) -> None:
    """Wait until every one of ``proxies`` (launched already, in parallel) is ready."""
    deadline = time.monotonic() + timeout
    for proxy in proxies:
        proxy.wait_ready(deadline)
