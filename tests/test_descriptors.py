"""Descriptor math, proven by executing the descriptors as byte copies.

A test-only reference executor copies ``len`` bytes from each remote row's
address to the paired local row's address inside real host buffers. The
expected result is computed independently, by assigning through the torch
views head by head; the minimal descriptor count is computed independently by
merging per-token rows (the finest unit every layout keeps contiguous).

A side may keep kernel blocks: its views are ``[B * r, H, N / r, C]`` and logical
block ``b`` (what ids count) is kernel blocks ``b * r .. b * r + r - 1``. The
expectation then addresses each logical block's token ``t`` as kernel block
``b * r + t // k``, row ``t % k`` (``k = N / r``), computed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.plan.descriptors import (
    IncompatibleLayoutError,
    SideGeometry,
    build_read_descriptors,
    validate_plan,
)
from kvxfer.plan.layout import CacheSpec, KVCacheLayout, allocate_kv_cache, kernel_split
from kvxfer.plan.regions import RegionPlan, plan_regions
from kvxfer.plan.topology import heads_per_rank, read_plan

LAYOUTS = list(KVCacheLayout)
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2)]


@dataclass
class Rank:
    """One TP rank's cache: buffers (one per storage), views (at the kernel block size),
    plan, geometry, and ``ratio`` kernel blocks per logical block."""

    buffers: list[torch.Tensor]
    views: list[torch.Tensor]
    plan: RegionPlan
    geometry: SideGeometry
    ratio: int = 1

    @property
    def kernel_block_size(self) -> int:
        return self.plan.block_size // self.ratio

    def kernel_rows(self, blocks: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
        """(kernel block, row in it) of logical blocks' tokens: the definition."""
        k = self.kernel_block_size
        return blocks * self.ratio + tokens // k, tokens % k


def make_rank(spec: CacheSpec, layout: KVCacheLayout, num_blocks: int, layers: int,
              separate_storage: bool, rng: np.random.Generator, kernel_ratio: int = 1,
              zeros: Any = None) -> Rank:
    kernel = spec.block_size // kernel_ratio
    if separate_storage:
        pairs = [allocate_kv_cache(spec, num_blocks, 1, layout, block_size=kernel, zeros=zeros)
                 for _ in range(layers)]
        buffers = [raw for raw, _ in pairs]
        views = [v[0] for _, v in pairs]
    else:
        raw, views = allocate_kv_cache(spec, num_blocks, layers, layout, block_size=kernel,
                                       zeros=zeros)
        buffers = [raw]
    for raw in buffers:
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
    caches = {f"layer.{i}": v for i, v in enumerate(views)}
    if layers > 1:
        caches["shared.alias"] = views[0]  # a shared layer appears once
    plan = plan_regions(caches, spec, num_blocks, layout)
    assert (plan.block_size, plan.num_blocks, plan.kernel_ratio) == (spec.block_size,
                                                                     num_blocks, kernel_ratio)
    return Rank(buffers, views, plan, SideGeometry.from_plan(plan), kernel_ratio)


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


def token_rows(rank: Rank, layer: int, blocks: np.ndarray, tokens: np.ndarray,
               head: int) -> np.ndarray:
    """Address of each logical (block, token)'s content row of one head: a row is
    contiguous in every layout."""
    view = rank.views[layer]
    kernel, row = rank.kernel_rows(blocks, tokens)
    s_b, s_h, s_n, _ = (x * view.element_size() for x in view.stride())
    return view.data_ptr() + kernel * s_b + head * s_h + row * s_n


def minimal_count(local: Rank, remote: Rank, laddr: np.ndarray, raddr: np.ndarray,
                  length: int) -> int:
    """Merge finest rows of ``length`` bytes, sorted by local address, that continue each
    other on both sides inside one buffer each."""
    def storage(rank: Rank, addr: np.ndarray) -> np.ndarray:
        starts = np.array([raw.data_ptr() for raw in rank.buffers])
        ends = starts + np.array([raw.numel() for raw in rank.buffers])
        index = np.argmax((addr[:, None] >= starts) & (addr[:, None] < ends), axis=1)
        assert ((addr >= starts[index]) & (addr + length <= ends[index])).all(), \
            "row outside buffers"
        return index

    order = np.argsort(laddr, kind="stable")
    laddr, raddr = laddr[order], raddr[order]
    lmem, rmem = storage(local, laddr), storage(remote, raddr)
    joined = (laddr[1:] == laddr[:-1] + length) & (raddr[1:] == raddr[:-1] + length) \
        & (lmem[1:] == lmem[:-1]) & (rmem[1:] == rmem[:-1])
    return int(len(laddr) - joined.sum())


