"""``kvxfer bench ttft``: its statistics, table, verdict and plot from fixed inputs, and one
end-to-end run as a user starts it (real sidecars and proxy, kvxfer-tiny, two lengths)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from sidecars import ROOT

from kvxfer.bench import ttft
from kvxfer.bench.serving import BenchError
from kvxfer.harness import preloaded

METRICS = ("ttft_ms", "tt2t_ms", "itl_ms")


def test_percentile_interpolates_between_ranks_and_p50_is_the_median() -> None:
    assert ttft.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert ttft.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert ttft.percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        ttft.percentile([], 50)


def test_a_sample_times_first_and_second_token_and_the_mean_gap_after_the_first() -> None:
    s = ttft.sample(10.0, [10.5, 10.6, 10.8, 11.1], 0.02)
    assert (s.ttft, s.tt2t, s.transfer) == (0.5, pytest.approx(0.6), 0.02)
    assert s.itl == pytest.approx(0.2)
    with pytest.raises(ttft.RequestFailed, match="1 token"):
        ttft.sample(0.0, [0.1], None)


def summary(ttft_ms: float, tt2t_ms: float, itl_ms: float,
            transfer_ms: float | None = None) -> dict[str, Any]:
    """A target's summary of four identical requests (p50 = p90)."""
    one = ttft.Sample(ttft_ms / 1000, tt2t_ms / 1000, itl_ms / 1000,
                      None if transfer_ms is None else transfer_ms / 1000)
    return ttft.summarize([one] * 4, [])


