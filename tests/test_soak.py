"""``kvxfer bench soak`` as a user runs it, short: mixed load through the proxy while every
kind of fault hits the workers and a prefill (a decode in push mode) loses half the "done"
messages it receives. It
fails whenever the soak finds a problem: a wrong answer served as 200, a request past its
deadline, or blocks or leases held once all is idle.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sidecars import ROOT

from kvxfer.harness.network import why_not

KINDS = ("kill", "stop", "term", "lease")


@pytest.mark.heavy
@pytest.mark.parametrize(("netns", "mode"), [(False, "pull"), (True, "pull"), (False, "push")],
                         ids=["loopback", "netns", "push-loopback"])
def test_a_short_soak_under_every_kind_of_fault_answers_right_and_leaves_nothing_held(
        tmp_path: Path, netns: bool, mode: str) -> None:
    """On one host's loopback; and with every worker on a "host" of its own (namespaces),
    where a worker's link is also cut and restored; and in push mode (there the first
    decode loses "done" notifications and reports, as the first prefill does in pull)."""
    if netns and (why := why_not()) is not None:
        pytest.skip(why)
    path, logs = tmp_path / "soak.json", tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "bench", "soak", "--duration", "45",
         "--fault-interval", "5", "--json", "--json-file", str(path), "--log-dir", str(logs),
         "--kv-transfer-mode", mode, *(["--netns"] if netns else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert path.exists(), f"no report (exit {done.returncode}):\n{done.stderr[-3000:]}"
    report = json.loads(path.read_text())
    where = f"\nfaults:\n{done.stderr[-3000:]}\nlogs in {logs}"
    assert report["successes"] > 0, f"{report['errors']}{where}"
    kinds = (*KINDS, "link") if netns else KINDS
    assert all(report["faults"][kind] >= 1 for kind in kinds), f"{report['faults']}{where}"
    # prefill-0 (decode-0 in push mode) lost "done" notifications all along (and reports):
    # repaired, nothing held
    assert report["lost_notifications"] > 0, where
    assert report["wrong_answers"] == 0, f"{report['wrong_examples']}{where}"
    assert report["past_deadline"] == 0, f"{report['by_kind']}{where}"
    held = report["held_total"]
    assert held["used_blocks"] == 0 and held["leases"] == 0, f"{report['held']}{where}"
    assert done.returncode == 0, f"failed checks: {report['failed_checks']}{where}"
