"""Push plans, proven by executing them as byte copies against the reads they mirror.

Every decode rank and every prefill rank of a scenario get real host buffers. The
expectation is the pull path's: each decode rank's read descriptors
(:func:`build_read_descriptors`, proven in ``test_descriptors.py``) executed from the
prefill ranks. Then the decode buffers are put back and every prefill rank's push,
WRITTEN layer group by layer group, must leave them byte for byte the same.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.plan.descriptors import IncompatibleLayoutError, build_read_descriptors
from kvxfer.plan.layout import KVCacheLayout
from kvxfer.plan.pushes import PushRefused, layers_of, plan_pushes
from kvxfer.plan.topology import read_plan
from tests.test_descriptors import (
    Rank,
    block_sizes,
    execute,
    expect_compatible,
    kernel_ratio,
    make_rank,
    make_views_like,
    pick_ids,
    scenarios,
    spec_for,
)


def layer_groups(layers: int, cuts: list[int]) -> list[range]:
    """``range(layers)`` cut before each index in ``cuts``."""
    edges = [0, *sorted({c for c in cuts if 0 < c < layers}), layers]
    return [range(a, b) for a, b in itertools.pairwise(edges)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.lists(st.integers(1, 2), max_size=2), st.integers(0, 3))
def test_pushes_write_exactly_what_the_reads_would_read(s: dict, cuts: list[int],
                                                        cached: int) -> None:
    """Any layout pair, TP pair, block-size pair and kernel blocks; any cut of the layers
    into groups: the prefill ranks' WRITEs place the same bytes in every decode rank as
    the decode ranks' READs, and each decode rank waits for as many writers as it reads.
    Past a cached prefix of the decode's first blocks (its prefix cache), the WRITEs
    start inside a prefill block where those are larger, and leave the cached blocks
    as they were."""
    rng = np.random.default_rng(s["seed"])
    decode_bs, prefill_bs = block_sizes(s)
    decode_spec = spec_for(s, s["local_tp"], decode_bs)
    prefill_spec = spec_for(s, s["remote_tp"], prefill_bs)
    decode_kr = kernel_ratio(decode_spec, s["local_kernel"])
    prefill_kr = kernel_ratio(prefill_spec, s["remote_kernel"])
    decodes = {d: make_rank(decode_spec, s["local_layout"], s["local_blocks"], s["layers"],
                            s["separate_storage"] and s["local_layout"].is_layer_compact, rng,
                            decode_kr) for d in range(s["local_tp"])}
    prefills = {p: make_rank(prefill_spec, s["remote_layout"], s["remote_blocks"], s["layers"],
                             False, rng, prefill_kr) for p in range(s["remote_tp"])}
    small = min(decode_bs, prefill_bs)
    dr, pr = decode_bs // small, prefill_bs // small
    most = min(s["local_blocks"] * dr // pr if dr >= pr else s["local_blocks"],
               s["remote_blocks"] * pr // dr if pr >= dr else s["remote_blocks"])
    fine = 1 if s["ids"] == "single" else most if s["ids"] == "all" else \
        int(rng.integers(1, most + 1))
    decode_ids = pick_ids(s["ids"], -(-fine // dr), s["local_blocks"], rng)
    prefill_ids = pick_ids(s["ids"], -(-fine // pr), s["remote_blocks"], rng)
    full = all(x.count == decode_spec.num_kv_heads == prefill_spec.num_kv_heads
               for d in decodes for x in read_plan(d, s["local_tp"], s["remote_tp"], s["total"]))
    targets = {d: r.geometry for d, r in decodes.items()}
    kwargs = {"writer_tp": s["remote_tp"], "target_tp": s["local_tp"],
              "total_kv_heads": s["total"]}
    if not expect_compatible(s["local_layout"], s["remote_layout"], decode_spec, prefill_spec,
                             full, decode_kr, prefill_kr):
        with pytest.raises(IncompatibleLayoutError, match="layout"):
            for p, prefill in prefills.items():
                plan_pushes(p, prefill.geometry, targets, **kwargs)
        return

    before = {d: [raw.clone() for raw in r.buffers] for d, r in decodes.items()}
    for d, decode in decodes.items():
        slices = read_plan(d, s["local_tp"], s["remote_tp"], s["total"])
        geometries = {p: prefills[p].geometry for p in {x.remote_rank for x in slices}}
        for descs in build_read_descriptors(decode.geometry, geometries, slices, decode_ids,
                                            prefill_ids, local_tp=s["local_tp"],
                                            remote_tp=s["remote_tp"]):
            execute(decode, prefills[descs.remote_rank], descs.local, descs.remote)
    pulled = {d: [raw.clone() for raw in r.buffers] for d, r in decodes.items()}
    cached = min(cached, len(decode_ids) - 1)  # decode blocks its prefix cache holds
    for d, decode in decodes.items():
        for raw, old in zip(decode.buffers, before[d], strict=True):
            raw.copy_(old)
        kept = torch.from_numpy((decode_ids[:cached, None] * decode.ratio +
                                 np.arange(decode.ratio)).reshape(-1))
        for want, old in zip(make_views_like(decode, pulled[d]),
                             make_views_like(decode, before[d]), strict=True):
            want[kept] = old[kept]
    skip, offset = divmod(cached * decode_bs, prefill_bs)

    groups = layer_groups(s["layers"], cuts)
    writers: dict[int, int] = {}
    for p, prefill in prefills.items():
        for push in plan_pushes(p, prefill.geometry, targets, **kwargs):
            assert push.writer_rank == p
            writers[push.target_rank] = push.writers
            for layers in groups:
                rows = push.build(prefill_ids[skip:], decode_ids[cached:], layers, offset)
                assert rows.remote_rank == push.target_rank
                write(prefill, decodes[push.target_rank], rows.local, rows.remote)
    for d, decode in decodes.items():
        for got, want in zip(decode.buffers, pulled[d], strict=True):
            assert torch.equal(got, want), f"decode rank {d} differs from what a pull reads"
        reads_from = {x.remote_rank for x in read_plan(d, s["local_tp"], s["remote_tp"],
                                                       s["total"])}
        assert writers[d] == len(reads_from)


def write(source: Rank, target: Rank, source_rows: np.ndarray, target_rows: np.ndarray) -> None:
    """A WRITE is the reference executor's copy with the roles named the other way."""
    execute(target, source, target_rows, source_rows)


