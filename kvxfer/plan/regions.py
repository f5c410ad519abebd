"""From registered per-layer views to memory registrations and transfer regions.

A *memory* entry is what NIXL registers (one per storage); a *region* is a strided family of
byte ranges, one per kernel block: ``[base_addr + b * block_stride, + block_len)``. All sizes
and addresses are bytes. Regions are msgspec structs: the peer receives them verbatim.

Design: docs/design/plan.md#regions
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import msgspec
import torch

from kvxfer.plan.layout import (
    B,
    CacheSpec,
    KVCacheLayout,
    kernel_split,
    layer_strides,
    parse_layout,
)

# the views of one storage: (logical layer index, name, view), in address order
Group = list[tuple[int, str, torch.Tensor]]


class MemoryRegion(msgspec.Struct, frozen=True):
    """One registration: ``nbytes`` bytes at ``addr`` on device ``device_id`` (0 for CPU)."""

    addr: int
    nbytes: int
    device_id: int
    is_cuda: bool = False


class Region(msgspec.Struct, frozen=True):
    """A transfer region: per (kernel) block ``[base_addr + b * block_stride, + block_len)``
    bytes, holding ``layers`` ``layer_stride`` apart, each with ``num_heads`` heads
    ``head_stride`` apart; one head of one layer is ``head_len`` contiguous bytes where
    ``heads_contiguous``, else only the whole layer page is."""

    base_addr: int
    block_len: int
    block_stride: int
    mem_index: int
    layers: tuple[int, ...]
    layer_stride: int
    num_heads: int
    head_start: int
    head_stride: int
    head_len: int
    heads_contiguous: bool

    def chunk_offset(self, layer: int, head: int) -> int:
        """Byte offset of (layer, head) inside block 0, from ``base_addr``."""
        position = self.layers.index(layer)
        return position * self.layer_stride + (head - self.head_start) * self.head_stride


class RegionPlan(msgspec.Struct, frozen=True):
    """What one TP rank registers and what a peer needs to address its blocks.

    ``layout`` is one name for every storage: a layout each storage's views fit.
    ``latent``: each token's content is one MLA latent of ``head_size`` elements
    in a single head, not K and V (:class:`~kvxfer.plan.layout.CacheSpec`).
    ``num_blocks`` and ``block_size`` are logical (what block ids count); each logical
    block is ``kernel_ratio`` kernel blocks, the blocks the regions address
    (``block_len``/``block_stride``, ``head_len`` of a kernel block): logical block ``b``
    is kernel blocks ``b * kernel_ratio .. b * kernel_ratio + kernel_ratio - 1``.
    """

    layout: str
    num_blocks: int
    num_layers: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    itemsize: int
    separate_kv_head_groups: bool
    memory: tuple[MemoryRegion, ...]
    regions: tuple[Region, ...]
    latent: bool = False
    kernel_ratio: int = 1

    @property
    def kernel_block_size(self) -> int:
        """Tokens per kernel block, the blocks regions address."""
        return self.block_size // self.kernel_ratio

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.kernel_ratio

    @property
    def heads_contiguous(self) -> bool:
        return self.regions[0].heads_contiguous

    @property
    def head_len(self) -> int:
        return self.regions[0].head_len

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.memory)


class MixedLayoutError(ValueError):
    """No single layout fits every storage; ``candidates`` maps each storage's view names
    to the layouts its views fit."""

    def __init__(self, candidates: dict[tuple[str, ...], tuple[str, ...]]) -> None:
        self.candidates = candidates
        parts = "; ".join(f"{', '.join(repr(n) for n in names)} -> {list(fits)}"
                          for names, fits in candidates.items())
        super().__init__(f"no single layout fits every KV cache storage; the layouts each "
                         f"storage's views fit: {parts}")


def _device_id(tensor: torch.Tensor) -> int:
    if not tensor.is_cuda:
        return 0
    return tensor.device.index or 0


def distinct_views(caches: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Views in first-appearance order (the logical layer order of a plan); several
    names may share one view."""
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for name, view in caches.items():
        key = (view.data_ptr(), tuple(view.stride()))
        if key not in seen:
            seen[key] = name
            out.append((name, view))
    return out


def _infer_layout(name: str, view: torch.Tensor, layer_step: int | None,
                  itemsize: int) -> KVCacheLayout:
    """Read a view's layout from its strides and the byte step to the next layer slot."""
    s_b, s_h, s_n, s_c = (s * itemsize for s in view.stride())
    heads_out = s_h > s_n or view.shape[1] == 1
    if s_c == itemsize and heads_out and view.shape[1] > 1 and s_b >= s_n \
            and s_h >= s_b * view.shape[0]:
        return KVCacheLayout.LHBNC
    if s_c != itemsize or s_b < max(s_h if view.shape[1] > 1 else 0, s_n):
        raise ValueError(f"KV cache view {name!r} with strides {tuple(view.stride())} is not "
                         f"blocks-first or heads-first with contiguous content")
    if layer_step is None or layer_step >= s_b * view.shape[0]:
        return KVCacheLayout.LBHNC if heads_out else KVCacheLayout.LBNHC
    if heads_out and layer_step < s_h:
        return KVCacheLayout.BHLNC
    return KVCacheLayout.BLHNC if heads_out else KVCacheLayout.BLNHC


