"""``kvxfer.bench.affinity``: threads of a bound process group that left their cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvxfer.bench.affinity import rebind, strayed_threads

# a child bound to core 1 whose one extra thread rebinds itself to core 0, as vLLM's
# NixlConnector rebinds the thread that creates it
CHILD = """
import os, sys, threading, time
moved = threading.Event()
def stray():
    os.sched_setaffinity(0, {0})
    moved.set()
    time.sleep(60)
threading.Thread(target=stray, name="stray", daemon=True).start()
moved.wait()
print(threading.get_native_id(), flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPU cores to bind a thread away from its group's")
def test_a_thread_that_left_its_groups_core_is_named() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             start_new_session=True,
                             preexec_fn=lambda: os.sched_setaffinity(0, {1}))
    try:
        assert child.stdout is not None
        main_tid = int(child.stdout.readline())
        strayed = strayed_threads(child.pid, {1})
        assert len(strayed) == 1, strayed
        assert str(strayed[0]).endswith(f"of {child.pid}): cores 0")
        assert strayed[0].tid != main_tid  # the main thread stayed
        # asked about core 0, every thread but the rebound one is off it
        others = strayed_threads(child.pid, {0})
        assert others and all(s.cores == "1" for s in others), others
        assert main_tid in {s.tid for s in others}
        assert rebind(strayed, {1}) == strayed
        assert strayed_threads(child.pid, {1}) == []  # back on the group's core
    finally:
        child.kill()
        child.wait()


def test_a_group_with_no_process_has_no_threads() -> None:
    with subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True) as done:
        done.wait()
    time.sleep(0.05)
    assert strayed_threads(done.pid, {0}) == []


def test_bench_vllm_names_the_threads_that_left_their_core() -> None:
    from kvxfer.bench.vllm import _table

    report = {"connectors": {"nixl": {}, "kvxfer": {}}, "ratios": {},
              "strayed_threads": {"nixl-prefill": ["VLLM::Worker (thread 7 of 7): cores 1"],
                                  "nixl-decode": []}}
    table = _table(report)
    assert ("nixl-prefill: 1 thread(s) had left the instance's core after start and were "
            "bound back to it: VLLM::Worker (thread 7 of 7): cores 1") in table
    assert "nixl-decode" not in table