def report(*rows: tuple[int, dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    config = {"model": "kvxfer-tiny", "repeats": 4, "max_tokens": 8}
    return {"config": config, "failed_requests": 0, "lengths": [
        ttft.length_report(n, {"one": one, "pd": pd}) for n, one, pd in rows]}


def test_summaries_in_milliseconds_and_failures_counted() -> None:
    s = ttft.summarize([ttft.Sample(0.1, 0.2, 0.01, None), ttft.Sample(0.3, 0.4, 0.03, None)],
                       ["502", "timeout"])
    assert (s["requests"], s["failed"], s["first_error"]) == (4, 2, "502")
    assert s["ttft_ms"] == {"p50": 200.0, "p90": 280.0}
    assert s["itl_ms"]["p50"] == 20.0 and s["transfer_ms"] is None
    assert ttft.summarize([], ["refused"])["ttft_ms"] is None


def test_verdict_judges_medians_against_both_targets() -> None:
    one = summary(100.0, 120.0, 20.0)
    within = ttft.verdict(one, summary(105.0, 150.0, 20.0, transfer_ms=10.0))
    assert within is not None
    assert within["ttft"] == {"ms": 105.0, "limit_ms": 105.0, "ok": True}
    assert within["tt2t"]["limit_ms"] == 150.0 and within["tt2t"]["ok"]
    over = ttft.verdict(one, summary(106.0, 150.1, 20.0, transfer_ms=10.0))
    assert over is not None and not over["ttft"]["ok"] and not over["tt2t"]["ok"]
    assert ttft.verdict(one, ttft.summarize([], ["refused"])) is None


def test_the_table_and_verdict_lines_from_fixed_inputs() -> None:
    r = report((20, summary(100.0, 120.0, 20.0), summary(102.0, 140.0, 20.0, 5.0)),
               (500, summary(400.0, 420.0, 20.0), summary(500.0, 600.0, 21.0, 30.0)))
    assert r["lengths"][0]["vs_one"]["pd"]["ratios"]["ttft_p50"] == 1.02
    assert r["lengths"][1]["vs_one"]["pd"]["ratios"]["tt2t_p90"] == pytest.approx(1.4286)
    table = "\n".join(ttft.table_lines(r))
    assert "    20  one instance          100.0     100.0" in table
    assert ("   500  P/D (proxy)           500.0     500.0  1.250x     600.0     600.0  "
            "1.429x") in table
    first, second, pays = ttft.verdict_lines(r)
    assert first.startswith("P/D (proxy), 20 tokens: TTFT 102.0 ms, target <= 105.0")
    assert first.count(": ok") == 2
    assert "TT2T 600.0 ms, target <= 470.0 (one instance 420.0 + transfer 30.0 + a decode " \
           "step 20.0): OVER" in second
    assert pays == "P/D (proxy) is not faster than one instance at the longest prompt measured"


def test_where_pd_starts_to_pay_is_the_shortest_length_from_which_it_always_does() -> None:
    one, faster, slower = (summary(100.0, 120.0, 20.0), summary(90.0, 110.0, 20.0),
                           summary(110.0, 130.0, 20.0))
    r = report((20, one, slower), (50, one, faster), (120, one, slower), (500, one, faster),
               (1000, one, faster))
    assert ttft.pays_from(r, "pd") == 500  # not 50: at 120 it costs more again
    assert "--pd-min-tokens 500" in ttft.pays_line(r, "pd")


def test_lengths_parse_sorted_and_refuse_what_cannot_run() -> None:
    assert ttft.lengths("500,20, 120,20") == (20, 120, 500)
    for bad in ("1,20", "twenty", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            ttft.lengths(bad)


def test_a_prompt_past_the_models_context_is_refused_before_anything_starts() -> None:
    args = argparse.Namespace(model="kvxfer-tiny", lengths=(20, 2045), repeats=1, max_tokens=8)
    with pytest.raises(BenchError, match="2053 tokens, past kvxfer-tiny's context of 2048"):
        ttft.check_args(args)
    ttft.check_args(argparse.Namespace(**{**vars(args), "lengths": (20, 2040)}))
    assert ttft.num_blocks(2040, 8) == 256 and ttft.num_blocks(4000, 8) == 502


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = report((20, summary(100.0, 120.0, 20.0), summary(102.0, 140.0, 20.0, 5.0)),
               (500, summary(400.0, 420.0, 20.0), summary(500.0, 600.0, 21.0, 30.0)))
    path = tmp_path / "ttft.png"
    ttft.write_plot(r, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_end_to_end_with_real_sidecars_and_the_proxy(tmp_path: Path) -> None:
    """About 10 s on two busy cores: four tiny sidecars and two proxies (pull and push)
    start in parallel."""
    path = tmp_path / "ttft.json"
    done = preloaded.run(
        "kvxfer.cli", ["bench", "ttft", "--json", "--model", "kvxfer-tiny", "--lengths", "8,32",
                       "--repeats", "2", "--json-file", str(path), "--log-dir",
                       str(tmp_path / "logs")], ROOT, timeout=120)
    assert done.returncode == 0, f"{done.stderr[-3000:]}\nlogs in {tmp_path / 'logs'}"
    result = json.loads(done.stdout)
    assert result == json.loads(path.read_text())
    assert result["failed_requests"] == 0
    assert [row["prompt_tokens"] for row in result["lengths"]] == [8, 32]
    for row in result["lengths"]:
        assert set(row["modes"]) == {"one", "pd", "push", "deployed"}
        # as deployed, prompts this short go to the decode alone: it reads no KV
        assert (row["modes"]["deployed"]["transfer_ms"] or {}).get("p90", 0) == 0
        for mode, s in row["modes"].items():
            assert (s["requests"], s["failed"]) == (2, 0)
            for metric in (*METRICS, *(("transfer_ms",) if mode == "pd" else ())):
                assert s[metric]["p90"] >= s[metric]["p50"] > 0, (mode, metric)
            assert s["tt2t_ms"]["p50"] > s["ttft_ms"]["p50"]
        # push: the decode request's wait for KV that may have landed before it came
        assert row["modes"]["push"]["transfer_ms"]["p50"] >= 0
        assert row["modes"]["one"]["transfer_ms"] is None
        assert row["modes"]["one"]["read_wait_ms"] is None
        wait = row["modes"]["pd"]["read_wait_ms"]  # the decode's arrival to its READ's start
        assert wait["p99"] >= wait["p50"] > 0, wait
        versus = row["vs_one"]["pd"]
        assert all(v > 0 for v in versus["ratios"].values()) and len(versus["ratios"]) == 6
        assert {"ttft", "tt2t"} == set(versus["verdict"])
