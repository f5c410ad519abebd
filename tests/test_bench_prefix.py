"""``kvxfer bench prefix`` as a user runs it: real sidecar pairs, cache off and on, one run.

Only what does not depend on timing is checked: every figure is there, and the bytes
moved are exactly those of the blocks past the cached system prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sidecars import ROOT


@pytest.mark.heavy  # a long real-model run: the heavy tier
def test_bench_prefix_reports_each_configuration_with_ratios_to_off() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "bench", "prefix", "--json", "--requests", "3",
         "--system-tokens", "100", "--user-tokens", "8", "--num-blocks", "64", "--no-pin"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    configs = report["configs"]
    assert list(configs) == ["off", "decode", "both"] == report["config"]["configs"]
    for result in configs.values():
        assert result["ttft_ms"] > 0 and result["decode_ttft_ms"] > 0
    # 108 tokens: 7 blocks of 16 read cold; warm, the 6 blocks of the system prompt hit
    off, decode, both = configs["off"], configs["decode"], configs["both"]
    per_block = off["bytes_moved_first"] / 7
    assert off["bytes_moved"] == 3 * 7 * per_block and off["decode_cache_hit_tokens"] == 0
    for cached in (decode, both):
        assert cached["bytes_moved_first"] == 7 * per_block
        assert cached["bytes_moved_warm_median"] == per_block
        assert cached["decode_cache_hit_tokens"] == 2 * 96
        assert cached["ratio_to_off"]["bytes_moved"] == (7 + 1 + 1) / 21
        assert cached["ratio_to_off"]["ttft_ms"] > 0
    assert decode["prefill_cache_hit_tokens"] == 0 and both["prefill_cache_hit_tokens"] == 2 * 96
