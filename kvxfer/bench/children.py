"""``Child``: one server process a benchmark starts, stops and may restart, and
:func:`started`, which brings groups of them up in order and stops them all on the way out.

Shared by the benchmarks that run real sidecars and the proxy (soak, ttft, load).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvxfer.bench.proxy import free_port, wait_healthy
from kvxfer.bench.serving import BenchError, _wait_ready

STOP_TIMEOUT_S = 20.0


class Child:
    """A process with fixed command line and ports (a restart comes back at the same address);
    each start logs to its own file, appended to (no write lands where a reader seeks). After
    :meth:`stop` nothing starts it again (a racing restart fails)."""

    def __init__(self, name: str, argv: list[str], url: str, env: dict[str, str],
                 log_dir: Path) -> None:
        self.name, self.argv, self.url, self.env, self.log_dir = name, argv, url, env, log_dir
        self.starts = 0
        self.process: subprocess.Popen[Any]  # from the first start on
        self._reader: IO[Any]
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Launch it, in a session of its own: Ctrl-C reaches only the benchmark, which
        stops it."""
        binary = self.name.startswith("proxy")  # wait_healthy reads bytes, _wait_ready text
        with self._lock:
            if self._closed:
                raise BenchError(f"{self.name} is not started again: the run is ending")
            if self.starts:
                self._reader.close()
            self.starts += 1
            path = self.log_dir / f"{self.name}.{self.starts}.log"
            with open(path, "ab") as log:
                self.process = subprocess.Popen(
                    self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)
            self._reader = open(path, "rb" if binary else "r")  # noqa: SIM115 (closed in stop)

    def wait_ready(self) -> None:
        try:
            if self.name.startswith("proxy"):  # its ready line is not a sidecar's: ask /health
                wait_healthy(self.name, self.process, self._reader, f"{self.url}/health")
            else:
                _wait_ready(self.process, self._reader, self.name)
        except RuntimeError as exc:  # wait_healthy's (BenchError is one too)
            raise BenchError(str(exc)) from None

    def wait_exit(self, timeout: float) -> str:
        """How it ended: its exit status, or killed when it outlived ``timeout``."""
        try:
            return f"exit status {self.process.wait(timeout)}"
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)
            return f"killed, still running after {timeout:g} s"

    def stop(self) -> None:
        """For good: SIGCONT (it may be stopped), then SIGINT, which ends it at once."""
        with self._lock:
            self._closed = True
        if self.starts and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGINT)
            self.wait_exit(STOP_TIMEOUT_S)
        if self.starts:
            self._reader.close()


@contextmanager
def started(groups: Iterable[Sequence[Child]]) -> Iterator[None]:
    """Start each group's children together (their models load in parallel), wait until
    all of them are ready, then the next group (the proxy once its instances are up);
    stop every child started, in reverse order, when the block ends, however it ends."""
    with ExitStack() as stack:
        for group in groups:
            for child in group:
                child.start()
                stack.callback(child.stop)
            for child in group:
                child.wait_ready()
        yield


def local_ports(names: Sequence[str]) -> dict[str, int]:
    """A distinct free loopback port for each of ``names`` (in ascending order)."""
    ports: set[int] = set()
    while len(ports) < len(names):
        ports.add(free_port())
    return dict(zip(names, sorted(ports), strict=True))


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json-file`` and ``--log-dir``, as every bench that starts processes takes them."""
    parser.add_argument("--json-file", metavar="PATH", help="also write the JSON report to PATH")
    parser.add_argument("--log-dir", metavar="DIR", help="keep every process's log in DIR "
                                                         "(default: removed at exit)")


@dataclass(frozen=True)
class Keys:
    """The sidecars' and the proxy clients' HTTP keys; files: ``api``, ``client``, ``kv``."""

    sidecar: str
    client: str
    files: dict[str, str]


def new_keys(directory: Path) -> Keys:
    """Fresh random keys, each in a new file of mode 0600 in ``directory``."""
    sidecar, client = (f"sk-{secrets.token_urlsafe(24)}" for _ in range(2))
    files = {name: str(directory / f"{name}.key") for name in ("api", "client", "kv")}
    for name, text in zip(files, (sidecar, client, secrets.token_hex(32)), strict=True):
        fd = os.open(files[name], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text + "\n")
    return Keys(sidecar, client, files)