def expect_compatible(local_layout: KVCacheLayout, remote_layout: KVCacheLayout,
                      local_spec: CacheSpec, remote_spec: CacheSpec, full: bool,
                      local_ratio: int = 1, remote_ratio: int = 1) -> bool:
    # One head, or one token per (kernel) block, makes H-vs-N order invisible.
    local_contig = local_layout.heads_outside_tokens or local_spec.num_heads == 1 \
        or local_spec.block_size == local_ratio
    remote_contig = remote_layout.heads_outside_tokens or remote_spec.num_heads == 1 \
        or remote_spec.block_size == remote_ratio
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
        # kernel blocks per logical block on each side (at most this many: kernel_ratio)
        "local_kernel": draw(st.sampled_from([1, 1, 1, 2, 3, 4, 6])),
        "remote_kernel": draw(st.sampled_from([1, 1, 1, 2, 3, 4, 6])),
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


def kernel_ratio(spec: CacheSpec, most: int) -> int:
    """The most kernel blocks per block, up to ``most``, that split it into whole tokens and
    its padding into whole elements."""
    for ratio in range(min(most, spec.block_size), 1, -1):
        try:
            kernel_split(spec, 1, spec.block_size // ratio if spec.block_size % ratio == 0
                         else 0)
        except ValueError:
            continue
        return ratio
    return 1


