"""The KV cache layout vocabulary: logical dims, physical orders, specs, views.

Five logical dims, always in this order: L, B, H, N, C (``C``: K and V packed,
``2 * head_size`` elements; a latent cache's one ``head_size`` latent). Every layer sees a
logical ``[B, H, N, C]`` view; a :class:`KVCacheLayout` names the physical order, outermost
first. Padding belongs to the block and is never addressed.

Design: docs/design/plan.md#layouts
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

LAYOUT_ENV = "KVXFER_KV_CACHE_LAYOUT"

L, B, H, N, C = range(5)
DIM_NAMES = "LBHNC"


class KVCacheLayout(enum.Enum):
    """Physical order of the logical dims (L=0, B=1, H=2, N=3, C=4), outermost first."""

    LBHNC = (L, B, H, N, C)
    LBNHC = (L, B, N, H, C)
    BLHNC = (B, L, H, N, C)
    BLNHC = (B, L, N, H, C)
    BHLNC = (B, H, L, N, C)
    LHBNC = (L, H, B, N, C)  # each head's blocks are one slab per layer (vLLM's ROCm kernels)

    @property
    def stride_order(self) -> tuple[int, ...]:
        """Logical dim indices in physical order, outermost first."""
        return tuple(self.value)

    @property
    def is_layer_compact(self) -> bool:
        """L is outermost: every layer slot is one contiguous slab."""
        return self.value[0] == L

    @property
    def is_block_contiguous(self) -> bool:
        """H, N, C are the three innermost dims: a block's heads are contiguous slabs."""
        return tuple(self.value[-3:]) == (H, N, C)

    @property
    def heads_outside_tokens(self) -> bool:
        """H comes before N: one head of one block is a contiguous ``N*C`` run."""
        return self.value.index(H) < self.value.index(N)

    @property
    def heads_outside_block(self) -> bool:
        """H comes before B: a block is one ``N*C`` run per head, the heads a slab apart."""
        return self.value.index(H) < self.value.index(B)

    @property
    def layers_inside_block(self) -> bool:
        """L sits inside B: all layers of a block live in one block unit."""
        return self.value.index(L) > self.value.index(B)

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        """Physical order of the per-layer view dims (B=0, H=1, N=2, C=3), L removed."""
        return tuple(d - 1 for d in self.value if d != L)


#: the layouts whose blocks hold each head's tokens as one run (TP head splits are byte copies)
HEADS_OUTSIDE_TOKENS: tuple[str, ...] = tuple(x.name for x in KVCacheLayout
                                              if x.heads_outside_tokens)

_ALIASES = {"HND": KVCacheLayout.LBHNC, "HNC": KVCacheLayout.LBHNC,
            "NHD": KVCacheLayout.LBNHC, "NHC": KVCacheLayout.LBNHC}


def layout_names() -> list[str]:
    """Every accepted spelling: member names first, then aliases."""
    return [m.name for m in KVCacheLayout] + list(_ALIASES)


def parse_layout(name: str | KVCacheLayout) -> KVCacheLayout:
    """Resolve a layout name or alias, case-insensitively."""
    if isinstance(name, KVCacheLayout):
        return name
    key = str(name).strip().upper()
    if key in KVCacheLayout.__members__:
        return KVCacheLayout[key]
    if key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(f"unknown KV cache layout {name!r}; valid names: {', '.join(layout_names())}")


