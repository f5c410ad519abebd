"""`kvxfer generate` as a user runs it (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.engine import LLMEngine, SamplingParams, tiny_config


def kvxfer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", "generate", *args],
                          capture_output=True, text=True, timeout=120)


def test_json_output_matches_the_engine_in_process() -> None:
    out = kvxfer("--tp", "2", "--kv-cache-layout", "BLHNC", "--block-size", "8",
                 "--max-tokens", "6", "--logprobs", "2", "--ignore-eos", "--json",
                 "Hello", "second prompt")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    engine = LLMEngine(tiny_config(), seed=0, block_size=8)
    assert (result["model"], result["model_id"]) == ("kvxfer-tiny", engine.model_id)
    assert (result["tp"], result["layout"]) == (2, "BLHNC")
    prompts = [engine.tokenizer.encode(p) for p in ("Hello", "second prompt")]
    want = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    for got, expected, prompt in zip(result["completions"], want, prompts, strict=True):
        assert got["prompt_token_ids"] == prompt
        assert got["token_ids"] == expected.token_ids and got["text"] == expected.text
        assert got["finish_reason"] == "length"
        # TP 2 / BLHNC in the subprocess, TP 1 / LBHNC here: equal within float32 rounding.
        assert [lp["logprob"] for lp in got["logprobs"]] == pytest.approx(
            [lp.logprob for lp in expected.logprobs], abs=1e-4)
        assert all(len(lp["top"]) == 2 for lp in got["logprobs"])


def test_text_output_and_chat(tmp_path: Path) -> None:
    engine = LLMEngine(tiny_config(), seed=3)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "hi there"}])
    want = engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    out = kvxfer("--seed", "3", "--chat", "--max-tokens", "5", "--ignore-eos", "hi there")
    assert out.returncode == 0, out.stderr
    assert out.stdout == want.text + "\n"


def test_bad_checkpoints_fail_with_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = kvxfer("--model", str(tmp_path / "absent"), "hello")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"kvxfer generate: error: model '{tmp_path / 'absent'}' is not a model name "
        f"(kvxfer-tiny, kvxfer-tiny-mla, smollm2-135m-instruct), a .gguf file or a checkpoint "
        f"directory"]
    (tmp_path / "config.json").write_text("{not json")
    malformed = kvxfer("--model", str(tmp_path), "hello")
    assert malformed.returncode == 2
    lines = malformed.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json is not valid JSON" in lines[0]


def test_invalid_settings_fail_with_one_line_and_exit_2() -> None:
    out = kvxfer("--kv-cache-layout", "XYZ", "hello")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "kvxfer generate: error: unknown KV cache layout 'XYZ'; valid names: LBHNC, LBNHC, "
        "BLHNC, BLNHC, BHLNC, LHBNC, HND, HNC, NHD, NHC"]


def test_a_gguf_path_answers_like_the_model_name() -> None:
    """The SmolLM2 GGUF by path and by name: the same greedy chat answer, real text."""
    from kvxfer.engine.model_names import MODELS

    packaged = MODELS["smollm2-135m-instruct"].gguf
    assert packaged is not None
    question = ["--chat", "--max-tokens", "10", "What is the capital of France?"]
    by_path = kvxfer("--model", str(packaged.locate()), *question)
    by_name = kvxfer("--model", "smollm2-135m-instruct", *question)
    assert by_path.returncode == 0, by_path.stderr
    assert "Paris" in by_path.stdout and by_path.stdout == by_name.stdout
