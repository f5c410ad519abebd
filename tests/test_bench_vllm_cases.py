"""``kvxfer bench vllm --cases``: one case can be rerun alone; a wrong name is refused before
any vLLM instance starts (the benchmark itself runs vLLM: ``kvxfer bench vllm``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvxfer.bench.vllm import select_cases

PROMPTS = [100, 500, 1500]


@pytest.mark.parametrize(("spec", "want"), [
    (None, ([100, 500, 1500], True)),
    ("500", ([500], False)),
    ("fragmented", ([], True)),
    (" 1500 , 100,fragmented", ([100, 1500], True)),
])
def test_cases_pick_prompt_lengths_and_the_fragmented_case(
        spec: str | None, want: tuple[list[int], bool]) -> None:
    assert select_cases(spec, PROMPTS) == want


@pytest.mark.parametrize("spec", ["250", "frag", ",", "100,LBHNC"])
def test_an_unknown_case_names_the_valid_ones(spec: str) -> None:
    with pytest.raises(ValueError, match="valid: 100, 500, 1500, fragmented"):
        select_cases(spec, PROMPTS)


def test_the_command_refuses_an_unknown_case_before_starting_vllm() -> None:
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli", "bench", "vllm",
                          "--vllm-python", sys.executable, "--prompt-tokens", "64",
                          "--cases", "100"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "unknown case '100'; valid: 64, fragmented" in out.stderr