def default_layout(explicit: str | KVCacheLayout | None = None) -> KVCacheLayout:
    """The layout to use: ``explicit`` if given, else ``$KVXFER_KV_CACHE_LAYOUT``, else LBHNC."""
    if explicit is not None:
        return parse_layout(explicit)
    env = os.environ.get(LAYOUT_ENV, "").strip()
    if not env:
        return KVCacheLayout.LBHNC
    try:
        return parse_layout(env)
    except ValueError as exc:
        raise ValueError(f"${LAYOUT_ENV}: {exc}") from None


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheSpec:
    """Shape of one layer's KV page (one block of ``block_size`` tokens).

    Sizes named ``*_bytes`` are bytes; ``content_size`` is in elements.
    ``latent``: the content is one latent vector of ``head_size`` elements per
    token (MLA: the compressed KV, ``kv_lora_rank`` elements, then the decoupled
    RoPE key), from which attention derives keys and values; there is no
    separate V and a single "head" (``num_kv_heads == 1``), replicated on every
    TP rank.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: int | None = None
    separate_kv_head_groups: bool = False
    latent: bool = False

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_size", self.head_size)
        if self.latent and (self.num_kv_heads != 1 or self.separate_kv_head_groups):
            raise ValueError(
                f"a latent (MLA) cache holds one latent vector per token: it needs "
                f"num_kv_heads=1 (got {self.num_kv_heads}) and no separate K and V head "
                f"groups (got separate_kv_head_groups={self.separate_kv_head_groups})")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.page_size_padded is not None:
            _positive("page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.real_page_size_bytes:
                raise ValueError(
                    f"page_size_padded={self.page_size_padded} is smaller than the real page "
                    f"size {self.real_page_size_bytes} bytes")
            if self.page_size_padded % self.itemsize:
                raise ValueError(
                    f"page_size_padded={self.page_size_padded} is not a multiple of the "
                    f"{self.dtype} element size {self.itemsize}")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def num_heads(self) -> int:
        """H of the view: KV heads, or K and V head groups side by side."""
        return 2 * self.num_kv_heads if self.separate_kv_head_groups else self.num_kv_heads

    @property
    def content_size(self) -> int:
        """C of the view in elements: K and V packed, one of them, or one latent."""
        return self.head_size if self.separate_kv_head_groups or self.latent \
            else 2 * self.head_size

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_heads * self.content_size * self.itemsize

    @property
    def page_size_bytes(self) -> int:
        """Bytes one layer's block occupies, padding included."""
        return self.page_size_padded or self.real_page_size_bytes


def layer_strides(spec: CacheSpec, num_blocks: int, num_layer_slots: int,
                  layout: KVCacheLayout) -> tuple[int, ...]:
    """Element strides of the five logical dims (L, B, H, N, C) for ``layout``.

    With H outside B a block's unit is one head's ``N*C`` run; padding, which belongs to
    a whole page, then has nowhere to go (vLLM refuses it too)."""
    sizes = (num_layer_slots, num_blocks, spec.num_heads, spec.block_size, spec.content_size)
    order = layout.stride_order
    if layout.heads_outside_block and spec.num_heads > 1:
        if spec.page_size_padded is not None:
            raise ValueError(f"layout {layout.name} keeps each KV head's blocks apart, so a "
                             f"padded page (page_size_padded={spec.page_size_padded}) has no "
                             f"place; use a layout with H inside B, such as LBHNC")
        block_unit = spec.block_size * spec.content_size
    else:
        layers_in_unit = num_layer_slots if layout.layers_inside_block else 1
        block_unit = layers_in_unit * spec.page_size_bytes // spec.itemsize
    strides = [0] * 5
    extent = 1
    for dim in reversed(order):
        if dim == B:
            strides[B] = block_unit
            extent = block_unit * sizes[B]
        else:
            strides[dim] = extent
            extent *= sizes[dim]
    return tuple(strides)


