"""Descriptor math, proven by executing the descriptors as byte copies.

A test-only reference executor copies ``len`` bytes from each remote row's
address to the paired local row's address inside real host buffers. The
expected result is computed independently, by assigning through the torch
views head by head; the minimal descriptor count is computed independently by
merging per-token rows (the finest unit every layout keeps contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.descriptors import (
    IncompatibleLayoutError,
    SideGeometry,
    build_read_descriptors,
    validate_plan,
)
from kvxfer.layout import CacheSpec, KVCacheLayout, allocate_kv_cache
from kvxfer.regions import RegionPlan, plan_regions
from kvxfer.topology import heads_per_rank, read_plan

LAYOUTS = list(KVCacheLayout)
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2)]


@dataclass
class Rank:
    """One TP rank's cache: buffers (one per storage), views, plan, geometry."""

    buffers: list[torch.Tensor]
    views: list[torch.Tensor]
    plan: RegionPlan
    geometry: SideGeometry


def make_rank(spec: CacheSpec, layout: KVCacheLayout, num_blocks: int, layers: int,
              separate_storage: bool, rng: np.random.Generator) -> Rank:
    if separate_storage:
        pairs = [allocate_kv_cache(spec, num_blocks, 1, layout) for _ in range(layers)]
        buffers = [raw for raw, _ in pairs]
        views = [v[0] for _, v in pairs]
    else:
        raw, views = allocate_kv_cache(spec, num_blocks, layers, layout)
        buffers = [raw]
    for raw in buffers:
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
    caches = {f"layer.{i}": v for i, v in enumerate(views)}
    if layers > 1:
        caches["shared.alias"] = views[0]  # a shared layer appears once
    plan = plan_regions(caches, spec, num_blocks, layout)
    return Rank(buffers, views, plan, SideGeometry.from_plan(plan))


def locate(buffers: list[torch.Tensor], addr: int, length: int) -> tuple[np.ndarray, int]:
    for raw in buffers:
        start = raw.data_ptr()
        if start <= addr and addr + length <= start + raw.numel():
            return raw.numpy(), addr - start
    raise AssertionError(f"descriptor [{addr:#x}, +{length}) is outside every registered buffer")


def execute(local: Rank, remote: Rank, local_descs: np.ndarray, remote_descs: np.ndarray) -> None:
    """The reference executor: one memcpy per descriptor row."""
    assert local_descs.dtype == np.uint64 and local_descs.shape[1] == 3
    assert (local_descs[:, 1] == remote_descs[:, 1]).all()
    for (laddr, length, _), (raddr, _, _) in zip(local_descs.tolist(), remote_descs.tolist(),
                                                 strict=True):
        dst, doff = locate(local.buffers, laddr, length)
        src, soff = locate(remote.buffers, raddr, length)
        dst[doff:doff + length] = src[soff:soff + length]


def head_ranges(spec_local: CacheSpec, spec_remote: CacheSpec, roff: int, loff: int,
                count: int) -> list[tuple[int, int, int]]:
    """(remote H index, local H index, count) of the view heads a KV-head slice covers."""
    out = [(roff, loff, count)]
    if spec_local.separate_kv_head_groups:
        out.append((spec_remote.num_kv_heads + roff, spec_local.num_kv_heads + loff, count))
    return out


def token_rows(rank: Rank, layer: int, block: int, head: int) -> list[tuple[int, int]]:
    """(address, bytes) of each token's content row of one head: contiguous in every layout."""
    view = rank.views[layer]
    row = view.shape[3] * view.element_size()
    return [(view[block, head, n].data_ptr(), row) for n in range(view.shape[2])]


def minimal_count(local: Rank, remote: Rank, rows: list[tuple[int, int, int, int]]) -> int:
    """Merge finest rows (laddr, raddr, len, memory ids) sorted by local address."""
    def storage(rank: Rank, addr: int) -> int:
        for i, raw in enumerate(rank.buffers):
            if raw.data_ptr() <= addr < raw.data_ptr() + raw.numel():
                return i
        raise AssertionError("row outside buffers")

    rows = sorted(rows)
    count, prev = 0, None
    for laddr, raddr, length, _ in rows:
        key = (storage(local, laddr), storage(remote, raddr))
        if prev is None or not (laddr == prev[0] and raddr == prev[1] and key == prev[2]):
            count += 1
        prev = (laddr + length, raddr + length, key)
    return count


