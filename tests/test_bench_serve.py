"""``kvxfer bench serve`` as a user runs it: real sidecar processes, a tiny workload.

It measures each model at each TP size that splits the model's KV heads, reports the
others as not applicable with the reason, and gives ratios to the first model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sidecars import ROOT


@pytest.mark.heavy
def test_bench_serve_measures_each_cell_and_explains_the_rest() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "bench", "serve", "--json", "--model",
         "kvxfer-tiny", "--tp", "1", "--tp", "3", "--repeats", "1", "--prompt-tokens", "40",
         "--decode-tokens", "3", "--batch", "2", "--num-blocks", "64"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["config"]["baseline"] == "kvxfer-tiny"
    measured, skipped = report["cells"]
    assert (measured["model"], measured["tp"], measured["not_applicable"]) == \
        ("kvxfer-tiny", 1, None)
    results = measured["results"]
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_batch2",
                "transfer_ms", "decode_request_ms_with_transfer"):
        assert results[key] > 0, key
    # 40 prompt tokens of the tiny model fill 3 blocks of 16; the decode reads the first 39.
    assert 0 < results["transfer_MiB"] < 1
    assert skipped["results"] is None and skipped["tp"] == 3
    assert "TP sizes that fit this model" in skipped["not_applicable"]
