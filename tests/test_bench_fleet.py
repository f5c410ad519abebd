"""``kvxfer bench fleet``: its stream of chats (what the prompts share is what it states), the
replay's ordering, figures, table and plot from fixed inputs, and one run as a user starts it
(real sidecars and proxies, kvxfer-tiny, two policies)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sidecars import ROOT

from kvxfer.bench import fleet
from kvxfer.bench.serving import BenchError
from kvxfer.harness import preloaded

CHATS = fleet.Chats(sessions=5, turns=3, systems=2, system_tokens=40, user_tokens=7,
                    answer_tokens=3, seed=1)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_stream_is_turn_major_each_session_once_a_turn_and_seeded() -> None:
    turns = fleet.build_stream(CHATS)
    assert [t.turn for t in turns] == [k for k in range(3) for _ in range(5)]
    for k in range(3):
        assert sorted(t.session for t in turns if t.turn == k) == list(range(5))
    assert fleet.build_stream(CHATS) == turns
    other = fleet.build_stream(fleet.Chats(**{**CHATS.__dict__, "seed": 2}))
    assert [t.prompt for t in other] != [t.prompt for t in turns]
    assert all(t.prompt[0] == fleet.START and max(t.prompt) < 128 for t in turns)


def test_a_turn_is_its_sessions_previous_prompt_then_an_answer_filler_and_its_user_part(
) -> None:
    prompts = {(t.session, t.turn): t.prompt for t in fleet.build_stream(CHATS)}
    for (session, turn), prompt in prompts.items():
        assert len(prompt) == 40 + 7 * (turn + 1) + 3 * turn
        if turn:
            before = prompts[session, turn - 1]
            assert prompt[:len(before)] == before
            assert prompt[len(before):len(before) + 3] == (fleet.ANSWER_ID,) * 3


def test_sessions_share_exactly_their_system_prompt_and_others_less_than_a_block() -> None:
    prompts = {(t.session, t.turn): t.prompt for t in fleet.build_stream(CHATS)}
    for a in range(5):
        for b in range(a + 1, 5):
            shared = common_prefix(prompts[a, 2], prompts[b, 2])
            if a % 2 == b % 2:  # one system prompt: 40 tokens, then their own user parts
                assert shared == 40, (a, b)
            else:
                assert shared < fleet.BLOCK_SIZE, (a, b)


def test_the_stated_share_is_what_each_prompt_shares_with_those_sent_before_it() -> None:
    turns = fleet.build_stream(CHATS)
    block = 16
    found = fleet.stream_shares(turns, block)
    lcps = [max((common_prefix(t.prompt, e.prompt) for e in turns[:i]), default=0)
            for i, t in enumerate(turns)]
    lengths = [len(t.prompt) for t in turns]
    assert found == {
        "prompts": 15, "prompt_tokens": sum(lengths), "shared_tokens": sum(lcps),
        "looked_up_tokens": sum(lengths) - 15,
        "cacheable_tokens": sum(min(s // block * block, n - 1)
                                for s, n in zip(lcps, lengths, strict=True)),
        "new_blocks": sum(-(-n // block) - s // block for s, n in zip(lcps, lengths,
                                                                       strict=True))}
    # 3 sessions on system 0, 2 on system 1: each system's later sessions share all of it;
    # each later turn shares its session's previous prompt
    assert found["shared_tokens"] >= 3 * 40 + 10 * (40 + 7)


def test_the_blocks_hold_the_whole_stream_beside_the_requests_in_flight() -> None:
    turns = fleet.build_stream(CHATS)
    assert fleet.num_blocks(turns, CHATS, 4) == 256  # kvxfer serve's default at least
    big = fleet.Chats(12, 6, 2, 900, 64, 16, 0)
    turns = fleet.build_stream(big)
    longest = 900 + 6 * 64 + 5 * 16 + 16
    assert fleet.num_blocks(turns, big, 3) == (fleet.stream_shares(turns, 16)["new_blocks"]
                                               + 2 * 3 * -(-longest // 16))


def test_replay_keeps_the_bound_and_each_sessions_order_and_goes_on_past_a_failure() -> None:
    turns = fleet.build_stream(fleet.Chats(4, 3, 1, 8, 2, 2, 0))
    lock = threading.Lock()
    in_flight, most, ended = [0], [0], {}

    def send(turn: fleet.Turn) -> tuple[float, list[float]]:
        if turn.turn:
            assert (turn.session, turn.turn - 1) in ended, "sent before its previous turn ended"
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.01)
        with lock:
            in_flight[0] -= 1
            ended[turn.session, turn.turn] = True
        if (turn.session, turn.turn) == (1, 0):
            raise fleet.RequestFailed("refused")
        now = time.perf_counter()
        return now - 0.01, [now, now + 0.001]

    counts: list[int] = []
    outcomes, wall = fleet.replay(turns, send, 2, counts.append)
    assert most[0] == 2 and counts == list(range(1, 13)) and wall > 0
    assert len(ended) == 12
    [failed] = [o for o in outcomes if o.error]
    assert (failed.turn.session, failed.turn.turn) == (1, 0) and "refused" in failed.error


def outcomes(ttfts_ms: list[float]) -> list[fleet.Outcome]:
    turn = fleet.Turn(0, 0, (1, 2, 3))
    return [fleet.Outcome(turn, 0.0, (t / 1000, t / 1000 + 0.01, t / 1000 + 0.03))
            for t in ttfts_ms]


def used(role: str, queries: float, hits: float, read: float = 0.0) -> dict[str, dict[str, float]]:
    return {f"{role}-{i}": {fleet.QUERIES: queries / 2, fleet.HITS: hits / 2,
                            fleet.BYTES: read / 2} for i in range(2)}


def fixed_report() -> dict[str, Any]:
    kv = fleet.figures(outcomes([10, 20, 30]), 2.0,
                       {**used("prefill", 300, 200), **used("decode", 300, 250, 2**20)},
                       {"pd": {"pays": 3.0}})
    rr = fleet.figures([*outcomes([20, 40]), fleet.Outcome(fleet.Turn(1, 0, (1,)), 0.0,
                                                           error="502")], 4.0,
                       {**used("prefill", 300, 100), **used("decode", 300, 100, 2**21)},
                       {"pd": {"pays": 3.0}})
    one = fleet.figures(outcomes([15]), 1.0, used("both", 100, 50), None)
    configs = {"kv_aware": kv, "round_robin": rr, "aggregated": one}
    fleet.with_ratios(configs, "round_robin")
    config = {"model": "kvxfer-tiny", "sessions": 2, "turns": 2, "systems": 1,
              "system_tokens": 64, "user_tokens": 16, "max_tokens": 3, "concurrency": 1,
              "seed": 0, "num_blocks": 256, "configs": list(configs), "block_size": 16}
    stream = {"prompts": 3, "prompt_tokens": 300, "shared_tokens": 150,
              "looked_up_tokens": 297, "cacheable_tokens": 144, "new_blocks": 12}
    return {"config": config, "stream": stream, "baseline": "round_robin", "configs": configs,
            "failed_requests": 1}


def test_figures_and_ratios_from_fixed_outcomes_and_counters() -> None:
    configs = fixed_report()["configs"]
    kv, rr, one = configs["kv_aware"], configs["round_robin"], configs["aggregated"]
    assert (kv["requests"], kv["failed"], kv["output_tokens"]) == (3, 0, 9)
    assert (kv["ttft_p50_ms"], kv["ttft_p90_ms"], kv["itl_p50_ms"]) == (20.0, 28.0, 15.0)
    assert (kv["requests_per_s"], kv["output_tokens_per_s"]) == (1.5, 4.5)
    assert (kv["prefill_tokens_computed"], kv["decode_tokens_uncached"]) == (100, 50)
    assert (kv["kv_bytes_read"], kv["prefix_hit_rate"]) == (2**20, 0.75)
    assert (kv["pd_requests"], kv["decode_only_requests"]) == (3, 0)
    assert (rr["failed"], rr["requests_per_s"]) == (1, 0.5)
    assert rr["first_error"] == "session 1 turn 0: 502"
    assert kv["ratios"]["prefill_tokens_computed"] == 0.5
    assert kv["ratios"]["kv_bytes_read"] == 0.5
    assert {v for v in rr["ratios"].values() if v is not None} == {1.0}
    assert rr["ratios"]["decode_only_requests"] is None  # 0 of 0
    assert one["prefill_tokens_computed"] == 50 and one["decode_tokens_uncached"] is None
    assert one["kv_bytes_read"] is None and one["ratios"]["pd_requests"] is None
    assert one["routed"] is None


def test_the_table_names_the_stream_and_every_configuration() -> None:
    lines = fleet.table_lines(fixed_report())
    text = "\n".join(lines)
    assert "2 sessions x 2 turns = 3 requests" in text and "session affinity" in text
    assert "prefix share: 50.0% of its 300 prompt tokens" in text
    assert "could hit at most 48.5%" in text
    assert ["kv_aware", "round_robin", "aggregated"] in [line.split() for line in lines]
    row = next(line for line in lines if line.startswith("prefill tokens computed"))
    assert row.split()[3:] == ["100", "(", "0.50x)", "200", "(", "1.00x)", "50", "(", "0.25x)"]
    assert lines[-1] == "first failure, round_robin: session 1 turn 0: 502"


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "fleet.png"
    fleet.write_plot(fixed_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def args(**given: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fleet.add_arguments(parser)
    parsed = parser.parse_args([])
    for name, value in given.items():
        setattr(parsed, name, value)
    return parsed


def test_arguments_that_cannot_run_are_refused_before_anything_starts() -> None:
    for bad, message in (({"sessions": 0}, "--sessions 0"), ({"max_tokens": 1}, "--max-tokens 1"),
                         ({"systems": 7}, "--systems 7 is more than --sessions 6"),
                         ({"configs": "kv_aware,nope"}, "unknown nope"),
                         ({"system_tokens": 2100}, "past kvxfer-tiny's context of 2048")):
        with pytest.raises(BenchError, match=message):
            fleet.check_args(args(**bad))
    given = args(configs="round_robin,kv_aware,round_robin")
    turns = fleet.check_args(given)
    assert given.configs == ["round_robin", "kv_aware"] and len(turns) == 24
    assert given.num_blocks == fleet.num_blocks(turns, fleet.Chats(6, 4, 2, 400, 32, 8, 0), 4)


def test_the_command_lines_parse_with_this_trees_parsers() -> None:
    import proxy.__main__
    from kvxfer.cli import build_parser

    names = ["prefill-0", "prefill-1", "decode-0", "decode-1", "proxy"]
    port = {name: 100 + i for i, name in enumerate(names)}
    for name, setup in fleet.CONFIGS.items():
        argvs = fleet.argvs(setup, "kvxfer-tiny", 300, {**port, **{f"both-{i}": 200 + i
                                                                   for i in range(4)}})
        for sidecar in fleet.sidecar_names(setup):
            parsed = build_parser().parse_args(argvs[sidecar][3:])  # after python -m kvxfer.cli
            assert (parsed.role, parsed.num_blocks, parsed.enable_prefix_caching) == (
                sidecar.split("-")[0], 300, True)
            assert parsed.kv_events_port == (None if setup.policy is None else 0)
        if setup.policy is None:
            assert "proxy" not in argvs
            continue
        parsed = proxy.__main__.build_parser().parse_args(argvs["proxy"][3:])
        assert (parsed.prefiller_ports, parsed.decoder_ports) == ([100, 101], [102, 103])
        assert parsed.policy == setup.policy, name
        assert (parsed.pd_min_tokens == 0) == (not setup.split), name


@pytest.mark.heavy  # ten processes started one configuration after the other: ~25 s
def test_a_run_of_two_policies_on_real_sidecars(tmp_path: Path) -> None:
    """Two sessions sharing a system prompt, two turns each, one request at a time: every
    answer comes, and kv_aware computes no more than round robin."""
    path = tmp_path / "fleet.json"
    done = preloaded.run(
        "kvxfer.cli", ["bench", "fleet", "--json", "--model", "kvxfer-tiny", "--sessions", "2",
                       "--turns", "2", "--systems", "1", "--system-tokens", "64",
                       "--user-tokens", "16", "--max-tokens", "4", "--concurrency", "1",
                       "--configs", "kv_aware,round_robin", "--json-file", str(path),
                       "--log-dir", str(tmp_path / "logs")], ROOT, timeout=180)
    assert done.returncode == 0, f"{done.stderr[-3000:]}\nlogs in {tmp_path / 'logs'}"
    report = json.loads(done.stdout)
    assert report == json.loads(path.read_text())
    assert report["failed_requests"] == 0 and report["baseline"] == "round_robin"
    stream = report["stream"]
    assert stream["prompts"] == 4 and stream["prompt_tokens"] == 2 * (64 + 16) + 2 * (64 + 36)
    configs = report["configs"]
    assert list(configs) == ["kv_aware", "round_robin"]
    for name, r in configs.items():
        assert (r["requests"], r["failed"], r["output_tokens"]) == (4, 0, 16), name
        assert r["ttft_p90_ms"] >= r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0, name
        assert (r["pd_requests"], r["decode_only_requests"]) == (4, 0), name
        assert r["kv_bytes_read"] > 0 and r["requests_per_s"] > 0, name
        # a prefill computes at least what no earlier prompt began with, at most everything
        unshared = stream["looked_up_tokens"] - stream["cacheable_tokens"]
        assert unshared <= r["prefill_tokens_computed"] <= stream["looked_up_tokens"], name
    kv, rr = configs["kv_aware"], configs["round_robin"]
    assert rr["prefill_tokens_computed"] >= kv["prefill_tokens_computed"]
    assert kv["prefix_hit_rate"] > 0
    assert {v for v in rr["ratios"].values() if v is not None} == {1.0}