def expect_compatible(local_layout: KVCacheLayout, remote_layout: KVCacheLayout,
                      local_spec: CacheSpec, remote_spec: CacheSpec, full: bool) -> bool:
    # One head, or one token per block, makes H-vs-N order invisible.
    local_contig = local_layout.heads_outside_tokens or local_spec.num_heads == 1 \
        or local_spec.block_size == 1
    remote_contig = remote_layout.heads_outside_tokens or remote_spec.num_heads == 1 \
        or remote_spec.block_size == 1
    if local_contig != remote_contig:
        return False
    return full or remote_contig


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    local_tp, remote_tp = draw(st.sampled_from(TP_PAIRS))
    total = draw(st.sampled_from([h for h in (1, 2, 4, 8)
                                  if all((h % t == 0) if h >= t else (t % h == 0)
                                         for t in (local_tp, remote_tp))]))
    dtype = draw(st.sampled_from([torch.float16, torch.float32]))
    return {
        "local_tp": local_tp, "remote_tp": remote_tp, "total": total, "dtype": dtype,
        "local_rank": draw(st.integers(0, local_tp - 1)),
        "local_layout": draw(st.sampled_from(LAYOUTS)),
        "remote_layout": draw(st.sampled_from(LAYOUTS)),
        "block_size": draw(st.sampled_from([1, 2, 4])),
        # the other side's blocks are ratio x larger (decode larger when positive)
        "ratio": draw(st.sampled_from([1, 1, 1, 2, 3, -2, -3])),
        "head_size": draw(st.sampled_from([1, 2, 3])),
        "pad": draw(st.sampled_from([0, 0, 4, 16])),
        "groups": draw(st.booleans()),
        "layers": draw(st.integers(1, 3)),
        "local_blocks": draw(st.integers(1, 9)),
        "remote_blocks": draw(st.integers(1, 9)),
        "separate_storage": draw(st.booleans()),
        "ids": draw(st.sampled_from(["random", "sorted", "consecutive", "single", "all"])),
        "seed": draw(st.integers(0, 2**31)),
    }


def block_sizes(s: dict) -> tuple[int, int]:
    """(decode, prefill) block sizes of a scenario."""
    ratio = s.get("ratio", 1)
    bigger = s["block_size"] * abs(ratio)
    return (bigger, s["block_size"]) if ratio > 0 else (s["block_size"], bigger)


def spec_for(s: dict, tp: int, block_size: int | None = None) -> CacheSpec:
    kv = heads_per_rank(tp, s["total"])
    size = s["block_size"] if block_size is None else block_size
    real = CacheSpec(size, kv, s["head_size"], s["dtype"],
                     separate_kv_head_groups=s["groups"]).real_page_size_bytes
    padded = real + s["pad"] if s["pad"] else None
    return CacheSpec(size, kv, s["head_size"], s["dtype"], padded, s["groups"])


