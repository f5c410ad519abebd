"""Push plans, proven by executing them as byte copies against the reads they mirror.

Every decode rank and every prefill rank of a scenario get real host buffers. The
expectation is the pull path's: each decode rank's read descriptors
(:func:`build_read_descriptors`, proven in ``test_descriptors.py``) executed from the
prefill ranks. Then the decode buffers are put back and every prefill rank's push,
WRITTEN layer group by layer group, must leave them byte for byte the same.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.plan.descriptors import IncompatibleLayoutError, build_requests_descriptors
from kvxfer.plan.layout import KVCacheLayout
from kvxfer.plan.pushes import ConvertedPush, PushRefused, layers_of, plan_pushes
from kvxfer.plan.staging import StagedRead, plan_reads
from kvxfer.plan.topology import read_plan
from tests.test_descriptors import (
    Rank,
    block_sizes,
    execute,
    expect_compatible,
    head_ranges,
    kernel_ratio,
    make_rank,
    make_views_like,
    pick_ids,
    scenarios,
    spec_for,
)
from tests.test_staging import run_staged


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
    the decode ranks' READs (converted ones included: converted pushes, from a shadow),
    and each decode rank waits for as many writers as it reads.
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
    converting = not expect_compatible(s["local_layout"], s["remote_layout"], decode_spec,
                                       prefill_spec, full, decode_kr, prefill_kr)
    if converting:
        with pytest.raises(IncompatibleLayoutError, match="layout"):
            for p, prefill in prefills.items():
                plan_pushes(p, prefill.geometry, targets, **kwargs)

    before = {d: [raw.clone() for raw in r.buffers] for d, r in decodes.items()}
    for d, decode in decodes.items():  # the reference: what a pull places
        slices = read_plan(d, s["local_tp"], s["remote_tp"], s["total"])
        geometries = {p: prefills[p].geometry for p in {x.remote_rank for x in slices}}
        for read in plan_reads(decode.geometry, geometries, slices, local_tp=s["local_tp"],
                               remote_tp=s["remote_tp"]):
            if isinstance(read, StagedRead):
                run_staged(decode, prefills[read.remote_rank], read, decode_ids, prefill_ids)
                continue
            (descs,) = build_requests_descriptors([read], decode_ids, prefill_ids)
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
        if converting:
            kwargs["converted"] = functools.partial(ConvertedPush.of, cache=prefill.views[0])
        for push in plan_pushes(p, prefill.geometry, targets, **kwargs):
            assert push.writer_rank == p
            assert isinstance(push, ConvertedPush) == converting
            writers[push.target_rank] = push.writers
            need = push.shadow_bytes(len(decode_ids[cached:]))
            assert (need > 0) == converting
            shadow = torch.full((need,), 7, dtype=torch.uint8)  # a former push's bytes
            source = SimpleNamespace(buffers=[*prefill.buffers, shadow])
            for layers in groups:
                rows = push.build(prefill_ids[skip:], decode_ids[cached:], layers, offset,
                                  shadow)
                assert rows.remote_rank == push.target_rank
                write(source, decodes[push.target_rank], rows.local, rows.remote)
    for d, decode in decodes.items():
        if converting:  # whole shadow blocks were written: past the prefill's last token,
            # zeros (the decode writes there as it generates), not a former request's heads
            targets_ids = decode_ids[cached:]
            paired = min(len(targets_ids) * decode_bs, len(prefill_ids[skip:]) * prefill_bs
                         - offset)
            tail = np.arange(paired, len(targets_ids) * decode_bs)
            kernel, row = decode.kernel_rows(targets_ids[tail // decode_bs], tail % decode_bs)
            for got, want in zip(make_views_like(decode, decode.buffers),
                                 make_views_like(decode, pulled[d]), strict=True):
                written = [h for x in read_plan(d, s["local_tp"], s["remote_tp"], s["total"])
                           for r, lo, n in head_ranges(decode_spec, prefill_spec,
                                                       x.remote_head_offset,
                                                       x.local_head_offset, x.count)
                           for h in range(lo, lo + n)]
                heads = torch.tensor(written)[None]
                assert (got[kernel[:, None], heads, row[:, None]] == 0).all(), \
                    "a converted push's tail is not zeros"
                got[kernel[:, None], heads, row[:, None]] = \
                    want[kernel[:, None], heads, row[:, None]]  # other heads: compared
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


@pytest.mark.parametrize(("converting", "apart", "says"), [
    (False, False, "--kv-transfer-mode pull"),
    # where this rank's layers lie in allocations of their own, its chunks are at no
    # fixed strides: refused, not converted from the wrong bytes
    (True, True, r"one allocation.*--kv-transfer-mode pull")])
def test_a_pair_only_a_conversion_can_place_is_refused_with_the_fix(
        converting: bool, apart: bool, says: str) -> None:
    """Without a conversion (plan_pushes alone), or with one that cannot read this rank's
    cache, a pair byte copies cannot place is refused, naming pull mode."""
    spec = {"total": 4, "block_size": 2, "head_size": 2, "dtype": torch.float32,
            "groups": False, "pad": 0, "local_layout": KVCacheLayout.LBHNC,
            "remote_layout": KVCacheLayout.LBNHC}
    rng = np.random.default_rng(1)
    decode = make_rank(spec_for(spec, 1), KVCacheLayout.LBHNC, 4, 2, False, rng)
    prefill = make_rank(spec_for(spec, 1), KVCacheLayout.LBNHC, 4, 2, apart, rng)
    converted = functools.partial(ConvertedPush.of, cache=prefill.views[0]) \
        if converting else None
    with pytest.raises(PushRefused, match=says):
        plan_pushes(0, prefill.geometry, {0: decode.geometry}, writer_tp=1, target_tp=1,
                    total_kv_heads=4, converted=converted)


@pytest.mark.parametrize(("prefill_packing", "decode_packing", "decode_layout", "ratios",
                          "sizes"), [
    ("vllm-cpu-vec", "token", "LBNHC", (1, 1), (4, 4)),
    ("token", "vllm-cpu-vec", "BLHNC", (1, 1), (4, 4)),
    ("vllm-cpu-vec", "vllm-cpu-vec", "LBHNC", (2, 1), (4, 4)),
    ("token", "vllm-cpu-vec", "LBHNC", (1, 1), (2, 8)),
    ("vllm-cpu-vec", "token", "LBNHC", (1, 1), (8, 2))])
def test_a_converted_push_repacks_k_and_v_as_a_converted_read_does(
        prefill_packing: str, decode_packing: str, decode_layout: str,
        ratios: tuple[int, int], sizes: tuple[int, int]) -> None:
    """Two packings of K and V (vLLM's CPU one, token), or one at two kernel block sizes
    (``ratios``: prefill's, decode's), or two block sizes (``sizes``): the push converts
    into its shadow, and every K and V element of the request's tokens lands where a
    converted read puts it."""
    from kvxfer.plan.layout import CacheSpec
    from tests.test_staging import token_kv

    rng = np.random.default_rng(3)
    prefill = make_rank(CacheSpec(sizes[0], 2, 3, torch.float32), KVCacheLayout.LBHNC, 24, 2,
                        False, rng, ratios[0])
    decode = make_rank(CacheSpec(sizes[1], 2, 3, torch.float32), KVCacheLayout[decode_layout],
                       20, 2, False, rng, ratios[1])
    writer = replace(prefill.geometry, kv_packing=prefill_packing)
    target = replace(decode.geometry, kv_packing=decode_packing)
    tokens = 11  # the last block of each side partly used
    dids = np.array([4, 0, 2, 19, 7, 11])[:-(-tokens // sizes[1])]
    pids = np.array([1, 5, 3, 23, 8, 12])[:-(-tokens // sizes[0])]
    (push,) = plan_pushes(0, writer, {0: target}, writer_tp=1, target_tp=1, total_kv_heads=2,
                          converted=functools.partial(ConvertedPush.of,
                                                      cache=prefill.views[0]))
    assert isinstance(push, ConvertedPush)
    shadow = torch.full((push.shadow_bytes(len(dids)),), 7, dtype=torch.uint8)  # used
    for layers in (range(0, 1), range(1, 2)):
        rows = push.build(pids, dids, layers, 0, shadow)
        write(SimpleNamespace(buffers=[shadow]), decode, rows.local, rows.remote)
    count = min(len(dids) * sizes[1], len(pids) * sizes[0])  # tokens paired
    end = len(dids) * sizes[1]  # past the paired tokens, the written blocks hold zeros
    for layer in range(2):
        for got, want in zip(token_kv(decode.views[layer], ratios[1], dids, decode_packing),
                             token_kv(prefill.views[layer], ratios[0], pids, prefill_packing),
                             strict=True):
            assert torch.equal(got[:, :count], want[:, :count])
            assert (got[:, count:end] == 0).all(), "a tail is not zeros"