def test_a_layer_group_is_a_run_inside_the_layers() -> None:
    rank = make_rank(spec_for({"total": 2, "block_size": 2, "head_size": 2,
                               "dtype": torch.float32, "groups": False, "pad": 0,
                               "local_layout": KVCacheLayout.LBHNC,
                               "remote_layout": KVCacheLayout.LBHNC}, 1),
                     KVCacheLayout.LBHNC, 4, 3, False, np.random.default_rng(0))
    assert layers_of(rank.geometry, range(1, 3)).num_layers == 2
    for bad in (range(0), range(2, 4), range(-1, 1), range(0, 3, 2)):
        with pytest.raises(ValueError, match="layer group"):
            layers_of(rank.geometry, bad)


def test_a_pair_only_a_conversion_can_place_is_refused_with_the_fix() -> None:
    spec = {"total": 4, "block_size": 2, "head_size": 2, "dtype": torch.float32,
            "groups": False, "pad": 0, "local_layout": KVCacheLayout.LBHNC,
            "remote_layout": KVCacheLayout.LBNHC}
    rng = np.random.default_rng(1)
    decode = make_rank(spec_for(spec, 1), KVCacheLayout.LBHNC, 4, 2, False, rng)
    prefill = make_rank(spec_for(spec, 1), KVCacheLayout.LBNHC, 4, 2, False, rng)
    with pytest.raises(PushRefused, match="--kv-transfer-mode pull"):
        plan_pushes(0, prefill.geometry, {0: decode.geometry}, writer_tp=1, target_tp=1,
                    total_kv_heads=4)
