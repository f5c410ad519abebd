"""Real processes started from an interpreter that imported torch and the HTTP stack once.

A fresh ``python -m kvxfer.cli serve`` spends most of its start importing torch,
FastAPI and uvicorn (five seconds of a busy core). Tests start a hundred such
processes, so they fork them instead from multiprocessing's fork server, which
imports those libraries once (:func:`context`). A child is still a process of its
own: its own PID, environment, working directory, signals and log file, running the
module's ``__main__`` exactly as ``python -m`` would; what it skips is only the
interpreter's start and those imports. Nothing else is preloaded (kvxfer itself,
NIXL and UCX load in the child, after its environment is set).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import multiprocessing.util  # registers its exit handler before ours (atexit runs LIFO)
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

# third-party libraries that read no setting of ours when imported and start no thread
# that a fork would lose (numpy's BLAS pool is fork-safe)
PRELOAD = ("torch", "numpy", "fastapi", "uvicorn")

_context: ForkServerContext | None = None
_started: list[BaseProcess] = []


@atexit.register  # runs before multiprocessing's own, which waits for every child
def _kill_the_rest() -> None:
    """Kill children still running when this process ends (left by a failed test)."""
    for process in _started:
        if process.exitcode is None:
            process.kill()


def context() -> ForkServerContext:
    """The fork server's context (the server starts on first use, once per process)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


def _run_module(module: str, args: Sequence[str], env: Mapping[str, str], cwd: str,
                stdout_path: str, stderr_path: str) -> None:
    """In the child: become ``python -m module args`` (``python -c args[0] args[1:]`` for
    module ``-c``) with ``env`` in ``cwd``, output (unbuffered) appended to the two paths
    (they may be one file); its ``SystemExit`` is the process's exit code."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                               write_through=True, line_buffering=True)
                              for fd in (1, 2))
    try:
        if module == "-c":  # python -c CODE ARGS
            sys.argv = ["-c", *args[1:]]
            exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs when a program ends


class PreloadedProcess:
    """``python -m module args`` (or ``-c``: ``python -c args[0] ...``) forked from the
    preloaded server, with the part of :class:`subprocess.Popen`'s interface that tests
    use (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``)."""

    def __init__(self, module: str, args: Sequence[str], env: Mapping[str, str],
                 cwd: Path, log_path: Path, stderr_path: Path | None = None) -> None:
        self._process = context().Process(
            target=_run_module, args=(module, list(args), dict(env), str(cwd), str(log_path),
                                      str(stderr_path or log_path)),
            name=f"{module} {' '.join(args)}"[:80])  # not a daemon: it may have children
        self._process.start()
        _started.append(self._process)
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        self.args = [module, *args]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(module: str, args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None,
        timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, "-m", module, *args], capture_output=True, text=True)``,
    forked preloaded (``env``: the whole environment, default this process's)."""
    with tempfile.TemporaryDirectory(prefix="preloaded-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = PreloadedProcess(module, args, dict(os.environ if env is None else env),
                                   cwd, out, err)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
            raise
        read = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
    return subprocess.CompletedProcess([module, *args], code, read[0], read[1])
