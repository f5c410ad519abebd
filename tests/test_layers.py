"""The architecture as tests: the import-linter contracts in pyproject.toml hold on this tree,
a wrong import breaks them, and no module or class outgrows its room.

The contracts are read and checked with import-linter's own API, in this process: the import
graph of the tree is built once (what ``lint-imports --no-cache`` builds), and each wrong
import is added to a copy of that graph, so every case checks the real contracts against the
real graph plus exactly one import."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvxfer", "proxy")
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


class Contracts:
    """pyproject.toml's contracts and the import graph they were checked on."""

    def __init__(self, pyproject: Path) -> None:
        from importlinter import api  # noqa: F401  (configures import-linter's readers)
        from importlinter.application.use_cases import create_report, read_user_options
        from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
        from importlinter.contracts.forbidden import ForbiddenContract
        from importlinter.contracts.layers import LayersContract
        from importlinter.domain.contract import registry

        # what the lint-imports command registers before it reads contracts (those we use)
        for kind, contract_class in (("layers", LayersContract), ("forbidden", ForbiddenContract),
                                     ("acyclic_siblings", AcyclicSiblingsContract)):
            registry.register(contract_class, kind)
        report = create_report(read_user_options(str(pyproject)), cache_dir=None)
        assert not report.could_not_run, "import-linter could not check the contracts"
        self.graph = report.graph
        self.checked = list(report.get_contracts_and_checks())

    def names(self) -> list[str]:
        return [contract.name for contract, _ in self.checked]

    def broken(self) -> list[str]:
        """Names of the contracts the tree breaks as it is."""
        return [contract.name for contract, check in self.checked if not check.kept]

    def broken_with(self, importer: str, imported: str) -> dict[str, str]:
        """The contracts broken once ``importer`` also imports ``imported``: {name: report}."""
        from importlinter.application.output import console

        graph = deepcopy(self.graph)
        graph.add_import(importer=importer, imported=imported, line_number=1,
                         line_contents=f"import {imported}")
        broken = {}
        for contract, _ in self.checked:
            check = contract.check(deepcopy(graph), verbose=False)
            if not check.kept:
                with console.capture() as captured:
                    contract.render_broken_contract(check)
                broken[contract.name] = captured.get()
        return broken


@pytest.fixture(scope="module")
def contracts() -> Iterator[Contracts]:
    yield Contracts(ROOT / "pyproject.toml")


def test_the_import_contracts_hold(contracts: Contracts) -> None:
    assert contracts.checked, "pyproject.toml declares no import contracts"
    assert not contracts.broken(), f"contracts broken by the tree: {contracts.broken()}"


# (module that gets the import, what it imports, words of every contract that must then break:
# the first is the one the case is about; an upward import inside kvxfer also closes an
# import circle between two folders, and kvxfer.net importing the plan reaches the proxy)
LAYERS, CIRCLE = "kvxfer's layers", "no import circle"
WRONG_IMPORTS: list[tuple[str, str, tuple[str, ...]]] = [
    ("kvxfer/plan/layout.py", "kvxfer.wire.envelope", (LAYERS, CIRCLE)),
    ("kvxfer/plan/regions.py", "kvxfer.engine.sampler", (LAYERS, CIRCLE)),
    ("kvxfer/wire/tickets.py", "kvxfer.transfer.nixl_agent", (LAYERS, CIRCLE)),
    ("kvxfer/transfer/threads.py", "kvxfer.sidecar.sidecar_metrics", (LAYERS, CIRCLE)),
    ("kvxfer/engine/sampler.py", "kvxfer.transfer.threads", (LAYERS,)),
    ("kvxfer/sidecar/sidecar_metrics.py", "kvxfer.vllm.extra_config", (LAYERS,)),
    ("kvxfer/net/hosts.py", "kvxfer.plan.topology",
     (LAYERS, "the proxy shares only kvxfer.net")),
    ("kvxfer/harness/netns.py", "kvxfer.commands.plan", (LAYERS, CIRCLE)),
    ("proxy/errors.py", "kvxfer.transfer.threads", ("the proxy shares only kvxfer.net",)),
    ("kvxfer/sidecar/sidecar_metrics.py", "proxy.errors", ("only the top reaches the proxy",)),
    ("kvxfer/engine/sampler.py", "kvxfer.engine.scheduler", (CIRCLE,)),
    ("kvxfer/plan/layout.py", "vllm", ("the pure layers and the engine import neither",)),
    ("kvxfer/wire/tickets.py", "zmq", ("the pure layers and the engine import neither",)),
    ("kvxfer/transfer/threads.py", "zmq", ("ZMQ only in transfer/side_channel",)),
    ("kvxfer/sidecar/engine_loop.py", "zmq", ("ZMQ only in transfer/side_channel",)),
    ("kvxfer/sidecar/sidecar_metrics.py", "vllm", ("ZMQ only in transfer/side_channel",)),
]


@pytest.mark.parametrize(("module", "imported", "words"), WRONG_IMPORTS,
                         ids=[f"{m}->{i}" for m, i, _ in WRONG_IMPORTS])
def test_a_wrong_import_breaks_a_contract(contracts: Contracts, module: str, imported: str,
                                          words: tuple[str, ...]) -> None:
    """The tree's graph with one import added that runs against the declared layers breaks
    the named contracts, and no other."""
    importer = module.removesuffix(".py").replace("/", ".")
    assert importer in contracts.graph.modules, f"{module} is not a module of the tree"
    broken = contracts.broken_with(importer, imported)
    named = {word: [name for name in contracts.names() if word in name] for word in words}
    assert all(len(names) == 1 for names in named.values()), f"ambiguous words: {named}"
    assert set(broken) == {names[0] for names in named.values()}, (
        f"adding `import {imported}` to {module} broke {sorted(broken)}, not {words}")
    for name, report in broken.items():
        if CIRCLE not in name:  # (which names the cycle's edges, not the importer)
            assert importer in report, report


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_module_outgrows_its_room() -> None:
    long = {str(p.relative_to(ROOT)): n for p in source_files()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by noun): {long}"


def test_no_class_outgrows_its_room() -> None:
    long = {}
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert not long, f"classes over {MAX_CLASS_LINES} lines (split them by noun): {long}"


def test_no_two_modules_share_a_name() -> None:
    """A module's name says what it is wherever it is met (an import, a log line, a
    traceback): two rooms never hold modules of one name (``__init__`` aside)."""
    seen: dict[str, list[str]] = {}
    for path in source_files():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"modules of one name in different rooms: {shared}"
