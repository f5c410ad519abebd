"""Every attention backend of the installed vLLM, its cache shaped by vLLM's own classes,
read through KvxferConnector's worker side over real NIXL agents (``backend_shapes.py``,
run with vLLM's Python; host memory, so the GPU backends are tested by shape)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CLASSES = {"CPUAttentionBackend", "FlashAttentionBackend", "TritonAttentionBackend",
           "FlexAttentionBackend", "RocmAttentionBackend", "AiterFlashAttentionBackend",
           "RocmAiterUnifiedAttentionBackend"}
FROM_SOURCE = {"FlashInferBackend", "FlashInferBackend-nvfp4-form"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_backend_cache_lands_where_its_kernels_look(vllm_python: str,
                                                          device: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    out = subprocess.run([vllm_python, str(HERE / "backend_shapes.py"), "--device", device],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if device == "cuda" and rows and "skip" in rows[0]:
        pytest.skip(rows[0]["skip"])
    cases, done = rows[:-1], rows[-1]
    assert done == {"done": len(cases)} and cases
    for row in cases:
        where = f"{row['backend']} {row['layout']}"
        assert row["failures"] == 0, where
        assert row["exact"], f"{where}: the decode's blocks differ from the prefill's"
        assert row["untouched"], f"{where}: blocks outside the read changed"
        assert row["planned"] == row["layout"], f"{where}: planned as {row['planned']}"
        assert row["device"] == device, where
    assert {r["backend"] for r in cases} == CLASSES | FROM_SOURCE
    assert {r["backend"] for r in cases if r["source"] == "class"} == CLASSES
    assert {r["layout"] for r in cases} == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC",
                                            "BHLNC"}
    # the forms: K and V in each token's row, K/V heads as slots, a K and a V slot
    forms = {r["backend"]: (r["num_head_slots"], r["separate_kv_head_groups"]) for r in cases}
    assert forms["FlashAttentionBackend"] == (None, False)
    assert forms["FlashInferBackend-nvfp4-form"] == (4, True)
    assert forms["RocmAttentionBackend"] == (2, True)
