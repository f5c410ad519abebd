"""Tests for ``kvxfer.plan.regions.plan_regions``; expectations are computed here from the spec.

The core property: every byte any view element occupies lies in exactly one
region's ``[base + b * block_stride, + block_len)`` for its block ``b`` (a region
that lists the element's layer), inside that region's memory entry, and region
ranges hold nothing else. Region geometry (``chunk_offset``) must give the
address of ``view[b, h, 0, 0]``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvxfer.plan.descriptors import RankDescriptors, SideGeometry, build_read_descriptors
from kvxfer.plan.layout import CacheSpec, KVCacheLayout, allocate_kv_cache, reshape_kv_cache
from kvxfer.plan.regions import MixedLayoutError, RegionPlan, plan_regions
from kvxfer.plan.topology import read_plan

NAMES = tuple(layout.name for layout in KVCacheLayout)
# a padded page needs every head inside its block: not LHBNC (vLLM refuses it as well)
PADDABLE = tuple(layout.name for layout in KVCacheLayout if not layout.heads_outside_block)
HEADS_OUTSIDE_TOKENS = {"LBHNC", "BLHNC", "BHLNC", "LHBNC"}
COALESCED = {"BLNHC", "BHLNC"}
DTYPE = torch.float16
ITEMSIZE = 2
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


@dataclasses.dataclass(frozen=True)
class Setup:
    layout: str
    layers: int
    padded: bool = False
    groups: bool = False
    separate: bool = False  # each layer its own tensor (own storage) instead of one shared
    num_kv_heads: int = 2
    block_size: int = 4
    head_size: int = 3
    num_blocks: int = 3

    @property
    def heads(self) -> int:
        return 2 * self.num_kv_heads if self.groups else self.num_kv_heads

    @property
    def content(self) -> int:
        return self.head_size if self.groups else 2 * self.head_size

    @property
    def real_page(self) -> int:
        return self.block_size * self.heads * self.content * ITEMSIZE

    @property
    def page(self) -> int:
        return self.real_page + (10 * ITEMSIZE if self.padded else 0)

    @property
    def slots_per_storage(self) -> int:
        return 1 if self.separate else self.layers

    def spec(self) -> CacheSpec:
        return CacheSpec(self.block_size, self.num_kv_heads, self.head_size, DTYPE,
                         page_size_padded=self.page if self.padded else None,
                         separate_kv_head_groups=self.groups)

    def id(self) -> str:
        return "-".join([self.layout, f"L{self.layers}", "pad" if self.padded else "nopad",
                         "groups" if self.groups else "packed",
                         "separate" if self.separate else "shared",
                         f"kv{self.num_kv_heads}", f"bs{self.block_size}"])


@dataclasses.dataclass
class Built:
    setup: Setup
    storages: list[torch.Tensor]  # raw buffers, kept alive
    slots: list[torch.Tensor]  # views in allocation order
    caches: dict[str, torch.Tensor]
    logical: list[torch.Tensor]  # distinct views in first-appearance order of ``caches``


def build(s: Setup, device: str = "cpu", kernel_block_size: int | None = None) -> Built:
    """Allocate the cache and name its layers out of storage order, with one alias."""
    storages, slots = [], []
    for _ in range(s.layers // s.slots_per_storage):
        raw, views = allocate_kv_cache(s.spec(), s.num_blocks, s.slots_per_storage, s.layout,
                                       device=device, block_size=kernel_block_size)
        storages.append(raw)
        slots.extend(views)
    order = [*range(1, s.layers), 0]  # slot 0 appears last
    caches = {f"layers.{i}": slots[i] for i in order}
    caches["layers.alias"] = slots[order[0]]  # a second name for an already-seen view
    logical = [slots[i] for i in order]
    return Built(s, storages, slots, caches, logical)


def element_addresses(view: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, C, itemsize]`` byte address of every byte of every element of ``view``."""
    addr = torch.full(tuple(view.shape), view.data_ptr(), dtype=torch.int64)
    for axis, (size, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
        shape = [1] * 4
        shape[axis] = size
        addr = addr + torch.arange(size, dtype=torch.int64).view(shape) * stride * ITEMSIZE
    return addr.unsqueeze(-1) + torch.arange(ITEMSIZE, dtype=torch.int64)


def check_regions_cover_views(plan: RegionPlan, logical: list[torch.Tensor]) -> None:
    """Each element byte in exactly one region range of its block, regions hold only those."""
    element_bytes = []
    for layer, view in enumerate(logical):
        addr = element_addresses(view)
        block = torch.arange(view.shape[0], dtype=torch.int64).view(-1, 1, 1, 1, 1)
        hits = torch.zeros_like(addr)
        own_hits = torch.zeros_like(addr)
        for region in plan.regions:
            low = region.base_addr + block * region.block_stride
            inside = ((addr >= low) & (addr < low + region.block_len)).long()
            hits += inside
            if layer in region.layers:
                own_hits += inside
        assert bool((hits == 1).all()), (
            f"layer {layer}: some element bytes lie in {sorted(set(hits.flatten().tolist()))} "
            f"regions, want exactly 1")
        assert bool((own_hits == 1).all()), f"layer {layer}: a byte lies in another layer's region"
        in_memory = torch.zeros_like(addr, dtype=torch.bool)
        for mem in plan.memory:
            in_memory |= (addr >= mem.addr) & (addr < mem.addr + mem.nbytes)
        assert bool(in_memory.all()), f"layer {layer}: element bytes outside every memory entry"
        element_bytes.append(addr.flatten())
    region_bytes = []
    for index, region in enumerate(plan.regions):
        mem = plan.memory[region.mem_index]
        last_end = region.base_addr + (plan.num_kernel_blocks - 1) * region.block_stride \
            + region.block_len
        assert mem.addr <= region.base_addr and last_end <= mem.addr + mem.nbytes, (
            f"region {index} [{region.base_addr:#x}, {last_end:#x}) leaves memory entry "
            f"{region.mem_index}")
        for b in range(plan.num_kernel_blocks):
            start = region.base_addr + b * region.block_stride
            region_bytes.append(torch.arange(start, start + region.block_len, dtype=torch.int64))
    regions_all = torch.cat(region_bytes)
    assert regions_all.unique().numel() == regions_all.numel(), "region ranges overlap"
    assert torch.equal(regions_all.sort().values, torch.cat(element_bytes).sort().values), \
        "region ranges and view elements cover different bytes"


def check_chunk_geometry(plan: RegionPlan, logical: list[torch.Tensor]) -> None:
    """base + chunk_offset(layer, head) + b * block_stride is the address of view[b, h, 0, 0]."""
    for region in plan.regions:
        heads = (range(region.head_start, region.head_start + region.num_heads)
                 if region.heads_contiguous else [region.head_start])
        for layer, h in itertools.product(region.layers, heads):
            view = logical[layer]
            for b in range(plan.num_kernel_blocks):
                address = region.base_addr + region.chunk_offset(layer, h) + b * region.block_stride
                assert address == view[b, h, 0, 0].data_ptr(), (layer, h, b)
                if region.heads_contiguous:
                    assert view[b, h].is_contiguous()
                    assert view[b, h].numel() * ITEMSIZE == region.head_len


def expected_region_table(built: Built) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(base_addr, block_len, block_stride, layers) per region, from the spec's table."""
    s = built.setup
    index = {id(view): i for i, view in enumerate(built.logical)}
    layers_in_unit = s.slots_per_storage if s.layout.index("L") > s.layout.index("B") else 1
    block_stride = layers_in_unit * s.page
    out = []
    # separate head groups get a region each wherever one head is contiguous; a one-token
    # block makes that true even for the tokens-outside-heads layouts
    if s.layout == "LHBNC" and s.heads > 1:  # each head's blocks are a slab of their own
        head_len = s.block_size * s.content * ITEMSIZE
        for view in built.slots:
            out.extend((view[:, h].data_ptr(), head_len, head_len, (index[id(view)],))
                       for h in range(s.heads))
    elif s.groups and (s.layout in HEADS_OUTSIDE_TOKENS or s.block_size == 1):
        head_len = s.block_size * s.head_size * ITEMSIZE
        for view in built.slots:
            out.extend((view[:, h].data_ptr(), head_len, block_stride, (index[id(view)],))
                       for h in range(2 * s.num_kv_heads))
    elif s.layout in COALESCED:
        per = s.slots_per_storage
        for k, raw in enumerate(built.storages):
            storage = raw.untyped_storage()
            layers = tuple(sorted(index[id(v)] for v in built.slots[k * per:(k + 1) * per]))
            out.append((storage.data_ptr(), per * s.real_page, storage.nbytes() // s.num_blocks,
                        layers))
    else:
        out.extend((view.data_ptr(), s.real_page, block_stride, (index[id(view)],))
                   for view in built.slots)
    return sorted(out)


def actual_region_table(plan: RegionPlan) -> list[tuple[int, int, int, tuple[int, ...]]]:
    return sorted((r.base_addr, r.block_len, r.block_stride, tuple(sorted(r.layers)))
                  for r in plan.regions)


def check_plan_header(plan: RegionPlan, built: Built) -> None:
    s = built.setup
    assert (plan.num_blocks, plan.num_layers, plan.block_size) == (s.num_blocks, s.layers,
                                                                   s.block_size)
    assert (plan.num_heads, plan.num_kv_heads, plan.head_size) == (s.heads, s.num_kv_heads,
                                                                   s.head_size)
    assert plan.itemsize == ITEMSIZE
    assert plan.separate_kv_head_groups == s.groups
    expected_memory = sorted({(raw.untyped_storage().data_ptr(), raw.untyped_storage().nbytes())
                              for raw in built.storages})
    assert sorted((m.addr, m.nbytes) for m in plan.memory) == expected_memory
    assert len(plan.memory) == len(built.storages)
    for region in plan.regions:
        # one head of one block is contiguous when H is outside N, or either is a single index
        assert region.heads_contiguous == (s.layout in HEADS_OUTSIDE_TOKENS or s.heads == 1
                                           or s.block_size == 1)


def layer_strides_by_spec(layout: str, sizes: dict[str, int], unit: int) -> dict[str, int]:
    """Element strides of L, B, H, N, C per the placement rule (B strides by ``unit``)."""
    strides: dict[str, int] = {}
    inner = 1
    for letter in reversed(layout):
        strides[letter] = unit if letter == "B" else inner
        inner = strides[letter] * sizes[letter]
    return strides


def same_placement(a: str, b: str, s: Setup) -> bool:
    """Layouts ``a`` and ``b`` put every element of this setup at the same address."""
    sizes = dict(zip("LBHNC", (s.slots_per_storage, s.num_blocks, s.heads, s.block_size,
                               s.content), strict=True))

    def strides(layout: str) -> dict[str, int]:
        inside = layout.index("L") > layout.index("B")
        unit = (s.slots_per_storage if inside else 1) * s.page // ITEMSIZE
        if layout.index("H") < layout.index("B") and s.heads > 1:  # a block is one head's
            unit = s.block_size * s.content
        found = layer_strides_by_spec(layout, sizes, unit)
        return {d: v for d, v in found.items() if sizes[d] > 1}  # size-1 dims never step

    return strides(a) == strides(b)


MATRIX = [Setup(layout, layers, padded=padded, groups=groups, separate=separate)
          for layout, layers, padded, groups, separate in itertools.product(
              NAMES, (1, 2, 3), (False, True), (False, True), (False, True))
          if not (separate and layers == 1) and (layout in PADDABLE or not padded)]
# Size-1 dims (one KV head per rank, one-token blocks) hide part of the physical order.
DEGENERATE = [Setup(layout, layers, padded=True, groups=groups, separate=separate, **dims)
              for layout, layers, groups, separate, dims in itertools.product(
                  NAMES, (1, 2, 3), (False, True), (False, True),
                  ({"num_kv_heads": 1}, {"block_size": 1}, {"num_kv_heads": 1, "block_size": 1}))
              if not (separate and layers == 1)
              and (layout in PADDABLE or (dims.get("num_kv_heads") == 1 and not groups))]


def params(setups: list[Setup]) -> list[object]:
    return [pytest.param(s, id=s.id()) for s in setups]


@pytest.mark.parametrize("s", params(MATRIX + DEGENERATE))
def test_configured_layout(s: Setup) -> None:
    built = build(s)
    plan = plan_regions(built.caches, s.spec(), s.num_blocks, layout=s.layout)
    assert plan.layout == s.layout
    check_plan_header(plan, built)
    for mem in plan.memory:
        assert (mem.device_id, mem.is_cuda) == (0, False)
    assert actual_region_table(plan) == expected_region_table(built)
    check_regions_cover_views(plan, built.logical)
    check_chunk_geometry(plan, built.logical)


@pytest.mark.parametrize("s", params(MATRIX + DEGENERATE))
def test_inferred_layout(s: Setup) -> None:
    built = build(s)
    plan = plan_regions(built.caches, s.spec(), s.num_blocks)
    assert plan.layout in NAMES
    assert same_placement(plan.layout, s.layout, s), f"inferred {plan.layout} for {s.layout}"
    if s.slots_per_storage > 1 and s.heads > 1 and s.block_size > 1:
        # with every dim visible the layout is unambiguous: same plan as configured
        assert plan == plan_regions(built.caches, s.spec(), s.num_blocks, layout=s.layout)
    check_plan_header(plan, built)
    check_regions_cover_views(plan, built.logical)
    check_chunk_geometry(plan, built.logical)


@pytest.mark.parametrize("layout", NAMES)
def test_regions_from_oversized_buffer(layout: str) -> None:
    """A raw buffer larger than the cache: regions still address exactly the views."""
    s = Setup(layout, 2, padded=layout in PADDABLE)
    raw = torch.zeros(2 * s.num_blocks * s.page + 96, dtype=torch.uint8)
    views = reshape_kv_cache(raw, s.spec(), s.num_blocks, 2, layout)
    plan = plan_regions({"a": views[0], "b": views[1]}, s.spec(), s.num_blocks, layout)
    assert [(m.addr, m.nbytes) for m in plan.memory] == [(raw.data_ptr(), raw.numel())]
    check_regions_cover_views(plan, views)
    check_chunk_geometry(plan, views)


def test_first_appearance_order_defines_layer_index() -> None:
    s = Setup("LBHNC", 3)
    built = build(s)
    plan = plan_regions(built.caches, s.spec(), s.num_blocks, "LBHNC")
    assert plan.num_layers == 3
    by_layer = {r.layers: r.base_addr for r in plan.regions}
    # caches lists slot 1, slot 2, slot 0 (then an alias of slot 1)
    assert by_layer == {(0,): built.slots[1].data_ptr(), (1,): built.slots[2].data_ptr(),
                        (2,): built.slots[0].data_ptr()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", NAMES)
def test_memory_entry_names_device(layout: str, device: str) -> None:
    s = Setup(layout, 2, padded=layout in PADDABLE, groups=True)
    built = build(s, device)
    plan = plan_regions(built.caches, s.spec(), s.num_blocks)
    view = built.slots[0]
    want_id = view.device.index if view.is_cuda else 0
    assert [(m.device_id, m.is_cuda) for m in plan.memory] == [(want_id, view.is_cuda)]
    check_plan_header(plan, built)
    check_regions_cover_views(plan, built.logical)
    check_chunk_geometry(plan, built.logical)


# ---------------------------------------------------------------- error paths

def shared(layout: str, layers: int = 2, **kw: object) -> tuple[Setup, list[torch.Tensor]]:
    s = Setup(layout, layers, **kw)  # type: ignore[arg-type]
    _, views = allocate_kv_cache(s.spec(), s.num_blocks, layers, layout)
    return s, views


KERNEL_SETUPS = [(Setup(layout, layers, padded=padded, groups=groups, separate=separate), ratio)
                 for layout, layers, padded, groups, separate, ratio in itertools.product(
                     NAMES, (1, 3), (False, True), (False, True), (False, True), (2, 4))
                 if not (separate and layers == 1) and not (padded and ratio == 4)
                 and (layout in PADDABLE or not padded)]


@pytest.mark.parametrize(("s", "ratio"), [pytest.param(s, r, id=f"{s.id()}-r{r}")
                                          for s, r in KERNEL_SETUPS])
def test_kernel_block_views_plan_logical_blocks_of_kernel_regions(s: Setup, ratio: int) -> None:
    """Views at a kernel block size k = block_size / r: the plan counts logical blocks
    (what ids count) and records r; its regions are those of a cache of k-token blocks
    and address every byte of the kernel views exactly once."""
    kernel = s.block_size // ratio
    built = build(s, kernel_block_size=kernel)
    assert built.slots[0].shape[:3] == (s.num_blocks * ratio, s.heads, kernel)
    plan = plan_regions(built.caches, s.spec(), s.num_blocks, layout=s.layout)
    assert (plan.num_blocks, plan.block_size, plan.kernel_ratio) == (s.num_blocks,
                                                                     s.block_size, ratio)
    assert (plan.kernel_block_size, plan.num_kernel_blocks) == (kernel, s.num_blocks * ratio)
    kernel_spec = dataclasses.replace(
        s.spec(), block_size=kernel,
        page_size_padded=s.page // ratio if s.padded else None)
    as_kernel = plan_regions(built.caches, kernel_spec, s.num_blocks * ratio, layout=s.layout)
    assert plan.regions == as_kernel.regions and plan.memory == as_kernel.memory
    assert plan == msgspec.structs.replace(as_kernel, num_blocks=s.num_blocks,
                                           block_size=s.block_size, kernel_ratio=ratio)
    check_regions_cover_views(plan, built.logical)
    check_chunk_geometry(plan, built.logical)
    assert SideGeometry.from_plan(plan).kernel_ratio == ratio


def test_kernel_views_of_the_wrong_count_name_layer_and_kernel_size() -> None:
    s = Setup("LBHNC", 2)
    _, views = allocate_kv_cache(s.spec(), s.num_blocks, 2, "LBHNC", block_size=2)
    with pytest.raises(ValueError, match=r"'k0' has shape \(6, 2, 2, 6\).*needs \(8, 2, 2, 6\)"
                                         r".*kernel blocks of 2"):
        plan_regions({"k0": views[0], "k1": views[1]}, s.spec(), 4)
    odd = torch.zeros(9, s.heads, 3, s.content, dtype=DTYPE)  # 3 does not divide 4
    with pytest.raises(ValueError, match=r"'odd' has shape \(9, 2, 3, 6\).*needs \(3, 2, 4, 6\)"):
        plan_regions({"odd": odd}, s.spec(), s.num_blocks)


def test_empty_caches_rejected() -> None:
    with pytest.raises(ValueError, match="no KV cache views"):
        plan_regions({}, Setup("LBHNC", 1).spec(), 3)


def test_shape_mismatch_names_layer() -> None:
    s, views = shared("LBHNC")
    with pytest.raises(ValueError) as info:
        plan_regions({"model.layers.0": views[0], "model.layers.1": views[1]}, s.spec(), 4)
    assert "'model.layers.0'" in str(info.value)
    assert "(3, 2, 4, 6)" in str(info.value)


def test_heads_outside_blocks_read_as_lhbnc() -> None:
    """A view whose heads are slabs of all blocks is LHBNC's, planned a region per head."""
    s = Setup("LBHNC", 1)
    view = torch.zeros(s.heads, s.num_blocks, s.block_size, s.content,
                       dtype=DTYPE).permute(1, 0, 2, 3)
    plan = plan_regions({"layer": view}, s.spec(), s.num_blocks)
    assert plan.layout == "LHBNC" and len(plan.regions) == s.heads
    check_regions_cover_views(plan, [view])


def test_dtype_mismatch_names_layer() -> None:
    s, views = shared("BLHNC")
    spec = dataclasses.replace(s.spec(), dtype=torch.bfloat16)
    with pytest.raises(ValueError) as info:
        plan_regions({"k0": views[0], "k1": views[1]}, spec, s.num_blocks)
    assert "'k0'" in str(info.value)
    assert "torch.float16" in str(info.value)


@pytest.mark.parametrize(("kind", "layout"), [
    ("tokens-outside-blocks", None), ("tokens-outside-blocks", "LBHNC"),
    ("heads-outside-blocks", "LBHNC"), ("content-strided", None), ("content-strided", "LBHNC")])
def test_not_blocks_first_names_layer(kind: str, layout: str | None) -> None:
    s = Setup("LBHNC", 1)
    if kind == "tokens-outside-blocks":
        view = torch.zeros(s.block_size, s.num_blocks, s.heads, s.content,
                           dtype=DTYPE).permute(1, 2, 0, 3)
    elif kind == "heads-outside-blocks":  # LHBNC's placement, configured as LBHNC
        view = torch.zeros(s.heads, s.num_blocks, s.block_size, s.content,
                           dtype=DTYPE).permute(1, 0, 2, 3)
    else:
        view = torch.zeros(s.num_blocks, s.heads, s.content, s.block_size,
                           dtype=DTYPE).transpose(2, 3)
    with pytest.raises(ValueError) as info:
        plan_regions({"odd.layer": view}, s.spec(), s.num_blocks, layout)
    assert "'odd.layer'" in str(info.value)
    assert str(tuple(view.stride())) in str(info.value)


@pytest.mark.parametrize(("allocated", "configured"), [
    ("LBHNC", "LBNHC"), ("LBNHC", "LBHNC"), ("BLHNC", "LBHNC"), ("LBHNC", "BLHNC"),
    ("BLNHC", "BHLNC"), ("BHLNC", "BLHNC")])
def test_strides_contradicting_configured_layout_name_layer(allocated: str,
                                                            configured: str) -> None:
    s, views = shared(allocated, padded=True)
    with pytest.raises(ValueError) as info:
        plan_regions({"attn.0": views[0], "attn.1": views[1]}, s.spec(), s.num_blocks,
                     configured)
    assert re.search(r"'attn\.[01]'", str(info.value)), str(info.value)
    assert configured in str(info.value)


def test_padded_views_with_unpadded_spec_name_layer() -> None:
    s, views = shared("LBHNC", padded=True)
    unpadded = dataclasses.replace(s.spec(), page_size_padded=None)
    with pytest.raises(ValueError) as info:
        plan_regions({"l0": views[0], "l1": views[1]}, unpadded, s.num_blocks)
    assert re.search(r"'l[01]'", str(info.value)), str(info.value)


def test_unevenly_spaced_views_name_layers() -> None:
    s, views = shared("LBHNC", layers=4)
    with pytest.raises(ValueError) as info:
        plan_regions({"x0": views[0], "x1": views[1], "x3": views[3]}, s.spec(), s.num_blocks)
    for name in ("'x0'", "'x1'", "'x3'"):
        assert name in str(info.value)


@pytest.mark.parametrize("layout", NAMES)
def test_skipped_layer_slot_names_layer(layout: str) -> None:
    """Evenly spaced views that are not neighbouring slots contradict the layout."""
    s, views = shared(layout, layers=3, padded=layout in PADDABLE)
    with pytest.raises(ValueError) as info:
        plan_regions({"first": views[0], "third": views[2]}, s.spec(), s.num_blocks, layout)
    assert re.search("'first'|'third'", str(info.value)), str(info.value)


def test_mixed_layouts_across_storages_rejected() -> None:
    s, hnd = shared("LBHNC")
    _, nhd = shared("LBNHC")
    caches = {"a0": hnd[0], "a1": hnd[1], "b0": nhd[0], "b1": nhd[1]}
    with pytest.raises(ValueError) as info:
        plan_regions(caches, s.spec(), s.num_blocks)
    assert "LBHNC" in str(info.value) and "LBNHC" in str(info.value)
    with pytest.raises(ValueError) as info:
        plan_regions(caches, s.spec(), s.num_blocks, "LBHNC")
    assert re.search("'b[01]'", str(info.value)), str(info.value)


# ---------------------------------------------------------------- ambiguous storages
# A storage whose size-1 dims (one layer slot, one head, one-token blocks, one block)
# let several layouts place every byte alike fits each of them; the plan takes the one
# layout every storage fits.

def allocate_groups(s: Setup, sizes: Sequence[int], layout: str | None = None,
                    fill: np.random.Generator | None = None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One storage of ``layout`` (default ``s.layout``) per entry of ``sizes``, holding
    that many layer slots; raw buffers and views in layer order."""
    raws, views = [], []
    for n in sizes:
        raw, slot_views = allocate_kv_cache(s.spec(), s.num_blocks, n, layout or s.layout)
        if fill is not None:
            raw.copy_(torch.from_numpy(fill.integers(0, 256, raw.numel(), dtype=np.uint8)))
        raws.append(raw)
        views.extend(slot_views)
    return raws, views


def named(views: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"layers.{i}": v for i, v in enumerate(views)}


def copy_rows(dst: list[torch.Tensor], src: list[torch.Tensor], descs: RankDescriptors) -> None:
    """Execute descriptors as memcpys between host buffers (local row <- remote row)."""
    def at(buffers: list[torch.Tensor], addr: int, length: int) -> tuple[np.ndarray, int]:
        for raw in buffers:
            if raw.data_ptr() <= addr and addr + length <= raw.data_ptr() + raw.numel():
                return raw.numpy(), addr - raw.data_ptr()
        raise AssertionError(f"descriptor [{addr:#x}, +{length}) is outside every buffer")

    for (laddr, length, _), (raddr, _, _) in zip(descs.local.tolist(), descs.remote.tolist(),
                                                 strict=True):
        (out, o), (inp, i) = at(dst, laddr, length), at(src, raddr, length)
        out[o:o + length] = inp[i:i + length]


def check_read_byte_exact(s: Setup, local_sizes: Sequence[int], remote_sizes: Sequence[int],
                          seed: int) -> None:
    """A TP 1 read of some blocks between caches built from these storages puts exactly
    the remote views' bytes into the local views' blocks and touches no other byte."""
    rng = np.random.default_rng(seed)
    remote_raw, remote_views = allocate_groups(s, remote_sizes, fill=rng)
    local_raw, local_views = allocate_groups(s, local_sizes, fill=rng)
    expected = [raw.clone() for raw in local_raw]
    expected_views = [v for raw, n in zip(expected, local_sizes, strict=True)
                      for v in reshape_kv_cache(raw, s.spec(), s.num_blocks, n, s.layout)]
    count = int(rng.integers(1, s.num_blocks + 1))
    local_ids = rng.choice(s.num_blocks, count, replace=False)
    remote_ids = rng.choice(s.num_blocks, count, replace=False)
    for want, got in zip(expected_views, remote_views, strict=True):
        want[torch.from_numpy(local_ids)] = got[torch.from_numpy(remote_ids)]
    local = SideGeometry.from_plan(plan_regions(named(local_views), s.spec(), s.num_blocks))
    remote = SideGeometry.from_plan(plan_regions(named(remote_views), s.spec(), s.num_blocks))
    (descs,) = build_read_descriptors(local, {0: remote}, read_plan(0, 1, 1, s.num_kv_heads),
                                      local_ids, remote_ids)
    copy_rows(local_raw, remote_raw, descs)
    for got, want in zip(local_raw, expected, strict=True):
        assert torch.equal(got, want), "the read differs from a view-level reference copy"


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "BHLNC"])
def test_one_layer_storage_takes_the_layout_of_the_cross_layer_rest(layout: str) -> None:
    """The issue's case: cross-layer storages plus one holding a single layer, which alone
    reads as L-outermost (BLHNC and LBHNC place its bytes alike)."""
    s = Setup(layout, 5, padded=True)
    sizes = (2, 2, 1)
    raws, views = allocate_groups(s, sizes)
    plan = plan_regions(named(views), s.spec(), s.num_blocks)
    assert plan.layout == layout
    assert plan == plan_regions(named(views), s.spec(), s.num_blocks, layout)
    assert [(m.addr, m.nbytes) for m in plan.memory] == [
        (raw.data_ptr(), raw.numel()) for raw in raws]
    check_regions_cover_views(plan, views)
    check_chunk_geometry(plan, views)
    check_read_byte_exact(s, sizes, sizes, seed=0)
    check_read_byte_exact(s, (1,) * 5, sizes, seed=1)  # decode with one tensor per layer


@dataclasses.dataclass(frozen=True)
class StorageCase:
    setup: Setup  # layout and dims; ``layers`` is the total
    sizes: tuple[int, ...]  # layer slots per storage
    local_sizes: tuple[int, ...]  # the reading side's storages, same total
    seed: int


@st.composite
def storage_cases(draw: st.DrawFn) -> StorageCase:
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)))
    layout = draw(st.sampled_from(NAMES))
    s = Setup(layout, sum(sizes), padded=layout in PADDABLE and draw(st.booleans()),
              groups=draw(st.booleans()), num_kv_heads=draw(st.sampled_from([1, 2])),
              block_size=draw(st.sampled_from([1, 2, 4])), head_size=draw(st.integers(1, 3)),
              num_blocks=draw(st.integers(1, 3)))
    local = draw(st.sampled_from([sizes, (1,) * sum(sizes)]))
    return StorageCase(s, sizes, local, draw(st.integers(0, 2**31)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(storage_cases())
@example(StorageCase(Setup("BLHNC", 5), (2, 2, 1), (2, 2, 1), 0))
@example(StorageCase(Setup("BHLNC", 4, num_kv_heads=1), (3, 1), (1, 1, 1, 1), 0))
def test_storages_of_one_layout_plan_as_one_whatever_their_size(c: StorageCase) -> None:
    """Storages allocated in one layout, some ambiguous, plan as a layout that places every
    storage's bytes as allocated; the allocated layout itself wherever one storage shows
    every dim; regions and a read stay byte-exact."""
    s = c.setup
    raws, views = allocate_groups(s, c.sizes)
    plan = plan_regions(named(views), s.spec(), s.num_blocks)
    for n in c.sizes:
        group = dataclasses.replace(s, layers=n)
        assert same_placement(plan.layout, s.layout, group), (plan.layout, n)
    if max(c.sizes) > 1 and min(s.heads, s.block_size, s.num_blocks) > 1:
        assert plan.layout == s.layout
    assert plan == plan_regions(named(views), s.spec(), s.num_blocks, plan.layout)
    assert plan_regions(named(views), s.spec(), s.num_blocks, s.layout).layout == s.layout
    assert len(plan.memory) == len(raws)
    check_regions_cover_views(plan, views)
    check_chunk_geometry(plan, views)
    check_read_byte_exact(s, c.local_sizes, c.sizes, c.seed)


@pytest.mark.parametrize("storages", [
    # heads inside tokens: the one-layer storage fits no cross-layer layout of the rest
    [("a", "BLHNC", 2, ["BLHNC"]), ("solo", "LBNHC", 1, ["LBNHC", "BLNHC"])],
    # the one-layer storage fits either, but the two-layer storages disagree
    [("a", "BHLNC", 2, ["BHLNC"]), ("solo", "LBHNC", 1, ["LBHNC", "BLHNC", "BHLNC"]),
     ("b", "LBHNC", 2, ["LBHNC"])]], ids=["heads-inside-tokens", "two-layouts"])
def test_storages_no_single_layout_fits_are_refused_naming_each(
        storages: list[tuple[str, str, int, list[str]]]) -> None:
    s = Setup("LBHNC", 2)
    caches: dict[str, torch.Tensor] = {}
    want: dict[tuple[str, ...], tuple[str, ...]] = {}
    for prefix, layout, n, fits in storages:
        _, views = allocate_groups(s, (n,), layout)
        names = tuple(f"{prefix}{i}" for i in range(n))
        caches |= dict(zip(names, views, strict=True))
        want[names] = tuple(fits)
    with pytest.raises(MixedLayoutError) as info:
        plan_regions(caches, s.spec(), s.num_blocks)
    assert info.value.candidates == want
    assert "no single layout fits every KV cache storage" in str(info.value)
    for names, admitted in want.items():
        assert f"{', '.join(map(repr, names))} -> {list(admitted)}" in str(info.value)
