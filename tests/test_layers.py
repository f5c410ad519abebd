"""The architecture as tests: the import-linter contracts in pyproject.toml hold on this tree,
a wrong import breaks them, and no module or class outgrows its room."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvxfer", "proxy")
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the packages under ``root`` with its pyproject.toml's contracts."""
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run([sys.executable, "-c", command, "--no-cache",
                           str(root / "pyproject.toml")],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_import_contracts_hold() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, f"lint-imports failed:\n{done.stdout}\n{done.stderr}"
    assert "0 broken" in done.stdout, done.stdout


# (module that gets the import, what it imports, words of the contract that must then break)
WRONG_IMPORTS = [
    ("kvxfer/plan/layout.py", "kvxfer.wire.envelope", "layers"),
    ("kvxfer/plan/regions.py", "kvxfer.engine.sampler", "layers"),
    ("kvxfer/wire/tickets.py", "kvxfer.transfer.nixl_agent", "layers"),
    ("kvxfer/transfer/threads.py", "kvxfer.sidecar.sidecar_metrics", "layers"),
    ("kvxfer/engine/sampler.py", "kvxfer.transfer.threads", "layers"),
    ("kvxfer/sidecar/sidecar_metrics.py", "kvxfer.vllm.extra_config", "layers"),
    ("kvxfer/net/hosts.py", "kvxfer.plan.topology", "layers"),
    ("kvxfer/harness/netns.py", "kvxfer.commands.plan", "layers"),
    ("proxy/errors.py", "kvxfer.transfer.threads", "the proxy shares only kvxfer.net"),
    ("kvxfer/sidecar/sidecar_metrics.py", "proxy.errors", "only the top reaches the proxy"),
    ("kvxfer/engine/sampler.py", "kvxfer.engine.scheduler", "no import circle"),
    ("kvxfer/plan/layout.py", "vllm", "the pure layers and the engine import neither"),
    ("kvxfer/wire/tickets.py", "zmq", "the pure layers and the engine import neither"),
    ("kvxfer/transfer/threads.py", "zmq", "ZMQ only in transfer/side_channel"),
    ("kvxfer/sidecar/sidecar_metrics.py", "vllm", "ZMQ only in transfer/side_channel"),
]


@pytest.mark.parametrize(("module", "imported", "contract"), WRONG_IMPORTS,
                         ids=[f"{m}->{i}" for m, i, _ in WRONG_IMPORTS])
def test_a_wrong_import_breaks_a_contract(tmp_path: Path, module: str, imported: str,
                                          contract: str) -> None:
    """A copy of the tree with one import added that runs against the declared layers."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\nimport {imported}  # noqa: E402\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0, f"adding `import {imported}` to {module} broke no contract"
    summary, _, broken = done.stdout.partition("Broken contracts")
    assert any(contract in line and " BROKEN" in line
               for line in summary.splitlines()), done.stdout
    if contract != "no import circle":  # (which names the cycle's edges, not the importer)
        assert module.removesuffix(".py").replace("/", ".") in broken, done.stdout


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