def spec_for(s: dict, tp: int, block_size: int | None = None) -> CacheSpec:
    kv = heads_per_rank(tp, s["total"])
    size = s["block_size"] if block_size is None else block_size
    real = CacheSpec(size, kv, s["head_size"], s["dtype"],
                     separate_kv_head_groups=s["groups"]).real_page_size_bytes
    # a padded page needs every head inside its block (not LHBNC, which vLLM refuses too)
    heads_apart = any(s[side].heads_outside_block for side in ("local_layout", "remote_layout"))
    padded = real + s["pad"] if s["pad"] and not heads_apart else None
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
    """Any layout pair, TP pair, block-size pair (one a multiple of the other) and kernel
    blocks on either side or both: the descriptors copy exactly the planned heads of every
    token of every logical block, as few as possible."""
    rng = np.random.default_rng(s["seed"])
    local_bs, remote_bs = block_sizes(s)
    local_spec = spec_for(s, s["local_tp"], local_bs)
    remote_spec = spec_for(s, s["remote_tp"], remote_bs)
    local_kr = kernel_ratio(local_spec, s["local_kernel"])
    remote_kr = kernel_ratio(remote_spec, s["remote_kernel"])
    storage = s["separate_storage"]
    local = make_rank(local_spec, s["local_layout"], s["local_blocks"], s["layers"],
                      storage and s["local_layout"].is_layer_compact, rng, local_kr)
    plan = read_plan(s["local_rank"], s["local_tp"], s["remote_tp"], s["total"])
    remotes = {piece.remote_rank: make_rank(remote_spec, s["remote_layout"], s["remote_blocks"],
                                            s["layers"], False, rng, remote_kr)
               for piece in plan}
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
    if not expect_compatible(s["local_layout"], s["remote_layout"], local_spec, remote_spec, full,
                             local_kr, remote_kr):
        with pytest.raises(IncompatibleLayoutError, match="layout"):
            build_read_descriptors(local.geometry, geometries, plan, local_ids, remote_ids,
                                   local_tp=s["local_tp"], remote_tp=s["remote_tp"])
        return
    result = build_read_descriptors(local.geometry, geometries, plan, local_ids, remote_ids,
                                    local_tp=s["local_tp"], remote_tp=s["remote_tp"])
    assert sorted(r.remote_rank for r in result) == sorted(remotes)

    # every token of the f smaller blocks, as logical (block, token) on each side
    position = np.arange(fine * small)
    lblock, ltoken = local_ids[position // local_bs], position % local_bs
    rblock, rtoken = remote_ids[position // remote_bs], position % remote_bs
    lkernel, lrow = (torch.from_numpy(a) for a in local.kernel_rows(lblock, ltoken))
    expected = [raw.clone() for raw in local.buffers]
    expected_views = [v for v in make_views_like(local, expected)]
    row = local_spec.content_size * local_spec.itemsize
    for piece in plan:
        remote = remotes[piece.remote_rank]
        rkernel, rrow = (torch.from_numpy(a) for a in remote.kernel_rows(rblock, rtoken))
        laddr, raddr = [], []
        for rh, lh, n in head_ranges(local_spec, remote_spec, piece.remote_head_offset,
                                     piece.local_head_offset, piece.count):
            lheads, rheads = torch.arange(lh, lh + n)[None], torch.arange(rh, rh + n)[None]
            for layer in range(s["layers"]):
                expected_views[layer][lkernel[:, None], lheads, lrow[:, None]] = \
                    remote.views[layer][rkernel[:, None], rheads, rrow[:, None]]
                for h in range(n):
                    laddr.append(token_rows(local, layer, lblock, ltoken, lh + h))
                    raddr.append(token_rows(remote, layer, rblock, rtoken, rh + h))
        descs = next(r for r in result if r.remote_rank == piece.remote_rank)
        assert descs.local.dtype == np.uint64 and descs.remote.dtype == np.uint64
        lrows, rrows = np.concatenate(laddr), np.concatenate(raddr)
        assert len(descs) == minimal_count(local, remote, lrows, rrows, row)
        assert descs.num_bytes == len(lrows) * row
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


def llama_like(layout: KVCacheLayout, tp: int = 1, kernel_ratio: int = 1,
               block_size: int = 16) -> Rank:
    spec = CacheSpec(block_size, heads_per_rank(tp, 8), 128, torch.bfloat16)
    return make_rank(spec, layout, 40, 32, False, np.random.default_rng(0), kernel_ratio)


@pytest.mark.parametrize(("layout", "prefill_kr", "decode_kr", "expected"), [
    # both sides split alike: heads fuse per kernel page and a block's two kernel pages
    # are adjacent on both sides, so it is still one run per layer and block
    (KVCacheLayout.LBHNC, 2, 2, 32 * 16),
    (KVCacheLayout.BLHNC, 2, 2, 16), (KVCacheLayout.BHLNC, 4, 4, 16),
    # one side split: a head's 16 tokens are one run there, two 8-token runs (apart) on
    # the other, so every head of every layer of every block is two descriptors
    (KVCacheLayout.LBHNC, 2, 1, 32 * 16 * 8 * 2), (KVCacheLayout.LBHNC, 1, 2, 32 * 16 * 8 * 2),
    (KVCacheLayout.BHLNC, 2, 1, 32 * 16 * 8 * 2),
    # tokens outside heads: LBNHC's r kernel pages [k, H, C] are the bytes of one [N, H, C]
    # page, so a split costs nothing; BLNHC interleaves layers per kernel block, so a
    # block's run breaks at every layer of every kernel block on the split side
    (KVCacheLayout.LBNHC, 2, 1, 32 * 16), (KVCacheLayout.BLNHC, 1, 4, 32 * 16 * 4)])
def test_kernel_blocks_cost_descriptors_only_where_their_runs_are_apart(
        layout: KVCacheLayout, prefill_kr: int, decode_kr: int, expected: int) -> None:
    prefill = llama_like(layout, kernel_ratio=prefill_kr)
    decode = llama_like(layout, kernel_ratio=decode_kr)
    ids = np.arange(0, 32, 2)  # logical ids, no two adjacent
    (descs,) = build_read_descriptors(decode.geometry, {0: prefill.geometry},
                                      read_plan(0, 1, 1, 8), ids, ids)
    assert len(descs) == expected
    assert descs.num_bytes == 16 * 32 * 16 * 8 * 256 * 2


def test_kernel_block_ids_are_checked_as_logical_ids() -> None:
    """40 logical blocks of 2 kernel blocks: id 40 is outside, although 80 kernel blocks
    exist; a repeated logical id is named as such."""
    split, plain = llama_like(KVCacheLayout.LBHNC, kernel_ratio=2), \
        llama_like(KVCacheLayout.LBHNC)
    for local, remote, lids, rids, side in ((split, plain, [0, 40], [1, 2], "local"),
                                            (plain, split, [1, 2], [0, 40], "remote")):
        with pytest.raises(ValueError, match=f"{side} block id 40 at position 1 is outside "
                                             f"0..39"):
            build_read_descriptors(local.geometry, {0: remote.geometry},
                                   read_plan(0, 1, 1, 8), lids, rids)
    with pytest.raises(ValueError, match="local block id 3 repeats"):
        build_read_descriptors(split.geometry, {0: plain.geometry}, read_plan(0, 1, 1, 8),
                               [3, 3], [0, 1])


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
                             f"> prefill TP 1; use LBHNC, BLHNC, BHLNC or LHBNC on the prefill "
                             f"side"):
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
    from kvxfer.plan.layout import reshape_kv_cache
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
