"""Tests for ``kvxfer.plan.layout``; every expected value is computed here from the spec.

The placement rule these tests encode: sizes (L, B, H, N, C) = (layer slots,
blocks, heads, block_size, content). Walking a layout's physical order from
innermost to outermost, every dim is compact inside the dims inside it, except
B: its stride is the padded block unit, ``(layers if L is inside B else 1) *
page_size_bytes / itemsize`` elements, whose content is packed at its start.
A kernel block size ``k`` (ratio ``r``) means: the same rule with block_size
``k``, ``num_blocks * r`` blocks and a padded page of ``page / r`` bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.plan.layout import (
    CacheSpec,
    KVCacheLayout,
    allocate_kv_cache,
    default_layout,
    parse_layout,
    reshape_kv_cache,
)

NAMES = tuple(layout.name for layout in KVCacheLayout)
# a padded page needs every head inside its block: not LHBNC (vLLM refuses it as well)
PADDABLE = tuple(layout.name for layout in KVCacheLayout if not layout.heads_outside_block)
ALIASES = {"HND": "LBHNC", "HNC": "LBHNC", "NHD": "LBNHC", "NHC": "LBNHC"}
ENV = "KVXFER_KV_CACHE_LAYOUT"
SENTINEL = 0xA5
GUARD = 64  # bytes before and after raw inside the parent buffer, all sentinel
# A distinct, finite bit pattern per element: base pattern (1.0) plus an id.
BIT_BASE = {torch.float32: (torch.int32, 0x3F800000),
            torch.float16: (torch.int16, 0x3C00),
            torch.bfloat16: (torch.int16, 0x3F80)}
DTYPES = tuple(BIT_BASE)
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


@dataclasses.dataclass(frozen=True)
class Params:
    """One cache configuration. ``pad_elems`` extra elements per page (None: unpadded)."""

    layout: str
    layers: int
    dtype: torch.dtype
    groups: bool = False
    block_size: int = 4
    num_kv_heads: int = 2
    head_size: int = 3
    num_blocks: int = 3
    pad_elems: int | None = None
    ratio: int = 1  # spec.block_size // kernel block size

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def heads(self) -> int:
        return 2 * self.num_kv_heads if self.groups else self.num_kv_heads

    @property
    def content(self) -> int:
        return self.head_size if self.groups else 2 * self.head_size

    @property
    def real_page(self) -> int:
        """Bytes of one layer's block content (whole cache block)."""
        return self.block_size * self.heads * self.content * self.itemsize

    @property
    def page(self) -> int:
        """Bytes one layer's block occupies, padding included."""
        if self.pad_elems is None:
            return self.real_page
        return self.real_page + self.pad_elems * self.itemsize

    @property
    def needed(self) -> int:
        return self.layers * self.num_blocks * self.page

    @property
    def kernel_block_size(self) -> int | None:
        return None if self.ratio == 1 else self.block_size // self.ratio

    def spec(self) -> CacheSpec:
        return CacheSpec(self.block_size, self.num_kv_heads, self.head_size, self.dtype,
                         page_size_padded=None if self.pad_elems is None else self.page,
                         separate_kv_head_groups=self.groups)

    def id(self) -> str:
        pad = "pad" if self.pad_elems is not None else "nopad"
        groups = "groups" if self.groups else "packed"
        split = f"split{self.ratio}" if self.ratio > 1 else "nosplit"
        return f"{self.layout}-{pad}-{groups}-L{self.layers}-{split}-{str(self.dtype)[6:]}"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Expected placement of the cache as the views see it (after kernel splitting)."""

    sizes: dict[str, int]  # L, B, H, N, C
    strides: dict[str, int]  # elements
    itemsize: int
    unit_bytes: int  # one block unit, padding included
    unit_content_bytes: int  # packed at the start of each unit

    @property
    def view_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[d] for d in "BHNC")


def expected_geometry(p: Params) -> Geometry:
    blocks = p.num_blocks * p.ratio
    sizes = dict(zip("LBHNC", (p.layers, blocks, p.heads, p.block_size // p.ratio, p.content),
                     strict=True))
    page, real = p.page // p.ratio, p.real_page // p.ratio
    layers_in_unit = p.layers if p.layout.index("L") > p.layout.index("B") else 1
    unit_elems = layers_in_unit * page // p.itemsize
    strides: dict[str, int] = {}
    inner = 1  # elements spanned by the dims already placed (inside the current one)
    heads_out = p.layout.index("H") < p.layout.index("B")
    for letter in reversed(p.layout):
        # with H outside B a block is one head's N x C elements (no padding)
        strides[letter] = (inner if heads_out else unit_elems) if letter == "B" else inner
        inner = strides[letter] * sizes[letter]
    return Geometry(sizes, strides, p.itemsize, layers_in_unit * page, layers_in_unit * real)


def _grid(shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """sum(index[d] * strides[d]) for every index of ``shape`` (int64)."""
    total = torch.zeros(shape, dtype=torch.int64)
    for axis, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        index_shape = [1] * len(shape)
        index_shape[axis] = size
        total = total + torch.arange(size, dtype=torch.int64).view(index_shape) * stride
    return total


def expected_byte_offsets(geo: Geometry, layer: int) -> torch.Tensor:
    """Byte offset from raw's start of every element of ``layer``'s view, per the rule."""
    elems = layer * geo.strides["L"] + _grid(geo.view_shape,
                                             tuple(geo.strides[d] for d in "BHNC"))
    return elems * geo.itemsize


def actual_byte_offsets(view: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Byte offset from raw's start of every element of ``view``, read from its metadata."""
    return (view.data_ptr() - raw.data_ptr()) + _grid(tuple(view.shape),
                                                      view.stride()) * view.element_size()