def pick_ids(kind: str, count: int, limit: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "single":
        return np.array([int(rng.integers(0, limit))])
    if kind in ("consecutive", "all"):
        start = int(rng.integers(0, limit - count + 1))
        return np.arange(start, start + count)
    ids = rng.choice(limit, size=count, replace=False)
    return np.sort(ids) if kind == "sorted" else ids


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_descriptors_copy_exactly_the_planned_heads(s: dict) -> None:
    """Any layout pair, TP pair and block-size pair (one a multiple of the other): the
    descriptors copy exactly the planned heads of every token, as few as possible."""
    rng = np.random.default_rng(s["seed"])
    local_bs, remote_bs = block_sizes(s)
    local_spec = spec_for(s, s["local_tp"], local_bs)
    remote_spec = spec_for(s, s["remote_tp"], remote_bs)
    storage = s["separate_storage"]
    local = make_rank(local_spec, s["local_layout"], s["local_blocks"], s["layers"],
                      storage and s["local_layout"].is_layer_compact, rng)
    plan = read_plan(s["local_rank"], s["local_tp"], s["remote_tp"], s["total"])
    remotes = {piece.remote_rank: make_rank(remote_spec, s["remote_layout"], s["remote_blocks"],
                                            s["layers"], False, rng) for piece in plan}
    small = min(local_bs, remote_bs)
    lr, rr = local_bs // small, remote_bs // small  # blocks per larger block: one is 1
    # f blocks on the smaller-block side, ceil(f / ratio) on the other
    most = min(s["local_blocks"] * lr // rr if lr >= rr else s["local_blocks"],
               s["remote_blocks"] * rr // lr if rr >= lr else s["remote_blocks"])
    fine = 1 if s["ids"] == "single" else most if s["ids"] == "all" else \
        int(rng.integers(1, most + 1))
    counts = (-(-fine // lr), -(-fine // rr))
    local_ids = pick_ids(s["ids"], counts[0], s["local_blocks"], rng)
    remote_ids = pick_ids(s["ids"], counts[1], s["remote_blocks"], rng)
    full = all(p.count == local_spec.num_kv_heads == remote_spec.num_kv_heads for p in plan)
    geometries = {rank: r.geometry for rank, r in remotes.items()}
    if not expect_compatible(s["local_layout"], s["remote_layout"], local_spec, remote_spec, full):
        with pytest.raises(IncompatibleLayoutError, match="layout"):
            build_read_descriptors(local.geometry, geometries, plan, local_ids, remote_ids,
                                   local_tp=s["local_tp"], remote_tp=s["remote_tp"])
        return
    result = build_read_descriptors(local.geometry, geometries, plan, local_ids, remote_ids,
                                    local_tp=s["local_tp"], remote_tp=s["remote_tp"])
    assert sorted(r.remote_rank for r in result) == sorted(remotes)

    # position p of the smaller-block side: (local block, first token, remote block, first token)
    spans = [(int(local_ids[p // lr]), (p % lr) * small, int(remote_ids[p // rr]),
              (p % rr) * small) for p in range(fine)]
    expected = [raw.clone() for raw in local.buffers]
    expected_views = [v for v in make_views_like(local, expected)]
    for piece in plan:
        remote = remotes[piece.remote_rank]
        rows = []
        for rh, lh, n in head_ranges(local_spec, remote_spec, piece.remote_head_offset,
                                     piece.local_head_offset, piece.count):
            for layer in range(s["layers"]):
                for lb, lt, rb, rt in spans:
                    expected_views[layer][lb, lh:lh + n, lt:lt + small] = \
                        remote.views[layer][rb, rh:rh + n, rt:rt + small]
                    for h in range(n):
                        lrows = token_rows(local, layer, lb, lh + h)[lt:lt + small]
                        rrows = token_rows(remote, layer, rb, rh + h)[rt:rt + small]
                        rows += [(la, ra, ln, 0) for (la, ln), (ra, _) in zip(lrows, rrows,
                                                                              strict=True)]
        descs = next(r for r in result if r.remote_rank == piece.remote_rank)
        assert descs.local.dtype == np.uint64 and descs.remote.dtype == np.uint64
        assert len(descs) == minimal_count(local, remote, rows)
        assert descs.num_bytes == sum(length for _, _, length, _ in rows)
        execute(local, remote, descs.local, descs.remote)
    for got, want in zip(local.buffers, expected, strict=True):
        assert torch.equal(got, want), "decode buffer differs from the view-level expectation"


def make_views_like(rank: Rank, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same views as ``rank.views`` but over copies of its buffers."""
    out = []
    for view in rank.views:
        for raw, copy in zip(rank.buffers, buffers, strict=True):
            start = raw.data_ptr()
            if start <= view.data_ptr() < start + raw.numel():
                typed = copy.view(view.dtype)
                offset = (view.data_ptr() - start) // view.element_size()
                out.append(torch.as_strided(typed, view.shape, view.stride(), offset))
    return out


def llama_like(layout: KVCacheLayout, tp: int = 1) -> Rank:
    spec = CacheSpec(16, heads_per_rank(tp, 8), 128, torch.bfloat16)
    return make_rank(spec, layout, 40, 32, False, np.random.default_rng(0))


@pytest.mark.parametrize(("layout", "expected"), [
    (KVCacheLayout.LBHNC, 32 * 16), (KVCacheLayout.LBNHC, 32 * 16),
    (KVCacheLayout.BLHNC, 16), (KVCacheLayout.BLNHC, 16), (KVCacheLayout.BHLNC, 16)])
def test_cross_layer_layouts_coalesce_a_block_into_one_descriptor(layout: KVCacheLayout,
                                                                   expected: int) -> None:
    rank = llama_like(layout)
    ids = np.arange(0, 32, 2)  # no two ids adjacent: no run merging
    (descs,) = build_read_descriptors(rank.geometry, {0: rank.geometry},
                                      read_plan(0, 1, 1, 8), ids, ids)
    assert len(descs) == expected
    assert descs.num_bytes == 16 * 32 * 16 * 8 * 256 * 2


def test_consecutive_block_ids_merge_into_one_descriptor() -> None:
    rank = llama_like(KVCacheLayout.BLHNC)
    (descs,) = build_read_descriptors(rank.geometry, {0: rank.geometry},
                                      read_plan(0, 1, 1, 8), np.arange(10, 20), np.arange(5, 15))
    assert len(descs) == 1 and int(descs.local[0, 1]) == 10 * 32 * 16 * 8 * 256 * 2


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC])
def test_head_split_on_tokens_outside_heads_layout_names_the_fix(layout: KVCacheLayout) -> None:
    local = llama_like(KVCacheLayout.LBHNC, tp=2)
    remote = llama_like(layout, tp=1)
    with pytest.raises(IncompatibleLayoutError,
                       match=f"prefill layout {layout.name} cannot be head-split for decode TP 2 "
                             f"> prefill TP 1; use LBHNC, BLHNC or BHLNC on the prefill side"):
        build_read_descriptors(local.geometry, {0: remote.geometry}, read_plan(0, 2, 1, 8),
                               [0], [0], local_tp=2, remote_tp=1)


def test_mismatched_head_order_is_refused_even_at_equal_tp() -> None:
    local, remote = llama_like(KVCacheLayout.LBHNC), llama_like(KVCacheLayout.LBNHC)
    with pytest.raises(IncompatibleLayoutError, match="LBHNC and prefill layout LBNHC"):
        build_read_descriptors(local.geometry, {0: remote.geometry}, read_plan(0, 1, 1, 8),
                               [0], [0])


@pytest.mark.parametrize(("local_ids", "remote_ids", "message"), [
    ([0, 1], [0], "2 local block ids but 1 remote"),
    ([-1], [0], "local block id -1 at position 0 is outside 0..39"),
    ([0, 40], [0, 1], "local block id 40 at position 1"),
    ([0], [4096], "remote block id 4096 at position 0 is outside 0..39"),
    ([3, 3], [0, 1], "local block id 3 repeats"),
])
def test_bad_block_ids_are_refused_before_building(local_ids: list[int], remote_ids: list[int],
                                                   message: str) -> None:
    rank = llama_like(KVCacheLayout.LBHNC)
    with pytest.raises(ValueError, match=message):
        build_read_descriptors(rank.geometry, {0: rank.geometry}, read_plan(0, 1, 1, 8),
                               local_ids, remote_ids)


def test_layer_count_and_block_size_mismatches_are_refused() -> None:
    rank = llama_like(KVCacheLayout.LBHNC)
    spec = CacheSpec(24, 8, 128, torch.bfloat16)
    other = make_rank(spec, KVCacheLayout.LBHNC, 4, 32, False, np.random.default_rng(1))
    with pytest.raises(IncompatibleLayoutError, match="decode block size 16 and prefill block "
                                                      "size 24: one must be a multiple of the "
                                                      "other"):
        build_read_descriptors(rank.geometry, {0: other.geometry}, read_plan(0, 1, 1, 8),
                               [0], [0])
    fewer = make_rank(CacheSpec(16, 8, 128, torch.bfloat16), KVCacheLayout.LBHNC, 4, 2, False,
                      np.random.default_rng(1))
    with pytest.raises(IncompatibleLayoutError, match="decode has 32 layers but prefill has 2"):
        build_read_descriptors(rank.geometry, {0: fewer.geometry}, read_plan(0, 1, 1, 8),
                               [0], [0])


def test_tampered_remote_plan_outside_its_memory_is_refused() -> None:
    rank = llama_like(KVCacheLayout.LBHNC)
    region = msgspec.structs.replace(rank.plan.regions[3], block_stride=10**9)
    regions = (*rank.plan.regions[:3], region, *rank.plan.regions[4:])
    bad = msgspec.structs.replace(rank.plan, regions=regions)
    with pytest.raises(ValueError, match=r"region 3 spans .* outside its memory entry"):
        validate_plan(bad)
    with pytest.raises(ValueError, match="region 3 spans"):
        SideGeometry.from_plan(bad)


def test_runs_never_cross_a_registration_even_when_addresses_touch() -> None:
    """Two layers in separate storages that happen to be adjacent in memory must not be
    merged into one descriptor: NIXL needs each descriptor inside one registration."""
    spec = CacheSpec(2, 2, 4, torch.float32)
    blocks, page = 4, spec.page_size_bytes
    backing = np.zeros(2 * blocks * page, dtype=np.uint8)
    halves = [torch.frombuffer(memoryview(backing[i * blocks * page:(i + 1) * blocks * page]),
                               dtype=torch.uint8) for i in range(2)]
    from kvxfer.layout import reshape_kv_cache
    views = [reshape_kv_cache(raw, spec, blocks, 1, "LBHNC")[0] for raw in halves]
    assert views[0].untyped_storage().data_ptr() != views[1].untyped_storage().data_ptr()
    assert views[1].data_ptr() == views[0].data_ptr() + blocks * page  # they touch
    plan = plan_regions({"a": views[0], "b": views[1]}, spec, blocks)
    assert len(plan.memory) == 2
    geo = SideGeometry.from_plan(plan)
    _, remote_views = allocate_kv_cache(spec, blocks, 2, "LBHNC")  # one storage: contiguous
    remote = SideGeometry.from_plan(plan_regions({"a": remote_views[0], "b": remote_views[1]},
                                                 spec, blocks))
    ids = np.arange(blocks)
    for local, other in ((geo, remote), (remote, geo)):
        (descs,) = build_read_descriptors(local, {0: other}, read_plan(0, 1, 1, 2), ids, ids)
        assert len(descs) == 2
        assert descs.local[:, 1].tolist() == [blocks * page, blocks * page]
