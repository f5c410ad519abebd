"""Shared test configuration.

Tests marked ``cuda`` run wherever ``torch.cuda.is_available()`` is true and are
skipped only where it is false.

Fixtures of the in-process role tests: ``connector``, a decode's roles over an 8-block
kvxfer-tiny engine (128 tokens), policy fail; ``make``, ``make(role, **config)`` builds
:class:`~kvxfer.sidecar.roles.composition.Roles` like it from
:class:`~kvxfer.transfer.transfer_config.TransferConfig` fields (closed after the test);
``recorder``, a side-channel listener
that records the releases it gets (``test_release.Recorder``). Transfer tests share
``prefill``, one prefill OS process per module (:class:`kvxfer.harness.loopback.PrefillProcess`).
Sidecars shared by the whole run: ``shared_servers.py``.

Torch runs one OpenMP thread in the test process and in every process it starts, unless
``OMP_NUM_THREADS`` says otherwise: the suite runs several processes on two cores, and
OpenMP's spinning threads, descheduled, made in-process model tests up to ten times
slower whenever another process wanted a core (test_engine_mla: 38-67 s with two
threads, 4 s with one, on a busy machine).

A run started as a background job of a script (``cmd &`` without job control) inherits
SIGINT ignored, and so would every process its tests start: the Ctrl-C tests' processes
would never see their SIGINT. The run takes SIGINT back (Python's handler), so that what
it starts gets the default.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is first imported

import gc
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvxfer.sidecar.roles.composition import Roles

# session-wide sidecars for the tests that only talk to them (plain, pull_pair, proxied)
pytest_plugins = ["shared_servers"]

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # see the module docstring
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start mypy now when its test is selected to run (see ``test_lint.py``)."""
    if not session.config.option.collectonly and any(
            item.nodeid.endswith("test_lint.py::test_mypy_clean_on_pure_modules")
            for item in session.items):
        from test_lint import MYPY_STARTED, start_mypy

        session.config.stash[MYPY_STARTED] = start_mypy()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A mypy started for a test that never ran (the run stopped early) is stopped."""
    lint = sys.modules.get("test_lint")
    started = session.config.stash.get(lint.MYPY_STARTED, None) if lint is not None else None
    if started is not None:
        started.stop()


@pytest.fixture(autouse=True, scope="module")
def _collect_cycles_after_each_module() -> Iterator[None]:
    """Finalize a module's reference cycles (closed workers, NIXL agents, ZMQ sockets,
    threads' objects) before the next module starts, where its tests made them, rather
    than at whatever later allocation starts a full collection. A CI run once aborted
    inside such a collection during a pure test module, its cause not reproduced."""
    yield
    gc.collect()


@pytest.fixture
def make() -> Iterator[Callable[..., Roles]]:
    made: list[Roles] = []

    def build(role: str, **config: Any) -> Roles:
        from kvxfer.engine import LLMEngine, tiny_config
        from kvxfer.sidecar.roles.composition import new_engine_id
        from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
        from kvxfer.transfer.transfer_config import TransferConfig

        engine = LLMEngine(tiny_config(), None, block_size=16, num_blocks=8)
        engine_id = new_engine_id(role)
        metrics = SidecarMetrics(role=role, engine_id=engine_id, model="tiny",
                                 layout=engine.layout.name, tp=1)
        made.append(Roles.start(engine, role, metrics, TransferConfig(**config), engine_id,
                                "127.0.0.1"))
        return made[-1]

    yield build
    for roles in made:
        roles.close()


@pytest.fixture
def connector(make: Callable[..., Roles]) -> Roles:
    return make("decode", kv_load_failure_policy="fail")


@pytest.fixture
def recorder() -> Iterator[Any]:
    from test_release import Recorder

    made = Recorder()
    yield made
    made.listener.close()


@pytest.fixture(scope="module")
def prefill() -> Iterator[Any]:
    from kvxfer.harness.loopback import PrefillProcess

    proc = PrefillProcess()
    try:
        yield proc
    finally:
        proc.close()
