"""The accuracy scripts, ``kvxfer accuracy`` and ``kvxfer demo``, run for real.

``scripts/run_accuracy_test.sh`` launches prefill, decode, reference and proxy
processes on loopback; it must pass on the default configuration and across a
TP and layout change, clean up every process it started (also on Ctrl-C), and
the comparison it relies on must fail when two instances disagree.
Each script runs in its own session, so "no process left" means: no process
of that process group is alive afterwards. The runs of one model share its reference
instance and the answers it gave (``recorded_reference.py``, ``REFERENCE_URL``), except
:data:`OWN_REFERENCE`, run as a user runs the script: it starts its own. The main tier
runs one case per concern (a TP change as a user runs it, MLA, a warm decode cache); the
other layouts, block sizes, decode counts and push are the heavy tier's (CI runs both).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from recorded_reference import References
from sidecars import ROOT, SidecarGroup, Spec, free_port

SCRIPT = ROOT / "scripts" / "run_accuracy_test.sh"
SWEEP = ROOT / "scripts" / "config_sweep_accuracy_test.sh"
RUN_TIMEOUT_S = 300.0


def group_members(pgid: int) -> list[int]:
    """PIDs of live (not zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def run_script(argv: list[str], env: dict[str, str],
               tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run a script in a new session; assert afterwards that nothing of it survived."""
    full_env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **env}
    process = subprocess.Popen(argv, cwd=ROOT, env=full_env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        out, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        leftover = group_members(process.pid)
        kill_group(process.pid)
        process.wait()
    assert not leftover, f"processes left running after {argv[0]}: {leftover}"
    return subprocess.CompletedProcess(argv, process.returncode, out, None)


TINY = {"MODEL": "kvxfer-tiny"}
TINY_MLA = {"MODEL": "kvxfer-tiny-mla"}  # one latent per token, on every TP rank
PUSH = {"KVXFER_TRANSFER_MODE": "push"}
GGUF_FILE = "<the SmolLM2 .gguf file>"  # replaced by its path: a .gguf path as MODEL
SMOLLM2 = "smollm2-135m-instruct"  # the scripts' default MODEL
OWN_REFERENCE = "tiny-tp1-to-tp2"  # the case whose script starts its own reference


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[References]:
    with References(tmp_path_factory.mktemp("references")) as started:
        yield started


def with_reference(env: dict[str, str], references: References) -> dict[str, str]:
    """``env`` with ``REFERENCE_URL``: the recorded reference of its model (the GGUF file's
    is the named model's: the name resolves to that file)."""
    model = env.get("MODEL", SMOLLM2)
    return {**env, "REFERENCE_URL": references.url(SMOLLM2 if model == GGUF_FILE else model)}


@pytest.mark.parametrize("env", [
    pytest.param({}, marks=pytest.mark.heavy, id="default-smollm2"),
    pytest.param({"KVXFER_KV_CACHE_LAYOUT": "BHLNC", "PREFILLER_TP_SIZE": "1",
                  "DECODER_TP_SIZE": "3"}, marks=pytest.mark.heavy,
                 id="smollm2-bhlnc-tp1-to-tp3"),
    pytest.param({"MODEL": GGUF_FILE, "PREFILLER_TP_SIZE": "3",
                  "DECODER_TP_SIZE": "1"}, marks=pytest.mark.heavy,
                 id="smollm2-gguf-path-tp3-to-tp1"),
    pytest.param({"PREFILLER_BLOCK_SIZE": "16", "DECODER_BLOCK_SIZE": "32"},
                 marks=pytest.mark.heavy, id="smollm2-block16-to-block32"),
    pytest.param({**TINY, "PREFILLER_TP_SIZE": "1", "DECODER_TP_SIZE": "2"},
                 id="tiny-tp1-to-tp2"),
    pytest.param({**TINY, "KVXFER_KV_CACHE_LAYOUT": "BLHNC", "DECODER_KV_LAYOUT": "BHLNC",
                  "PREFILLER_TP_SIZE": "2", "DECODER_TP_SIZE": "1",
                  "PREFILLER_BLOCK_SIZE": "32", "DECODER_BLOCK_SIZE": "16"},
                 marks=pytest.mark.heavy, id="tiny-block32-to-block16-tp2-to-tp1"),
    pytest.param({**TINY, "KVXFER_KV_CACHE_LAYOUT": "BLHNC", "DECODER_KV_LAYOUT": "BHLNC",
                  "PREFILLER_TP_SIZE": "2", "DECODER_TP_SIZE": "1",
                  "NUM_DECODE_INSTANCES": "2"}, marks=pytest.mark.heavy,
                 id="tiny-mixed-layouts-tp2-to-tp1-two-decodes"),
    # a converted read across block sizes: a head split of a tokens-outside-heads prefill
    pytest.param({**TINY, "KVXFER_KV_CACHE_LAYOUT": "LBNHC", "PREFILLER_TP_SIZE": "1",
                  "DECODER_TP_SIZE": "2", "PREFILLER_BLOCK_SIZE": "16",
                  "DECODER_BLOCK_SIZE": "32"}, marks=pytest.mark.heavy,
                 id="tiny-lbnhc-tp1-to-tp2-block16-to-block32"),
    pytest.param({**TINY_MLA, "PREFILLER_TP_SIZE": "1", "DECODER_TP_SIZE": "2"},
                 id="tiny-mla-tp1-to-tp2"),
    # push mode: the decode reserves, the prefill writes each layer as it computes it
    pytest.param({**TINY, **PUSH, "PREFILLER_TP_SIZE": "1", "DECODER_TP_SIZE": "2"},
                 marks=pytest.mark.heavy, id="push-tiny-tp1-to-tp2"),
    pytest.param({**TINY, **PUSH, "KVXFER_KV_CACHE_LAYOUT": "BLHNC",
                  "DECODER_KV_LAYOUT": "BHLNC", "PREFILLER_TP_SIZE": "2", "DECODER_TP_SIZE": "1",
                  "PREFILLER_BLOCK_SIZE": "32", "DECODER_BLOCK_SIZE": "16"},
                 marks=pytest.mark.heavy, id="push-tiny-block32-to-block16-tp2-to-tp1"),
    pytest.param({**TINY_MLA, **PUSH, "PREFILLER_TP_SIZE": "1", "DECODER_TP_SIZE": "2"},
                 marks=pytest.mark.heavy, id="push-tiny-mla-tp1-to-tp2"),
    pytest.param({**PUSH, "KVXFER_KV_CACHE_LAYOUT": "BHLNC", "PREFILLER_TP_SIZE": "1",
                  "DECODER_TP_SIZE": "3"}, marks=pytest.mark.heavy,
                 id="push-smollm2-bhlnc-tp1-to-tp3"),
    # pushes the prefill converts first: the converted read above, pushed; and a decode
    # that keeps a block's heads together gathering them from two prefill ranks
    pytest.param({**TINY, **PUSH, "KVXFER_KV_CACHE_LAYOUT": "LBNHC", "PREFILLER_TP_SIZE": "1",
                  "DECODER_TP_SIZE": "2", "PREFILLER_BLOCK_SIZE": "16",
                  "DECODER_BLOCK_SIZE": "32"}, marks=pytest.mark.heavy,
                 id="push-tiny-lbnhc-tp1-to-tp2-block16-to-block32"),
    pytest.param({**TINY, **PUSH, "KVXFER_KV_CACHE_LAYOUT": "LBNHC", "PREFILLER_TP_SIZE": "2",
                  "DECODER_TP_SIZE": "1"}, marks=pytest.mark.heavy,
                 id="push-tiny-lbnhc-tp2-to-tp1"),
    # the second prefill rank is only told to free; LBNHC needs no conversion for one head
    pytest.param({**TINY_MLA, "KVXFER_KV_CACHE_LAYOUT": "BLHNC", "DECODER_KV_LAYOUT": "LBNHC",
                  "PREFILLER_TP_SIZE": "2", "DECODER_TP_SIZE": "1"}, marks=pytest.mark.heavy,
                 id="tiny-mla-tp2-to-tp1"),
])
def test_accuracy_script_passes(env: dict[str, str], tmp_path: Path, references: References,
                                request: pytest.FixtureRequest) -> None:
    if request.node.callspec.id != OWN_REFERENCE:
        env = with_reference(env, references)
    if env.get("MODEL") == GGUF_FILE:
        from kvxfer.engine.model_names import MODELS

        packaged = MODELS[SMOLLM2].gguf
        assert packaged is not None
        env = {**env, "MODEL": str(packaged.locate())}
    result = run_script([str(SCRIPT)], env, tmp_path)
    assert result.returncode == 0, result.stdout
    blocks = (env.get("PREFILLER_BLOCK_SIZE", "16"),
              env.get("DECODER_BLOCK_SIZE", env.get("PREFILLER_BLOCK_SIZE", "16")))
    banner = next(line for line in result.stdout.splitlines() if line.startswith("accuracy: "))
    assert f"block {blocks[0]} x" in banner and f"block {blocks[1]} x" in banner, banner
    prompts = json.loads((ROOT / "scripts" / "accuracy_prompts.json").read_text())
    cases = len(prompts["prompts"]) + len(prompts.get("chat", []))
    assert f"{cases}/{cases} match" in result.stdout, result.stdout
    assert result.stdout.rstrip().endswith("accuracy: PASS")
    assert not list(tmp_path.glob("kvxfer-accuracy.*")), "a passing run keeps no logs"
    assert not list(tmp_path.glob("kvxfer-kv.*")), "the temporary KV key file is removed"


@pytest.mark.parametrize("env", [
    pytest.param({**TINY}, marks=pytest.mark.heavy, id="tiny-block16"),
    pytest.param({**TINY, "PREFILLER_BLOCK_SIZE": "32", "DECODER_BLOCK_SIZE": "16"},
                 id="tiny-block32-to-block16"),
    # push: the decode reserves only the blocks past its cached prefix; with the prefill's
    # blocks larger, the WRITEs start inside one of them
    pytest.param({**TINY, **PUSH, "PREFILLER_BLOCK_SIZE": "32", "DECODER_BLOCK_SIZE": "16"},
                 marks=pytest.mark.heavy, id="push-tiny-block32-to-block16"),
    pytest.param({**TINY, **PUSH, "KVXFER_KV_CACHE_LAYOUT": "BLHNC",
                  "DECODER_KV_LAYOUT": "BHLNC", "PREFILLER_TP_SIZE": "2",
                  "DECODER_TP_SIZE": "1", "PREFILLER_BLOCK_SIZE": "16",
                  "DECODER_BLOCK_SIZE": "32"},
                 marks=pytest.mark.heavy, id="push-tiny-block16-to-block32-tp2-to-tp1"),
    # converted by the prefill, from inside its larger blocks
    pytest.param({**TINY, **PUSH, "KVXFER_KV_CACHE_LAYOUT": "BLHNC",
                  "DECODER_KV_LAYOUT": "LBNHC", "PREFILLER_BLOCK_SIZE": "32",
                  "DECODER_BLOCK_SIZE": "16"},
                 marks=pytest.mark.heavy, id="push-tiny-converted-block32-to-block16"),
])
def test_accuracy_script_with_a_warm_decode_prefix_cache(env: dict[str, str], tmp_path: Path,
                                                         references: References) -> None:
    """Every prompt twice: the second pass finds each prompt's whole blocks (pull: of both
    sizes) in the decode's cache, moves less, and still matches the reference."""
    env = with_reference({**env, "DECODER_PREFIX_CACHE": "1"}, references)
    result = run_script([str(SCRIPT)], env, tmp_path)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert "decode prefix cache cold then warm" in out.splitlines()[0], out
    prompts = json.loads((ROOT / "scripts" / "accuracy_prompts.json").read_text())
    cases = len(prompts["prompts"]) + len(prompts.get("chat", []))
    assert out.count(f"{cases}/{cases} match") == 2, out
    warm = re.search(r"warm pass: (\d+) of (\d+) prompt tokens found in the decode's prefix "
                     r"cache \(expected (\d+)\), (\d+) reads skipped, (\d+) bytes "
                     r"(?:read|written) \(cold pass: (\d+)\)", out)
    assert warm, out
    hits, queries, expected, _, read, cold = map(int, warm.groups())
    assert hits == expected and 0.5 * queries < hits < queries, out
    assert 0 < read < cold / 3, out
    assert out.rstrip().endswith("accuracy: PASS")


def test_accuracy_script_refuses_a_warm_cache_over_several_decodes(tmp_path: Path) -> None:
    result = run_script([str(SCRIPT)], {**TINY, "DECODER_PREFIX_CACHE": "1",
                                        "NUM_DECODE_INSTANCES": "2"}, tmp_path)
    assert result.returncode == 2 and "NUM_DECODE_INSTANCES=1" in result.stdout, result.stdout


@pytest.mark.heavy
def test_sweep_prints_one_line_per_configuration(tmp_path: Path,
                                                 references: References) -> None:
    env = with_reference({**TINY, "SWEEP_LAYOUTS": "BHLNC LBNHC", "SWEEP_TP_PAIRS": "1:2"},
                         references)
    result = run_script([str(SWEEP)], env, tmp_path)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["BHLNC", "1->2", "pass"] for line in lines), result.stdout
    # tokens outside heads, split for TP 2: a converted read
    assert any(line.split()[:3] == ["LBNHC", "1->2", "pass"] for line in lines), result.stdout
    assert lines[-1] == "2/2 configurations passed"


def test_accuracy_script_fails_and_cleans_up_when_an_instance_cannot_start(
        tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    result = run_script([str(SCRIPT)], {"MODEL": str(missing), "STARTUP_TIMEOUT": "60"},
                        tmp_path)
    assert result.returncode != 0
    assert "did not come up" in result.stdout and str(missing) in result.stdout, result.stdout
    assert list(tmp_path.glob("kvxfer-accuracy.*")), "a failed run keeps its logs"


def test_accuracy_script_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **TINY}
    process = subprocess.Popen([str(SCRIPT)], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()  # printed once every process is launched
        assert banner.startswith("accuracy: prefill"), banner
        assert len(group_members(process.pid)) > 1, "the instances should be running"
        os.kill(process.pid, signal.SIGINT)
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 130, out
        assert "interrupted" in out
        deadline = time.monotonic() + 10
        while group_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_members(process.pid), "instances outlived the script"
    finally:
        kill_group(process.pid)
        process.wait()


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two plain instances whose tiny models differ only in the weight seed."""
    with SidecarGroup(tmp_path_factory.mktemp("seeds")) as group:
        sidecars = group.start([Spec("both", extra=("--seed", "0")),
                                Spec("both", extra=("--seed", "1"))])
        yield [s.url for s in sidecars]


def accuracy(target: str, reference: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", "accuracy", "--target", target,
                           "--reference", reference, "--max-tokens", "4", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def test_accuracy_command_fails_when_answers_differ(two_models: list[str]) -> None:
    same = accuracy(two_models[0], two_models[0], "--json")
    assert same.returncode == 0, same.stdout + same.stderr
    assert json.loads(same.stdout)["passed"] is True

    differ = accuracy(two_models[0], two_models[1])
    assert differ.returncode == 1, differ.stdout + differ.stderr
    assert "FAIL" in differ.stdout and "target:" in differ.stdout


def test_accuracy_command_names_an_unreachable_target(two_models: list[str]) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    result = accuracy(nobody, two_models[0], "--wait", "1")
    assert result.returncode == 2
    assert nobody in result.stderr and "not healthy" in result.stderr


@pytest.mark.heavy  # a long real-model run: the heavy tier
def test_demo_answers_with_real_text_by_default(tmp_path: Path) -> None:
    """The first thing a newcomer runs: SmolLM2 behind the proxy, TP 1 -> TP 3."""
    result = run_script([sys.executable, "-m", "kvxfer.cli", "demo", "--max-tokens", "16"],
                        {}, tmp_path)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert "decode sidecar (LBHNC, TP 3)" in out, out
    chat = out.split("> (chat) What is the capital of France?", 1)[1].split("\n")[1]
    assert chat.startswith("< ") and "Paris" in chat, out
    streamed = re.search(r"< \(streamed\) (.+)", out)
    assert streamed and len(re.findall(r"[A-Za-z]{3,}", streamed[1])) >= 3, out
    assert out.count("moved: ") == 3 and "noise" not in out, out


def test_demo_shows_a_disaggregated_request_end_to_end(tmp_path: Path) -> None:
    result = run_script([sys.executable, "-m", "kvxfer.cli", "demo", "--max-tokens", "8",
                         "--model", "kvxfer-tiny", "--prompt", "The quick brown fox"], {},
                        tmp_path)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert "> The quick brown fox" in out
    moved = re.search(r"moved: (\d+) blocks \((\d+) prompt tokens\), [\d.]+ [KMG]?i?B in "
                      r"(\d+) descriptors, [\d.]+ ms \([\d.]+ GB/s\)", out)
    assert moved, f"demo does not say what moved:\n{out}"
    assert int(moved[1]) >= 1 and int(moved[3]) >= int(moved[1])
    assert re.search(r"time to first token [\d.]+ ms = prefill [\d.]+ ms \+ hand-over to "
                     r"the decode [\d.]+ ms \(the KV transfer runs after it\)", out), out
    assert "stopping the sidecars and the proxy" in out
    assert re.search(r"curl -s http://\S+ -H 'Authorization: Bearer sk-\S+'", out), out
    assert not list(tmp_path.glob("kvxfer-demo.*")), "a demo that ran through keeps no logs"
    assert not list(tmp_path.glob("kvxfer-demo-kv.*")), "the temporary KV key file is removed"


def test_demo_on_a_busy_port_says_which_and_what_to_do() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "kvxfer.cli", "demo", "--port", str(port)],
                                cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "--port" in result.stderr, result.stderr
