"""``kvxfer bench trust`` as a user runs it: signed and unsigned sidecar pairs, crossover
phases, the primitives' costs, and its temporary key file removed.

A module of its own: ``test_trust.py``'s six sidecars (and their check after each test)
are not what this command uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sidecars import ROOT


@pytest.mark.heavy
def test_bench_trust_prints_both_sides_and_removes_its_key(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvxfer.cli", "bench", "trust", "--repeats",
                           "2", "--prompt-tokens", "64", "--num-blocks", "32", "--phases",
                           "2", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["decode_ttft_ms_signed"] > 0 and result["decode_ttft_ms_unsigned"] > 0
    assert result["ratio_signed_to_unsigned"] > 0
    assert len(result["phase_ratios"]) == 2  # the crossover: each start order once
    low, high = result["ratio_interval_95"]
    assert 0 < low <= high and result["target_shown"] == (high < 1.02)
    assert result["primitives"]["ticket_verify_us"] > 0
    assert not list(tmp_path.glob("kvxfer-kv-*")), "the temporary key file is removed"