def _group_by_storage(views: list[tuple[str, torch.Tensor]]) -> list[Group]:
    groups: dict[int, Group] = {}
    for index, (name, view) in enumerate(views):
        groups.setdefault(view.untyped_storage().data_ptr(), []).append((index, name, view))
    return [sorted(g, key=lambda item: item[2].data_ptr()) for g in groups.values()]


def _layer_step(group: Group) -> int | None:
    if len(group) == 1:
        return None
    steps = {b[2].data_ptr() - a[2].data_ptr() for a, b in itertools.pairwise(group)}
    if len(steps) != 1:
        names = ", ".join(repr(n) for _, n, _ in group)
        raise ValueError(f"KV cache views {names} share a storage but are not evenly spaced "
                         f"(steps {sorted(steps)} bytes)")
    return steps.pop()


def plan_regions(caches: Mapping[str, torch.Tensor], spec: CacheSpec, num_blocks: int,
                 layout: KVCacheLayout | str | None = None) -> RegionPlan:
    """Build the memory registrations and transfer regions for ``caches``.

    ``caches`` maps layer names to ``[B, H, N, C]`` views; its first-appearance
    order of distinct views defines the logical layer index both peers use.
    ``spec`` and ``num_blocks`` are logical. The views may be at a kernel block size
    ``k`` dividing ``spec.block_size`` (``r = spec.block_size // k`` kernel blocks per
    block: shape ``(num_blocks * r, H, k, C)``, as ``reshape_kv_cache(...,
    block_size=k)`` makes them); the plan records ``kernel_ratio = r``.
    ``layout`` is checked against every storage when given; when omitted, the
    one layout that every storage's views fit is chosen (see :func:`_choose_layout`).
    """
    views = distinct_views(caches)
    if not views:
        raise ValueError("no KV cache views to plan regions for")
    kspec, kblocks = _kernel_spec(views, spec, num_blocks)
    groups = [(group, _layer_step(group)) for group in _group_by_storage(views)]
    chosen = _choose_layout(groups, kspec, kblocks) if layout is None else parse_layout(layout)
    memory: list[MemoryRegion] = []
    regions: list[Region] = []
    for group, step in groups:
        _check_strides(group, chosen, kspec, kblocks, step)  # names a view ``layout`` misfits
        first = group[0][2]
        storage = first.untyped_storage()
        memory.append(MemoryRegion(storage.data_ptr(), storage.nbytes(), _device_id(first),
                                   first.is_cuda))
        regions.extend(_group_regions(group, chosen, kspec, len(memory) - 1, step))
    return RegionPlan(layout=chosen.name, num_blocks=num_blocks, num_layers=len(views),
                      block_size=spec.block_size, num_heads=spec.num_heads,
                      num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                      itemsize=spec.itemsize, separate_kv_head_groups=spec.separate_kv_head_groups,
                      memory=tuple(memory), regions=tuple(regions), latent=spec.latent,
                      kernel_ratio=spec.block_size // kspec.block_size)


def _kernel_spec(views: list[tuple[str, torch.Tensor]], spec: CacheSpec, num_blocks: int
                 ) -> tuple[CacheSpec, int]:
    """The spec of one block as the views see it, and their block count: ``spec`` itself,
    or a kernel split of it when the first view's blocks are a divisor of its size."""
    tokens = views[0][1].shape[2] if views[0][1].dim() == 4 else spec.block_size
    split = tokens if 0 < tokens < spec.block_size and spec.block_size % tokens == 0 else None
    try:
        kspec, kblocks = kernel_split(spec, num_blocks, split)
    except ValueError as exc:  # padding the kernel blocks cannot share
        raise ValueError(f"KV cache view {views[0][0]!r}: {exc}") from None
    expected = (kblocks, kspec.num_heads, kspec.block_size, kspec.content_size)
    for name, view in views:
        if tuple(view.shape) != expected or view.dtype != spec.dtype:
            kernel = "" if split is None else \
                f" (blocks of {spec.block_size} tokens seen as kernel blocks of {split})"
            raise ValueError(f"KV cache view {name!r} has shape {tuple(view.shape)} and dtype "
                             f"{view.dtype}; the spec needs {expected} in {spec.dtype}{kernel}")
    return kspec, kblocks


def _choose_layout(groups: list[tuple[Group, int | None]], spec: CacheSpec,
                   num_blocks: int) -> KVCacheLayout:
    """The layout every storage group fits.

    A group fits each layout under which its views sit exactly where that layout
    puts its layer slots. Size-1 dims (one layer slot, one head, one-token
    blocks, one block) make several layouts place every byte alike, so such a
    group fits several and the unambiguous groups decide. Among the layouts all
    groups fit, the first that some group's strides read as wins (in group
    order), else the first in table order.
    """
    read = [_infer_layout(g[0][1], g[0][2], step, spec.itemsize) for g, step in groups]
    fits = [[x for x in KVCacheLayout if _contradiction(g, x, spec, num_blocks, step) is None]
            for g, step in groups]
    common = [x for x in KVCacheLayout if all(x in f for f in fits)]
    if common:
        return next((x for x in read if x in common), common[0])
    for (group, step), got, found in zip(groups, read, fits, strict=True):
        if not found:
            _check_strides(group, got, spec, num_blocks, step)
    raise MixedLayoutError({tuple(name for _, name, _ in g): tuple(x.name for x in f)
                            for (g, _), f in zip(groups, fits, strict=True)})


def _strides_match(view: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Strides agree on every dim of size > 1: a size-1 dim never steps, so its stride is
    free (a single KV head or a one-token block makes H-vs-N order invisible)."""
    return all(size == 1 or got == want
               for size, got, want in zip(view.shape, view.stride(), strides, strict=True))


def _contradiction(group: Group, layout: KVCacheLayout, spec: CacheSpec, num_blocks: int,
                   step: int | None) -> str | None:
    """Why the views of one storage do not sit where ``layout`` puts its layer slots, or None."""
    try:
        strides = layer_strides(spec, num_blocks, len(group), layout)
    except ValueError as exc:  # the layout cannot hold this spec (a padded page, heads apart)
        return str(exc)
    for _, name, view in group:
        if not _strides_match(view, strides[B:]):
            return (f"KV cache view {name!r} has strides {tuple(view.stride())}, which "
                    f"contradict layout {layout.name} (expected {strides[B:]})")
    if step is not None and step != strides[0] * spec.itemsize:
        return (f"KV cache view {group[1][1]!r} starts {step} bytes after the previous layer, "
                f"which contradicts layout {layout.name} (expected "
                f"{strides[0] * spec.itemsize})")
    return None


def _check_strides(group: Group, layout: KVCacheLayout, spec: CacheSpec, num_blocks: int,
                   step: int | None) -> None:
    """Every view of one storage must sit exactly where ``layout`` puts a layer slot."""
    reason = _contradiction(group, layout, spec, num_blocks, step)
    if reason is not None:
        raise ValueError(reason)


def _group_regions(group: Group, layout: KVCacheLayout, spec: CacheSpec, mem_index: int,
                   step: int | None) -> list[Region]:
    itemsize = spec.itemsize
    first = group[0][2]
    s_b, s_h = first.stride(0) * itemsize, first.stride(1) * itemsize
    head_len = spec.block_size * spec.content_size * itemsize
    # a single head or a one-token block makes every head contiguous whatever the order
    heads_contiguous = layout.heads_outside_tokens or spec.num_heads == 1 or spec.block_size == 1
    # K and V head groups, or heads that are slabs of their own (H outside B): a region
    # per head, since a block of the layer is not one run
    per_head = (spec.separate_kv_head_groups and heads_contiguous) or \
        (layout.heads_outside_block and spec.num_heads > 1)
    coalesce = layout in (KVCacheLayout.BLNHC, KVCacheLayout.BHLNC) and not per_head
    if coalesce:
        layers = tuple(index for index, _, _ in group)
        return [Region(base_addr=first.data_ptr(), block_len=len(group) * spec.real_page_size_bytes,
                       block_stride=s_b, mem_index=mem_index, layers=layers,
                       layer_stride=step or 0, num_heads=spec.num_heads, head_start=0,
                       head_stride=s_h, head_len=head_len, heads_contiguous=heads_contiguous)]
    out: list[Region] = []
    for index, _, view in group:
        if per_head:
            out.extend(Region(base_addr=view[:, h].data_ptr(), block_len=head_len,
                              block_stride=s_b, mem_index=mem_index, layers=(index,),
                              layer_stride=0, num_heads=1, head_start=h, head_stride=s_h,
                              head_len=head_len, heads_contiguous=True)
                       for h in range(spec.num_heads))
        else:
            out.append(Region(base_addr=view.data_ptr(), block_len=spec.real_page_size_bytes,
                              block_stride=s_b, mem_index=mem_index, layers=(index,),
                              layer_stride=0, num_heads=spec.num_heads, head_start=0,
                              head_stride=s_h, head_len=head_len,
                              heads_contiguous=heads_contiguous))
    return out
