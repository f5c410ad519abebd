"""``kvxfer bench load``: its figures, ratios, labels and table from fixed inputs, and real
runs as a user starts them (kvxfer-tiny sidecars and the proxy on 127.0.0.1): one to the end,
one interrupted with Ctrl-C; neither may leave a process behind."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sidecars import ROOT
from stub_upstream import wait_until

from kvxfer.bench import load
from kvxfer.bench.proxy import Cell
from kvxfer.bench.serving import BenchError
from kvxfer.harness import preloaded
from kvxfer.harness.preloaded import PreloadedProcess

COMMAND = [sys.executable, "-m", "kvxfer.cli", "bench", "load"]
SMALL = ["--requests", "40", "--concurrency", "4", "--rounds", "1", "--warmup", "4"]
READY = re.compile(r"ready after .*prefill (\S+), decode (\S+), proxy (\S+)")


def cell(latencies: list[float], first_bytes: list[float], elapsed: float, errors: int = 0,
         cpu_s: dict[str, float] | None = None) -> Cell:
    c = Cell(latencies=latencies, first_bytes=first_bytes, elapsed=elapsed, cpu_s=cpu_s or {})
    for _ in range(errors):
        c.fail("HTTP 503")
    return c


def test_figures_pool_the_requests_of_every_run_and_take_the_median_rate() -> None:
    runs = [cell([0.1, 0.2, 0.3, 0.4], [0.01, 0.02, 0.03, 0.04], 2.0),
            cell([0.5], [0.05], 1.0), cell([0.6, 0.7], [0.06, 0.07], 0.5)]
    got = load.figures(runs)
    assert got["rps"] == 2.0  # of 2, 1 and 4 requests/s
    assert got["ttfb_p50_ms"] == 40.0 and got["ttfb_p90_ms"] == 64.0
    assert got["ttfb_p99_ms"] == pytest.approx(69.4)
    assert (got["latency_p50_ms"], got["latency_p99_ms"]) == (400.0, 694.0)
    assert load.figures([cell([], [], 1.0, errors=3)]) == dict.fromkeys(load.FIGURES)


def source(label: str, rps: float | None, ttfb: float, modified: bool = False
           ) -> dict[str, Any]:
    figures = {f: ttfb for f in load.FIGURES[1:]}
    return {"label": label, "modified": modified, "rps": rps, **figures}


def test_ratios_are_to_the_first_source_and_missing_where_either_figure_is() -> None:
    now, then, broken = load.with_ratios([source("new", 25.0, 200.0), source("old", 30.0, 150.0),
                                          source("dead", None, 100.0)])
    assert set(now["ratio_to_first"].values()) == {1.0}
    assert then["ratio_to_first"]["rps"] == 1.2 and then["ratio_to_first"]["ttfb_p50_ms"] == 0.75
    assert broken["ratio_to_first"]["rps"] is None
    assert load.with_ratios([source("dead", None, 1.0), source("old", 3.0, 1.0)]
                            )[1]["ratio_to_first"]["rps"] is None


def test_the_report_and_its_table_from_fixed_runs() -> None:
    runs = [load.Run(0, cell([0.4] * 10, [0.2] * 10, 1.0, cpu_s={"prefill": 0.5})),
            load.Run(1, cell([0.5] * 9, [0.25] * 9, 1.0, errors=1, cpu_s={"prefill": 0.3}), 2)]
    new = load.source_report(load.Source(Path("/src/new"), "abc1234", "abc1234", True), runs)
    assert (new["rps"], new["failures"], new["cpu_ms_per_request"]) == (9.5, 3, {"prefill": 40.0})
    assert [r["rps"] for r in new["runs"]] == [10.0, 9.0]
    assert new["runs"][1] | {"first_error": None} == {
        "round": 2, "requests": 10, "failures": 1, "warmup_failures": 2, "first_error": None,
        "elapsed_s": 1.0, **load.figures([runs[1].cell]), "cpu_ms_per_request": {"prefill": 30.0}}
    old = load.source_report(load.Source(Path("/src/old"), "old"), runs[:1])
    config = {"model": "kvxfer-tiny", "requests": 10, "concurrency": 4, "rounds": 2, "warmup": 0,
              "max_tokens": 16, "lengths": [16, 64], "seed": 0, "cpus": 2}
    table = "\n".join(load.table_lines({"config": config,
                                        "sources": load.with_ratios([new, old])}))
    assert "10 streamed completions per run at concurrency 4" in table
    assert ("abc1234 (modified)       9.5     200.0   250.0   250.0      400.0   500.0       3"
            "  [10.0 9.0]") in table
    assert "old                    1.053     1.000   0.800   0.800      1.000   0.800\n" in table
    assert "abc1234 (modified)   prefill 40\nold                  prefill 50" in table
    assert "first error, abc1234 round 2: HTTP 503" in table


def fake_tree(path: Path) -> Path:
    for name in ("kvxfer/cli.py", "proxy/__main__.py"):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("")
    return path


def git(path: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


def test_a_source_is_labelled_by_its_commit_in_a_git_tree_else_by_its_folder(
        tmp_path: Path) -> None:
    with pytest.raises(BenchError, match=r"not a kvxfer tree: it has no kvxfer/cli\.py"):
        load.source(tmp_path)
    plain = load.source(fake_tree(tmp_path / "copy"))
    assert (plain.label, plain.commit, plain.modified) == ("copy", None, False)
    tree = fake_tree(tmp_path / "repo")
    git(tree, "init", "-q")
    git(tree, "add", ".")
    git(tree, "commit", "-qm", "x")
    short = git(tree, "rev-parse", "--short", "HEAD")
    assert load.source(tree) == load.Source(tree.resolve(), short, short, False)
    (tree / "kvxfer/cli.py").write_text("# edited\n")
    assert load.source(tree).modified
    inner = load.source(fake_tree(tree / "nested"))  # inside a repository, not its top
    assert inner.label == "nested" and inner.commit is None
    twice = load.distinct([plain, plain, inner, plain])
    assert [s.label for s in twice] == ["copy", "copy#2", "nested", "copy#3"]


def args(**overrides: Any) -> argparse.Namespace:
    base = {"requests": 6, "concurrency": 4, "rounds": 1, "warmup": 0, "max_tokens": 16,
            "lengths": (16, 256), "seed": 0, "model": "kvxfer-tiny", "source": None}
    return argparse.Namespace(**base | overrides)


def test_every_run_sends_the_same_seeded_mix_and_arguments_are_checked() -> None:
    bodies = load.request_bodies(args())
    assert bodies == load.request_bodies(args()) != load.request_bodies(args(seed=1))
    prompts = [json.loads(b)["prompt"] for b in bodies]
    assert {len(p) for p in prompts} == {16, 256} and len(set(prompts)) == 6
    assert json.loads(bodies[0]) | {"prompt": ""} == {
        "model": "kvxfer-tiny", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
        "stream": True, "prompt": ""}
    assert load.num_blocks(args()) == 256 and load.num_blocks(args(concurrency=16)) == 576
    assert [s.path for s in load.check_args(args())] == [ROOT]
    with pytest.raises(BenchError, match="--requests 0, --rounds 0"):
        load.check_args(args(requests=0, rounds=0))
    with pytest.raises(BenchError, match="past kvxfer-tiny's context of 2048"):
        load.check_args(args(lengths=(2040,)))


def test_the_command_lines_parse_with_this_trees_parsers() -> None:
    import proxy.__main__
    from kvxfer.cli import build_parser

    ports = {"prefill": 1, "decode": 2, "proxy": 3}
    argvs = load.argvs(args(), ports)
    for role in ("prefill", "decode"):
        parsed = build_parser().parse_args(argvs[role][3:])  # after python -m kvxfer.cli
        assert (parsed.role, parsed.port, parsed.num_blocks) == (role, ports[role], 256)
    parsed = proxy.__main__.build_parser().parse_args(argvs["proxy"][3:])
    assert (parsed.prefiller_ports, parsed.decoder_ports, parsed.port) == ([1], [2], 3)


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    return False


def without_keys() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVXFER_")}


def test_a_run_on_this_tree_reports_every_figure_and_leaves_nothing_running(
        tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    done = preloaded.run("kvxfer.cli", [*COMMAND[3:], *SMALL, "--json", "--json-file", str(out)],
                         ROOT, without_keys(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert json.loads(out.read_text()) == report
    assert report["failed_requests"] == 0
    assert report["config"] | {"cpus": None} == {
        "model": "kvxfer-tiny", "requests": 40, "concurrency": 4, "rounds": 1, "warmup": 4,
        "max_tokens": 16, "lengths": list(load.DEFAULT_LENGTHS), "seed": 0, "num_blocks": 256,
        "cpus": None}
    [here] = report["sources"]
    assert here["path"] == str(ROOT) and here["failures"] == 0
    assert set(here["ratio_to_first"].values()) == {1.0}
    [run] = here["runs"]
    assert (run["requests"], run["failures"], run["warmup_failures"]) == (40, 0, 0)
    assert all(here[f] > 0 for f in load.FIGURES)
    assert here["ttfb_p50_ms"] <= here["ttfb_p99_ms"] <= here["latency_p99_ms"]
    assert {"prefill", "decode", "proxy", "client"} <= set(here["cpu_ms_per_request"])
    [urls] = READY.findall(done.stderr)
    assert all(refused(url) for url in urls)


def test_ctrl_c_stops_every_process_it_started(tmp_path: Path) -> None:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    bench = PreloadedProcess("kvxfer.cli", [*COMMAND[3:], *SMALL, "--requests", "100000"],
                             without_keys(), ROOT, out, err)
    try:
        def ready() -> re.Match[str] | None:  # all are up and the load has begun
            return READY.search(err.read_text()) if err.exists() else None

        wait_until(lambda: ready() is not None or bench.poll() is not None, 120.0,
                   "the bench's ready line")
        found = ready()
        assert found is not None, f"no ready line; exit status {bench.poll()}"
        time.sleep(1.0)
        bench.send_signal(signal.SIGINT)
        assert bench.wait(60) == 130
        assert "interrupted" in err.read_text()
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(60)
    assert all(refused(url) for url in found.groups())
