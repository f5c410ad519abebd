"""Static checks as tests: ruff over the code and tests, mypy (strict) over the pure modules.

mypy takes a minute of one core on a fresh checkout (it analyses torch's stubs), so when
its test is selected the session starts it as soon as collection ends (``conftest.py``),
niced, beside the tests that come before this one; the test then waits for its verdict.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF_PATHS = ("kvxfer", "proxy", "tests", "tests_vllm", "dev.py", "setup.py")
MYPY_FILES = ("kvxfer/plan/layout.py", "kvxfer/plan/regions.py", "kvxfer/plan/topology.py",
              "kvxfer/plan/descriptors.py", "kvxfer/plan/pairing.py", "kvxfer/wire/tickets.py",
              "kvxfer/wire/lease_book.py", "kvxfer/net/kv_key.py", "kvxfer/net/interfaces.py",
              "kvxfer/vllm/extra_config.py",
              "kvxfer/vllm/scheduler_side.py", "kvxfer/vllm/step_plan.py",
              "kvxfer/vllm/allocation.py",
              "kvxfer/plan/staging.py",
              "kvxfer/plan/packing.py", "kvxfer/plan/pushes.py", "kvxfer/wire/reservations.py",
              "kvxfer/engine/prefix_cache.py", "kvxfer/engine/scheduler.py",
              "kvxfer/engine/block_allocator.py", "kvxfer/transfer/converted/siblings.py",
              "kvxfer/transfer/converted/shared_staging.py", "kvxfer/transfer/threads.py",
              "kvxfer/transfer/converted/stream_copy.py",
              "kvxfer/transfer/leases.py", "kvxfer/transfer/lease_client.py",
              "kvxfer/wire/version.py", "kvxfer/wire/protocol_errors.py",
              "kvxfer/wire/replay.py", "kvxfer/wire/compat.py", "kvxfer/wire/metadata.py",
              "kvxfer/wire/messages.py", "kvxfer/wire/framing.py", "kvxfer/wire/envelope.py",
              "kvxfer/wire/notification.py",
              "kvxfer/wire/params.py", "kvxfer/transfer/results.py",
              "kvxfer/transfer/reads/path.py", "kvxfer/transfer/reads/read.py",
              "kvxfer/transfer/liveness.py",
              "kvxfer/transfer/converted/process_shares.py",
              "kvxfer/transfer/transfer_config.py", "kvxfer/sidecar/request_kinds.py",
              "kvxfer/sidecar/roles/role.py",
              "kvxfer/transfer/converted/fd_handover.py")


def run_tool(module: str, paths: list[str]) -> None:
    """Run ``python -m module paths`` from the repository root; fail with its output."""
    assert paths, f"nothing for {module} to check under {ROOT.name}"
    done = subprocess.run([sys.executable, "-m", module, *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    output = f"{done.stdout}\n{done.stderr}".strip()
    assert done.returncode == 0, f"{module} {' '.join(paths)} exited {done.returncode}:\n{output}"


def existing(paths: tuple[str, ...]) -> list[str]:
    return [p for p in paths if (ROOT / p).exists()]


class Background:
    """``python -m module paths`` from the repository root, started now at low priority;
    :meth:`check` waits for it and fails with its output."""

    def __init__(self, module: str, paths: list[str]) -> None:
        assert paths, f"nothing for {module} to check under {ROOT.name}"
        self.command = f"{module} {' '.join(paths)}"
        self.output = tempfile.TemporaryFile()  # noqa: SIM115 (check closes it)
        self.process = subprocess.Popen([sys.executable, "-m", module, *paths], cwd=ROOT,
                                        stdout=self.output, stderr=subprocess.STDOUT)
        # the tests it runs beside have the cores first (unniced if it ended already)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.process.pid, 10)

    def check(self, timeout: float = 300.0) -> None:
        code = self.process.wait(timeout)
        self.output.seek(0)
        output = self.output.read().decode(errors="replace").strip()
        self.output.close()
        assert code == 0, f"{self.command} exited {code}:\n{output}"

    def stop(self) -> None:
        """End it if it still runs (its verdict no longer wanted)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.output.close()


def start_mypy() -> Background:
    return Background("mypy", existing(MYPY_FILES))


MYPY_STARTED = pytest.StashKey[Background]()


def test_ruff_clean() -> None:
    run_tool("ruff", ["check", *existing(RUFF_PATHS)])


def test_mypy_clean_on_pure_modules(request: pytest.FixtureRequest) -> None:
    started = request.config.stash.get(MYPY_STARTED, None)
    (started or start_mypy()).check()
