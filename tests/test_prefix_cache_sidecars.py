"""A decode with ``--enable-prefix-caching``, for real: sidecar processes on loopback.

A warm decode reads from the prefill only the blocks past its cached prefix (the
bytes say so exactly), also when the two block sizes differ; when it holds every
token it needs it reads nothing and releases the lease at once; the answers are
those of a plain reference instance either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sidecars import Sidecar, SidecarGroup, Spec, disaggregated

CACHE = ("--enable-prefix-caching",)
PAIRS = [(16, 16), (16, 32), (32, 16)]  # (prefill block size, decode block size)


@pytest.fixture(scope="module")
def group(plain: Sidecar, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, Sidecar]]:
    """Prefills and caching decodes of both block sizes; the reference is the run's shared
    ``both`` (``shared_servers.py``)."""
    with SidecarGroup(tmp_path_factory.mktemp("prefix")) as sidecars:
        names = ["prefill-16", "prefill-32", "decode-16", "decode-32"]
        started = sidecars.start([
            Spec("prefill", block_size=16), Spec("prefill", block_size=32),
            Spec("decode", policy="fail", block_size=16, extra=CACHE),
            Spec("decode", policy="fail", block_size=32, extra=CACHE)])
        yield {**dict(zip(names, started, strict=True)), "reference": plain}


def body(prompt: list[int], n: int = 1) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1,
            "ignore_eos": True, "n": n}


def counters(decode: Sidecar) -> dict[str, float]:
    return {name: decode.metric(f"kvxfer_{name}_total") for name in
            ("kv_transfer_bytes", "kv_reads_skipped", "prefix_cache_queries",
             "prefix_cache_hits")}


def ask(group: dict[str, Sidecar], pair: tuple[int, int], prompt: list[int],
        n: int = 1) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The decode's choices for ``prompt`` (checked against the reference's) and what
    its counters moved by."""
    decode = group[f"decode-{pair[1]}"]
    before = counters(decode)
    _, answer = disaggregated(group[f"prefill-{pair[0]}"], decode, "/v1/completions",
                              body(prompt, n))
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    want = group["reference"].post("/v1/completions", body(prompt, n)).json()["choices"]
    for got, expected in zip(choices, want, strict=True):
        assert got["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(
            expected["logprobs"]["token_logprobs"], abs=1e-4)
    after = counters(decode)
    return choices, {k: after[k] - before[k] for k in after}


def tokens(seed: int, count: int) -> list[int]:
    """``count`` token ids of the byte vocabulary, different for every seed."""
    return [1 + (seed * 131 + 7 * i) % 250 for i in range(count)]


@pytest.mark.parametrize("pair", PAIRS, ids=[f"block{p}-to-block{d}" for p, d in PAIRS])
def test_a_warm_decode_reads_only_the_blocks_past_its_cached_prefix(
        group: dict[str, Sidecar], pair: tuple[int, int]) -> None:
    system = tokens(sum(pair), 200)  # a system prompt of its own per case
    first, second = system + tokens(1, 37), system + tokens(2, 45)
    _, cold = ask(group, pair, first)
    assert cold["prefix_cache_hits"] == 0 and cold["kv_transfer_bytes"] > 0
    _, warm = ask(group, pair, second)
    cached = 192  # of the 200 shared tokens: 6 blocks of 32, 12 of 16
    assert warm["prefix_cache_hits"] == cached
    # every prompt token: the decode continues from the prefill's first token
    assert warm["prefix_cache_queries"] == len(second)
    # bytes are counted at the smaller block size: per such block, the same
    fine = min(pair)
    per_block = cold["kv_transfer_bytes"] / -(-len(first) // fine)
    assert warm["kv_transfer_bytes"] == per_block * (-(-len(second) // fine) - cached // fine)
    assert warm["kv_reads_skipped"] == 0


# (prompt tokens, n): the decode needs 64 tokens, whole blocks of both sizes: all but the
# last of 65 when it samples the first token itself (n > 1), all 64 when it continues from
# the prefill's
FULL_HITS = [(65, 2), (64, 1)]


@pytest.mark.parametrize("pair", PAIRS, ids=[f"block{p}-to-block{d}" for p, d in PAIRS])
@pytest.mark.parametrize("length, n", FULL_HITS, ids=[f"{k}-tokens-n{n}" for k, n in FULL_HITS])
def test_a_full_hit_reads_nothing_and_frees_the_lease_at_once(
        group: dict[str, Sidecar], pair: tuple[int, int], length: int, n: int) -> None:
    prompt = tokens(10 + sum(pair) + length, length)
    prefill = group[f"prefill-{pair[0]}"]
    ask(group, pair, prompt)
    released = {reason: prefill.metric("kvxfer_kv_leases_released_total", reason=reason)
                for reason in ("cached", "abandoned")}
    choices, warm = ask(group, pair, prompt, n=n)  # siblings start from the cached KV too
    assert len(choices) == n
    assert warm["kv_reads_skipped"] == 1 and warm["kv_transfer_bytes"] == 0
    assert warm["prefix_cache_hits"] == 64 * n  # every sample found all 64
    prefill.wait_for("its lease released", lambda h: h["leases"] == 0, timeout=10)
    assert {reason: prefill.metric("kvxfer_kv_leases_released_total", reason=reason)
            for reason in released} == {"cached": released["cached"] + 1,
                                        "abandoned": released["abandoned"]}, \
        "a full prefix hit is reported as one, not as a lease abandoned"


def test_health_and_metrics_say_whether_the_cache_is_on(group: dict[str, Sidecar]) -> None:
    assert group["decode-16"].health()["prefix_caching"] is True
    assert group["prefill-16"].health()["prefix_caching"] is False
    assert group["prefill-16"].metric("kvxfer_prefix_cache_queries_total") == 0
    assert group["decode-16"].metric("kvxfer_prefix_cache_blocks") > 0