def kernel_split(spec: CacheSpec, num_blocks: int, block_size: int | None
                 ) -> tuple[CacheSpec, int]:
    """Re-express the cache at kernel-block granularity: the spec of one kernel block of
    ``block_size`` tokens and the number of kernel blocks (``spec.block_size // block_size``
    per block, its padding split alike). ``None`` or the cache's own size: no split."""
    if block_size is None or block_size == spec.block_size:
        return spec, num_blocks
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 \
            or spec.block_size % block_size:
        raise ValueError(f"kernel block_size={block_size!r} must be a positive divisor of "
                         f"the cache block size {spec.block_size}")
    ratio = spec.block_size // block_size
    padded = spec.page_size_padded
    if padded is not None and (padded % ratio or (padded // ratio) % spec.itemsize):
        raise ValueError(f"page_size_padded={padded} cannot be split into {ratio} kernel "
                         f"blocks of {block_size} tokens with whole elements")
    kernel = replace(spec, block_size=block_size,
                     page_size_padded=None if padded is None else padded // ratio)
    return kernel, num_blocks * ratio


def reshape_kv_cache(raw: torch.Tensor, spec: CacheSpec, num_blocks: int,
                     num_layer_slots: int, layout: KVCacheLayout | str,
                     block_size: int | None = None) -> list[torch.Tensor]:
    """View a flat byte buffer as one ``[B, H, N, C]`` tensor per layer slot.

    ``raw`` must hold at least ``num_layer_slots * num_blocks * page_size_bytes``
    bytes. Views share ``raw``'s storage. With a kernel ``block_size`` dividing
    ``spec.block_size``, each block is seen as ``spec.block_size // block_size``
    kernel blocks (B grows, N shrinks) and the layout applies per kernel block.
    """
    layout = parse_layout(layout)
    _positive("num_blocks", num_blocks)
    _positive("num_layer_slots", num_layer_slots)
    if raw.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"raw KV buffer must be int8 or uint8, got {raw.dtype}")
    if raw.dim() != 1 or not raw.is_contiguous():
        raise ValueError(f"raw KV buffer must be flat and contiguous, got shape {tuple(raw.shape)}")
    needed = num_layer_slots * num_blocks * spec.page_size_bytes
    if raw.numel() < needed:
        raise ValueError(f"raw KV buffer holds {raw.numel()} bytes but {num_layer_slots} layer "
                         f"slots x {num_blocks} blocks x {spec.page_size_bytes} bytes per page "
                         f"need {needed}")
    if raw.data_ptr() % spec.itemsize:
        raise ValueError(f"raw KV buffer address {raw.data_ptr():#x} is not aligned to the "
                         f"{spec.dtype} element size {spec.itemsize}")
    kspec, kblocks = kernel_split(spec, num_blocks, block_size)
    strides = layer_strides(kspec, kblocks, num_layer_slots, layout)
    typed = raw[:needed].view(spec.dtype)
    shape = (kblocks, kspec.num_heads, kspec.block_size, kspec.content_size)
    return [torch.as_strided(typed, shape, strides[B:], typed.storage_offset() + layer * strides[L])
            for layer in range(num_layer_slots)]


def allocate_kv_cache(spec: CacheSpec, num_blocks: int, num_layer_slots: int,
                      layout: KVCacheLayout | str, device: str | torch.device = "cpu",
                      block_size: int | None = None,
                      zeros: Callable[[int], torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocate a zeroed byte buffer for the cache (with ``zeros(nbytes)`` when given, e.g.
    memory a reader on this host may map) and return it with its per-layer views."""
    _positive("num_blocks", num_blocks)
    _positive("num_layer_slots", num_layer_slots)
    nbytes = num_layer_slots * num_blocks * spec.page_size_bytes
    raw = zeros(nbytes) if zeros is not None else \
        torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return raw, reshape_kv_cache(raw, spec, num_blocks, num_layer_slots, layout, block_size)


def logical_view(view: torch.Tensor, kernel_ratio: int) -> torch.Tensor:
    """A kernel-block view ``[B * r, H, k, C]`` seen per logical block: ``[B, H, r, k, C]``,
    the same memory (writable). Logical block ``b`` is kernel blocks ``b * r .. b * r + r - 1``,
    so its token ``t`` is ``[b, :, t // k, t % k]``; ``flatten(2, 3)`` gives the logical
    ``[B, H, N, C]`` blocks (a copy unless ``r == 1``)."""
    _positive("kernel_ratio", kernel_ratio)
    if view.dim() != 4 or view.shape[0] % kernel_ratio:
        raise ValueError(f"a kernel-block view of shape {tuple(view.shape)} does not hold "
                         f"whole logical blocks of {kernel_ratio} kernel blocks")
    return view.view(view.shape[0] // kernel_ratio, kernel_ratio, *view.shape[1:]).transpose(1, 2)