def distinct_values(p: Params, shape: tuple[int, ...]) -> torch.Tensor:
    """``[layers, *shape]`` values of ``p.dtype``, every one a different finite bit pattern."""
    int_dtype, base = BIT_BASE[p.dtype]
    count = p.layers * int(torch.tensor(shape).prod())
    ids = torch.arange(1, count + 1, dtype=torch.int64) + base
    return ids.to(int_dtype).view(p.dtype).view(p.layers, *shape)


def byte_ranges(starts: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Every byte covered by the elements starting at ``starts``: ``[*starts.shape, itemsize]``."""
    return starts.unsqueeze(-1) + torch.arange(itemsize, dtype=torch.int64)


def content_mask(p: Params, geo: Geometry, length: int) -> torch.Tensor:
    """Bytes of a ``length``-byte raw buffer that hold cache content (not padding/tail)."""
    mask = torch.zeros(length, dtype=torch.bool)
    assert p.needed % geo.unit_bytes == 0
    for unit in range(p.needed // geo.unit_bytes):
        start = unit * geo.unit_bytes
        mask[start:start + geo.unit_content_bytes] = True
    return mask


def write_and_check_placement(p: Params, device: str, tail: int = 48) -> None:
    """Fill with a sentinel, write a distinct value per element through the views,
    then read raw bytes: each value at its expected offset, every other byte untouched."""
    geo = expected_geometry(p)
    parent = torch.full((GUARD + p.needed + tail + GUARD,), SENTINEL, dtype=torch.uint8,
                        device=device)
    raw = parent[GUARD:GUARD + p.needed + tail]
    views = reshape_kv_cache(raw, p.spec(), p.num_blocks, p.layers, p.layout,
                             block_size=p.kernel_block_size)
    assert len(views) == p.layers
    values = distinct_values(p, geo.view_shape)
    for layer, view in enumerate(views):
        assert tuple(view.shape) == geo.view_shape
        assert view.dtype == p.dtype
        assert view.device == raw.device
        assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
        view.copy_(values[layer].to(device))
    host = parent.cpu()
    written = torch.zeros(host.numel(), dtype=torch.bool)
    for layer in range(p.layers):
        where = byte_ranges(GUARD + expected_byte_offsets(geo, layer), p.itemsize)
        want = values[layer].contiguous().view(torch.uint8).view(*geo.view_shape, p.itemsize)
        got = host[where]
        if not torch.equal(got, want):
            bad = (got != want).any(-1).nonzero()[0].tolist()
            raise AssertionError(f"layer {layer} element {bad} of {p.id()}: raw bytes "
                                 f"{got[tuple(bad)].tolist()} at byte "
                                 f"{int(where[tuple(bad)][0]) - GUARD}, wrote "
                                 f"{want[tuple(bad)].tolist()}")
        written[where.flatten()] = True
    # Every content byte was written exactly once (distinct expected offsets).
    assert int(written.sum()) == p.layers * p.num_blocks * p.real_page
    untouched = host[~written]
    bad = (untouched != SENTINEL).nonzero()
    assert bad.numel() == 0, (f"{p.id()}: {bad.numel()} padding/guard bytes changed, first at "
                              f"parent byte {int((~written).nonzero()[int(bad[0])])}")


# The acceptance matrix: every layout x padding x head groups x 1..3 layers x split.
MATRIX = [Params(layout, layers, torch.float32, groups=groups,
                 pad_elems=6 if padded else None, ratio=2 if split else 1)
          for layout, padded, groups, layers, split in itertools.product(
              NAMES, (False, True), (False, True), (1, 2, 3), (False, True))
          if layout in PADDABLE or not padded]


def with_dtype(p: Params, dtype: torch.dtype) -> Params:
    return dataclasses.replace(p, dtype=dtype)


def matrix(dtypes: tuple[torch.dtype, ...]) -> list[object]:
    return [pytest.param(with_dtype(p, d), id=with_dtype(p, d).id())
            for p in MATRIX for d in dtypes]


# ---------------------------------------------------------------- layout table

@pytest.mark.parametrize("name", NAMES)
def test_layout_properties_follow_the_name(name: str) -> None:
    layout = KVCacheLayout[name]
    assert layout.stride_order == tuple("LBHNC".index(letter) for letter in name)
    assert layout.is_layer_compact == (name[0] == "L")
    assert layout.is_block_contiguous == (name[-3:] == "HNC")
    assert layout.layer_view_order == tuple("BHNC".index(x) for x in name.replace("L", ""))


def test_layout_members_and_documented_examples() -> None:
    # the six vLLM 0.32 defines (vllm/v1/kv_cache_layout.py), values in its convention
    assert {m.name: m.value for m in KVCacheLayout} == {
        "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
        "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
    assert KVCacheLayout.BLHNC.stride_order == (1, 0, 2, 3, 4)
    assert KVCacheLayout.LBNHC.stride_order == (0, 1, 3, 2, 4)
    assert KVCacheLayout.BHLNC.layer_view_order == (0, 1, 2, 3)
    assert KVCacheLayout.LBNHC.layer_view_order == (0, 2, 1, 3)
    assert [m.name for m in KVCacheLayout if m.is_block_contiguous] == ["LBHNC", "BLHNC"]
    assert [m.name for m in KVCacheLayout if m.is_layer_compact] == ["LBHNC", "LBNHC", "LHBNC"]
    assert [m.name for m in KVCacheLayout if m.heads_outside_block] == ["LHBNC"]


@pytest.mark.parametrize("spelling", [*NAMES, *(n.lower() for n in NAMES), "bLhNc"])
def test_parse_layout_member_names_case_insensitive(spelling: str) -> None:
    assert parse_layout(spelling) is KVCacheLayout[spelling.upper()]


@pytest.mark.parametrize(("alias", "target"), [
    *ALIASES.items(), *((a.lower(), t) for a, t in ALIASES.items()), ("Nhd", "LBNHC")])
def test_parse_layout_aliases(alias: str, target: str) -> None:
    assert parse_layout(alias) is KVCacheLayout[target]


def test_parse_layout_passes_members_through() -> None:
    for member in KVCacheLayout:
        assert parse_layout(member) is member


@pytest.mark.parametrize("bad", ["LBHCN", "", "HN", "vertical"])
def test_parse_layout_unknown_lists_valid_names(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_layout(bad)
    message = str(info.value)
    assert repr(bad) in message
    for valid in (*NAMES, *ALIASES):
        assert valid in message


def test_default_layout_without_env_is_lbhnc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert default_layout() is KVCacheLayout.LBHNC
    monkeypatch.setenv(ENV, "")
    assert default_layout() is KVCacheLayout.LBHNC


@pytest.mark.parametrize(("value", "target"), [("blnhc", "BLNHC"), ("NHD", "LBNHC"),
                                               ("BHLNC", "BHLNC"), ("hnc", "LBHNC")])
def test_default_layout_reads_env(monkeypatch: pytest.MonkeyPatch, value: str,
                                  target: str) -> None:
    monkeypatch.setenv(ENV, value)
    assert default_layout() is KVCacheLayout[target]


def test_default_layout_explicit_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "BLHNC")
    assert default_layout("nhd") is KVCacheLayout.LBNHC
    assert default_layout(KVCacheLayout.BHLNC) is KVCacheLayout.BHLNC


def test_default_layout_bad_env_names_variable_and_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "diagonal")
    with pytest.raises(ValueError) as info:
        default_layout()
    assert ENV in str(info.value)
    assert "diagonal" in str(info.value)


def test_default_layout_bad_explicit_names_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ValueError, match="'XYZ'"):
        default_layout("XYZ")


# ---------------------------------------------------------------- CacheSpec

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [False, True])
@pytest.mark.parametrize("pad_bytes", [None, 0, 16])
def test_cache_spec_sizes(dtype: torch.dtype, groups: bool, pad_bytes: int | None) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    block_size, kv, head = 16, 4, 8
    heads = 2 * kv if groups else kv
    content = head if groups else 2 * head
    real = block_size * heads * content * itemsize  # 2048 * itemsize bytes either way
    padded = None if pad_bytes is None else real + pad_bytes
    spec = CacheSpec(block_size, kv, head, dtype, page_size_padded=padded,
                     separate_kv_head_groups=groups)
    assert spec.num_heads == heads
    assert spec.content_size == content
    assert spec.real_page_size_bytes == real == 16 * 4 * 16 * itemsize
    assert spec.page_size_bytes == (real if padded is None else padded)


def test_cache_spec_is_frozen() -> None:
    spec = CacheSpec(16, 4, 8, torch.float16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 0), ("block_size", -16), ("num_kv_heads", 0), ("num_kv_heads", -2),
    ("head_size", 0), ("head_size", -64), ("page_size_padded", 0),
    ("page_size_padded", -4096), ("block_size", 2.5)])
def test_cache_spec_rejects_non_positive_sizes(field: str, value: object) -> None:
    kwargs: dict[str, object] = {"block_size": 16, "num_kv_heads": 4, "head_size": 8,
                                 "dtype": torch.float16, field: value}
    with pytest.raises(ValueError) as info:
        CacheSpec(**kwargs)  # type: ignore[arg-type]
    assert field in str(info.value)
    assert repr(value) in str(info.value)


def test_cache_spec_rejects_padding_below_real_page() -> None:
    # real page: 16 tokens * 4 heads * 16 content * 2 bytes = 2048 bytes
    with pytest.raises(ValueError) as info:
        CacheSpec(16, 4, 8, torch.float16, page_size_padded=2046)
    assert "2046" in str(info.value)
    assert "2048" in str(info.value)


def test_cache_spec_rejects_padding_not_whole_elements() -> None:
    # real page 4096 bytes in float32; 4098 is larger but not a multiple of 4
    with pytest.raises(ValueError) as info:
        CacheSpec(16, 4, 8, torch.float32, page_size_padded=4098)
    assert "4098" in str(info.value)
    assert "float32" in str(info.value)


def test_cache_spec_rejects_non_dtype() -> None:
    with pytest.raises(ValueError, match="'float16'"):
        CacheSpec(16, 4, 8, "float16")  # type: ignore[arg-type]


# ---------------------------------------------------------------- placement

def test_hand_computed_strides_padded_two_layers() -> None:
    """block 4, 2 heads, head 3 (C=6), float32: real page 192 B, padded 256 B = 64 elements."""
    spec = CacheSpec(4, 2, 3, torch.float32, page_size_padded=256)
    table = {  # layout: (view strides B, H, N, C in elements, layer step in elements)
        "LBHNC": ((64, 24, 6, 1), 192),
        "LBNHC": ((64, 6, 12, 1), 192),
        "BLHNC": ((128, 24, 6, 1), 48),
        "BLNHC": ((128, 6, 12, 1), 48),
        "BHLNC": ((128, 48, 6, 1), 24),
    }
    for name, (strides, step) in table.items():
        raw = torch.zeros(2 * 3 * 256, dtype=torch.uint8)
        views = reshape_kv_cache(raw, spec, 3, 2, name)
        for layer, view in enumerate(views):
            assert view.stride() == strides, name
            assert view.data_ptr() - raw.data_ptr() == layer * step * 4, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", matrix(DTYPES))
def test_every_element_at_its_physical_offset_and_padding_untouched(p: Params,
                                                                   device: str) -> None:
    write_and_check_placement(p, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", matrix((torch.float32, torch.bfloat16)))
def test_views_partition_exactly_the_content_bytes(p: Params, device: str) -> None:
    geo = expected_geometry(p)
    raw = torch.zeros(p.needed + 40, dtype=torch.uint8, device=device)
    views = reshape_kv_cache(raw, p.spec(), p.num_blocks, p.layers, p.layout,
                             block_size=p.kernel_block_size)
    owner = torch.full((raw.numel(),), -1, dtype=torch.int64)
    for layer, view in enumerate(views):
        spots = byte_ranges(actual_byte_offsets(view, raw), p.itemsize).flatten()
        assert int(spots.min()) >= 0 and int(spots.max()) < p.needed
        clash = owner[spots] != -1
        assert not bool(clash.any()), (
            f"layer {layer} overlaps layer {int(owner[spots][clash][0])} at byte "
            f"{int(spots[clash][0])}")
        assert spots.unique().numel() == spots.numel(), f"layer {layer} overlaps itself"
        owner[spots] = layer
    assert torch.equal(owner >= 0, content_mask(p, geo, raw.numel()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", matrix((torch.float32, torch.bfloat16)))
def test_view_strides_follow_layer_view_order(p: Params, device: str) -> None:
    geo = expected_geometry(p)
    expected_order = tuple("BHNC".index(x) for x in p.layout.replace("L", ""))
    raw = torch.zeros(p.needed, dtype=torch.uint8, device=device)
    views = reshape_kv_cache(raw, p.spec(), p.num_blocks, p.layers, p.layout,
                             block_size=p.kernel_block_size)
    assert KVCacheLayout[p.layout].layer_view_order == expected_order
    for view in views:
        strides = view.stride()
        assert strides == tuple(geo.strides[d] for d in "BHNC")
        by_size = tuple(sorted(range(4), key=lambda d: -strides[d]))
        assert by_size == expected_order
        ordered = [strides[d] for d in expected_order]
        assert ordered == sorted(ordered, reverse=True) and len(set(ordered)) == 4


@st.composite
def random_params(draw: st.DrawFn) -> Params:
    block_size = draw(st.integers(1, 6))
    ratio = draw(st.sampled_from([r for r in range(1, block_size + 1) if block_size % r == 0]))
    layout = draw(st.sampled_from(NAMES))
    padded = layout in PADDABLE and draw(st.booleans())
    return Params(layout=layout, layers=draw(st.integers(1, 3)),
                  dtype=draw(st.sampled_from(DTYPES)), groups=draw(st.booleans()),
                  block_size=block_size, num_kv_heads=draw(st.integers(1, 3)),
                  head_size=draw(st.integers(1, 4)), num_blocks=draw(st.integers(1, 4)),
                  pad_elems=ratio * draw(st.integers(0, 3)) if padded else None, ratio=ratio)


@settings(max_examples=60, deadline=None)
@given(random_params())
def test_placement_for_random_sizes(p: Params) -> None:
    write_and_check_placement(p, "cpu", tail=p.itemsize)


def test_kernel_block_size_equal_to_cache_block_is_no_split() -> None:
    spec = CacheSpec(4, 2, 3, torch.float16, page_size_padded=128)
    raw = torch.zeros(2 * 3 * 128, dtype=torch.uint8)
    plain = reshape_kv_cache(raw, spec, 3, 2, "BLHNC")
    same = reshape_kv_cache(raw, spec, 3, 2, "BLHNC", block_size=4)
    for a, b in zip(plain, same, strict=True):
        assert (a.shape, a.stride(), a.data_ptr()) == (b.shape, b.stride(), b.data_ptr())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", NAMES)
def test_allocate_kv_cache(layout: str, device: str) -> None:
    p = Params(layout, 3, torch.bfloat16, pad_elems=4 if layout in PADDABLE else None, ratio=2)
    raw, views = allocate_kv_cache(p.spec(), p.num_blocks, p.layers, layout, device=device,
                                   block_size=p.kernel_block_size)
    assert raw.dtype == torch.uint8
    assert raw.numel() == p.needed
    assert raw.device.type == device
    assert not bool(raw.any())
    geo = expected_geometry(p)
    for layer, view in enumerate(views):
        assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
        assert tuple(view.shape) == geo.view_shape
        assert torch.equal(actual_byte_offsets(view, raw), expected_byte_offsets(geo, layer))


# ---------------------------------------------------------------- error paths

SMALL = CacheSpec(4, 2, 3, torch.float32)  # real page 4 * 2 * 6 * 4 = 192 bytes


def test_reshape_rejects_non_byte_raw() -> None:
    with pytest.raises(ValueError, match=re.escape("torch.float32")):
        reshape_kv_cache(torch.zeros(2 * 3 * 192, dtype=torch.float32), SMALL, 3, 2, "LBHNC")


def test_reshape_rejects_too_small_raw_with_byte_counts() -> None:
    with pytest.raises(ValueError) as info:
        reshape_kv_cache(torch.zeros(1151, dtype=torch.uint8), SMALL, 3, 2, "LBHNC")
    assert "1151" in str(info.value)
    assert "1152" in str(info.value)  # 2 layers * 3 blocks * 192 bytes


def test_reshape_rejects_misaligned_raw() -> None:
    parent = torch.zeros(1152 + 8, dtype=torch.uint8)
    raw = parent[1:1 + 1152]
    with pytest.raises(ValueError) as info:
        reshape_kv_cache(raw, SMALL, 3, 2, "LBHNC")
    assert f"{raw.data_ptr():#x}" in str(info.value)


@pytest.mark.parametrize("raw", [torch.zeros(2, 1152, dtype=torch.uint8),
                                 torch.zeros(2304, dtype=torch.uint8)[::2]],
                         ids=["2d", "strided"])
def test_reshape_rejects_non_flat_raw(raw: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=re.escape(str(tuple(raw.shape)))):
        reshape_kv_cache(raw, SMALL, 3, 1, "LBHNC")


@pytest.mark.parametrize("kernel", [3, 8, 0, -2])
def test_reshape_rejects_non_dividing_kernel_block_size(kernel: int) -> None:
    with pytest.raises(ValueError, match=f"block_size={kernel}"):
        reshape_kv_cache(torch.zeros(1152, dtype=torch.uint8), SMALL, 3, 2, "LBHNC",
                         block_size=kernel)


@pytest.mark.parametrize(("dtype", "padded", "kernel"), [
    (torch.float32, 196, 2),  # 196 / 2 = 98 bytes: not whole float32 elements
    (torch.float16, 98, 1),  # 98 / 4 is not even whole bytes
])
def test_reshape_rejects_padding_that_does_not_split(dtype: torch.dtype, padded: int,
                                                     kernel: int) -> None:
    spec = CacheSpec(4, 2, 3, dtype, page_size_padded=padded)
    with pytest.raises(ValueError, match=f"page_size_padded={padded}"):
        reshape_kv_cache(torch.zeros(3 * padded, dtype=torch.uint8), spec, 3, 1, "BLHNC",
                         block_size=kernel)


@pytest.mark.parametrize(("num_blocks", "layers", "bad"), [(0, 1, "0"), (3, -1, "-1")])
def test_reshape_rejects_non_positive_counts(num_blocks: int, layers: int, bad: str) -> None:
    with pytest.raises(ValueError, match=f"got {bad}"):
        reshape_kv_cache(torch.zeros(1152, dtype=torch.uint8), SMALL, num_blocks, layers,
                         "LBHNC")


def test_reshape_rejects_unknown_layout() -> None:
    with pytest.raises(ValueError, match="'LHNBC'"):
        reshape_kv_cache(torch.zeros(1152, dtype=torch.uint8), SMALL, 3, 2, "LHNBC")


def test_heads_outside_blocks_refuse_a_padded_page() -> None:
    spec = CacheSpec(4, 2, 3, torch.float32, page_size_padded=256)
    with pytest.raises(ValueError, match=r"LHBNC keeps each KV head's blocks apart.*LBHNC"):
        allocate_kv_cache(spec, 3, 2, "LHBNC")
    one_head = CacheSpec(4, 1, 3, torch.float32, page_size_padded=256)
    _, views = allocate_kv_cache(one_head, 3, 2, "LHBNC")  # one head: its blocks are pages
    assert views[0].stride(0) * 4 == 256


def test_allocate_rejects_non_positive_blocks() -> None:
    with pytest.raises(ValueError, match=r"num_blocks.*got 0"):
        allocate_kv_cache(SMALL, 0, 2, "LBHNC")
