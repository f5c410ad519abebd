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
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvxfer.sidecar.roles.composition import Roles


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


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
