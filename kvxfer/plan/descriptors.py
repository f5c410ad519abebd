"""Vectorised descriptor lists for one request's READ (pure numpy, no I/O).

One descriptor per maximal run contiguous on both sides; arrays are ``N x 3`` uint64 (addr,
len, device), in bytes. Block ids are logical on both sides; each side's kernel blocks are
paired in token order, at the pairing unit where block sizes differ.

Design: docs/design/plan.md#descriptors
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.plan.layout import HEADS_OUTSIDE_TOKENS
from kvxfer.plan.packing import PACKINGS, TOKEN_PACKING
from kvxfer.plan.pairing import BlockPairs, pair_blocks, pairing_unit
from kvxfer.plan.regions import RegionPlan
from kvxfer.plan.topology import HeadSlice

U64 = np.uint64
U64Array = npt.NDArray[np.uint64]

SPLITTABLE_LAYOUTS = HEADS_OUTSIDE_TOKENS


class IncompatibleLayoutError(ValueError):
    """Two peers' cache geometries cannot be bridged by byte copies."""


class ConversionNeeded(IncompatibleLayoutError):
    """Byte copies cannot place the heads, a staged read can (:mod:`kvxfer.plan.staging`)."""


@dataclass(frozen=True)
class SideGeometry:
    """Where every chunk of block 0 lives on one peer, per (layer, chunk index).

    ``base``/``block_stride``/``mem`` are ``[layers, chunks]`` arrays (bytes and
    memory-entry index); chunk index = head index of the view when
    ``heads_contiguous``, else the single page (index 0). Chunks, strides and
    ``chunk_len`` are per kernel block; ``num_blocks`` and ``block_size`` are logical,
    each logical block ``kernel_ratio`` kernel blocks (:class:`RegionPlan`).
    """

    layout: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    separate_kv_head_groups: bool
    heads_contiguous: bool
    chunk_len: int
    base: npt.NDArray[np.int64]
    block_stride: npt.NDArray[np.int64]
    mem: npt.NDArray[np.int64]
    devices: npt.NDArray[np.uint64]
    latent: bool = False  # one MLA latent per token (RegionPlan.latent)
    kv_packing: str = TOKEN_PACKING  # how K and V share a head's block (AgentMetadata)
    kernel_ratio: int = 1  # kernel blocks per logical block (RegionPlan.kernel_ratio)

    @classmethod
    def from_plan(cls, plan: RegionPlan, kv_packing: str = TOKEN_PACKING) -> SideGeometry:
        validate_plan(plan)
        contiguous = plan.heads_contiguous
        chunks = plan.num_heads if contiguous else 1
        shape = (plan.num_layers, chunks)
        base = np.full(shape, -1, dtype=np.int64)
        stride = np.zeros(shape, dtype=np.int64)
        mem = np.zeros(shape, dtype=np.int64)
        for region in plan.regions:
            heads = range(region.head_start, region.head_start + region.num_heads) \
                if contiguous else range(1)
            for layer in region.layers:
                for head in heads:
                    base[layer, head] = region.base_addr + region.chunk_offset(
                        layer, head if contiguous else region.head_start)
                    stride[layer, head] = region.block_stride
                    mem[layer, head] = region.mem_index
        if (base < 0).any():
            layer, head = (int(x) for x in np.argwhere(base < 0)[0])
            raise ValueError(f"region plan does not cover layer {layer} head {head}")
        devices = np.array([m.device_id for m in plan.memory], dtype=U64)
        chunk_len = plan.head_len * (1 if contiguous else plan.num_heads)
        return cls(plan.layout, plan.num_blocks, plan.block_size, plan.num_kv_heads,
                   plan.separate_kv_head_groups, contiguous, chunk_len, base, stride, mem, devices,
                   plan.latent, kv_packing, plan.kernel_ratio)

    @property
    def num_layers(self) -> int:
        return int(self.base.shape[0])

    @property
    def kernel_block_size(self) -> int:
        """Tokens per kernel block: what one chunk holds."""
        return self.block_size // self.kernel_ratio

    @property
    def num_view_heads(self) -> int:
        """H of the views: KV heads, or K and V head groups side by side."""
        return self.num_kv_heads * (2 if self.separate_kv_head_groups else 1)


def validate_plan(plan: RegionPlan) -> None:
    """Check a (possibly remote) plan is self-consistent: every region inside its memory
    entry, blocks that do not overlap, head geometry that stays inside a block."""
    if not plan.regions or not plan.memory:
        raise ValueError("region plan has no regions or no memory entries")
    if min(plan.num_blocks, plan.num_layers, plan.num_heads, plan.head_len) <= 0:
        raise ValueError(f"region plan has non-positive sizes: blocks={plan.num_blocks}, "
                         f"layers={plan.num_layers}, heads={plan.num_heads}, "
                         f"head_len={plan.head_len}")
    if plan.kernel_ratio <= 0 or plan.block_size <= 0 or plan.block_size % plan.kernel_ratio:
        raise ValueError(f"region plan's blocks of {plan.block_size} tokens cannot be "
                         f"{plan.kernel_ratio} kernel blocks each")
    blocks = plan.num_kernel_blocks  # what regions address
    for i, region in enumerate(plan.regions):
        if not 0 <= region.mem_index < len(plan.memory):
            raise ValueError(f"region {i} names memory entry {region.mem_index}, "
                             f"but the plan has {len(plan.memory)}")
        mem = plan.memory[region.mem_index]
        end = region.base_addr + (blocks - 1) * region.block_stride + region.block_len
        if region.base_addr < mem.addr or end > mem.addr + mem.nbytes:
            raise ValueError(f"region {i} spans [{region.base_addr:#x}, {end:#x}) outside its "
                             f"memory entry [{mem.addr:#x}, {mem.addr + mem.nbytes:#x})")
        if not region.layers or any(not 0 <= x < plan.num_layers for x in region.layers):
            raise ValueError(f"region {i} names layers {region.layers} outside "
                             f"0..{plan.num_layers - 1}")
        if region.heads_contiguous != plan.heads_contiguous or region.head_len != plan.head_len:
            raise ValueError(f"region {i} disagrees with region 0 on head geometry")
        if region.head_start < 0 or region.head_start + region.num_heads > plan.num_heads:
            raise ValueError(f"region {i} holds heads [{region.head_start}, "
                             f"{region.head_start + region.num_heads}) outside 0..{plan.num_heads}")
        heads = ((region.num_heads - 1) * region.head_stride + region.head_len
                 if region.heads_contiguous else region.num_heads * region.head_len)
        extent = (len(region.layers) - 1) * region.layer_stride + heads
        if min(region.layer_stride, region.head_stride) < 0 or extent > region.block_len or \
                (blocks > 1 and region.block_len > region.block_stride):
            raise ValueError(f"region {i}: its heads and layers span {extent} bytes of a "
                             f"{region.block_len}-byte block strided by {region.block_stride}")


def check_compatible(local: SideGeometry, remote: SideGeometry, local_tp: int, remote_tp: int,
                     plan: Sequence[HeadSlice]) -> None:
    """Raise :class:`IncompatibleLayoutError` with a plain-language reason, or return.

    ``local`` is the decode rank (the reader), ``remote`` one prefill rank.
    """
    if local.num_layers != remote.num_layers:
        raise IncompatibleLayoutError(
            f"decode has {local.num_layers} layers but prefill has {remote.num_layers}")
    small, large = sorted((local.block_size, remote.block_size))
    if large % small:
        raise IncompatibleLayoutError(
            f"decode block size {local.block_size} and prefill block size "
            f"{remote.block_size}: one must be a multiple of the other; run the sides with "
            f"--block-size values that divide each other (or equal ones)")
    if local.separate_kv_head_groups != remote.separate_kv_head_groups:
        raise IncompatibleLayoutError(
            "one side keeps K and V in separate head groups and the other packs them; "
            "use the same setting on both sides")
    if local.latent != remote.latent:
        kinds = {True: "an MLA latent cache", False: "K and V heads"}
        raise IncompatibleLayoutError(
            f"decode keeps {kinds[local.latent]} but prefill keeps {kinds[remote.latent]}: "
            f"the same bytes mean different things; run the same model on both sides")
    check_packings(local, remote)
    if local.kv_packing != remote.kv_packing:
        raise ConversionNeeded(
            f"decode packs K and V as {local.kv_packing!r}, prefill as {remote.kv_packing!r}")
    if local.kv_packing != TOKEN_PACKING and local.kernel_block_size != remote.kernel_block_size:
        # pairing cuts chunks at token boundaries, which only a per-token packing allows
        raise ConversionNeeded(
            f"K and V packed as {local.kv_packing!r} lie per kernel block, which byte copies "
            f"cannot cut: decode kernel blocks hold {local.kernel_block_size} tokens, "
            f"prefill's {remote.kernel_block_size}")
    full = all(s.count == local.num_kv_heads == remote.num_kv_heads for s in plan)
    if not full and not remote.heads_contiguous:
        relation = ">" if local_tp > remote_tp else "<" if local_tp < remote_tp else "="
        raise ConversionNeeded(
            f"prefill layout {remote.layout} cannot be head-split for decode TP {local_tp} "
            f"{relation} prefill TP {remote_tp}; use {', '.join(SPLITTABLE_LAYOUTS[:-1])} or "
            f"{SPLITTABLE_LAYOUTS[-1]} on the prefill side")
    if local.heads_contiguous != remote.heads_contiguous:
        raise ConversionNeeded(
            f"decode layout {local.layout} and prefill layout {remote.layout} order a block's "
            f"heads and tokens differently, which byte copies cannot reorder; use "
            f"{', '.join(SPLITTABLE_LAYOUTS)} on both sides (or LBNHC/BLNHC on both)")
    if local.chunk_len * remote.kernel_block_size != remote.chunk_len * local.kernel_block_size:
        raise IncompatibleLayoutError(
            f"decode chunks are {local.chunk_len // local.kernel_block_size} bytes per token "
            f"but prefill chunks are {remote.chunk_len // remote.kernel_block_size}: head size "
            f"or dtype differ")


def check_packings(local: SideGeometry, remote: SideGeometry) -> None:
    """Two packings of K and V can differ only where a conversion knows both."""
    if local.kv_packing != remote.kv_packing and not {
            local.kv_packing, remote.kv_packing} <= set(PACKINGS):
        raise IncompatibleLayoutError(
            f"decode packs K and V as {local.kv_packing!r}, prefill as {remote.kv_packing!r}; "
            f"kvxfer converts only between {' and '.join(map(repr, PACKINGS))}: "
            f"run both sides with the same packing")


@dataclass(frozen=True)
class RankDescriptors:
    """The READ toward one remote rank: matching local and remote descriptor rows."""

    remote_rank: int
    local: U64Array
    remote: U64Array

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum()) if len(self.local) else 0

    def __len__(self) -> int:
        return len(self.local)


def _chunk_slices(local: SideGeometry, remote: SideGeometry,
                  slices: Sequence[HeadSlice]) -> list[tuple[int, int, int]]:
    """Map KV-head slices to (remote chunk, local chunk, count) ranges, merged where adjacent."""
    if not local.heads_contiguous:
        return [(0, 0, 1)]
    ranges = [(s.remote_head_offset, s.local_head_offset, s.count) for s in slices]
    if local.separate_kv_head_groups:
        ranges += [(remote.num_kv_heads + r, local.num_kv_heads + lo, c) for r, lo, c in ranges]
    ranges.sort(key=lambda item: item[1])
    merged = [ranges[0]]
    for r, lo, c in ranges[1:]:
        pr, pl, pc = merged[-1]
        if pr + pc == r and pl + pc == lo:
            merged[-1] = (pr, pl, pc + c)
        else:
            merged.append((r, lo, c))
    return merged


def _fuse(grids: list[npt.NDArray[np.int64]], chunk_len: int
          ) -> tuple[list[npt.NDArray[np.int64]], int]:
    """Fuse grid axes contiguous on both sides into longer chunks.

    ``grids`` = [local base, remote base, local stride, remote stride, local mem,
    remote mem], each ``[layers, chunks]``. An axis fuses when stepping along it
    moves exactly one chunk on both sides, with equal block strides and memory.
    """
    changed = True
    while changed:
        changed = False
        for axis in (1, 0):
            size = grids[0].shape[axis]
            if size < 2:
                continue
            lbase, rbase = grids[0], grids[1]
            steps_ok = bool((np.diff(lbase, axis=axis) == chunk_len).all()
                            and (np.diff(rbase, axis=axis) == chunk_len).all())
            same = steps_ok and all(bool((np.diff(g, axis=axis) == 0).all()) for g in grids[2:])
            if same:
                grids = [np.take(g, [0], axis=axis) for g in grids]
                chunk_len *= size
                changed = True
    return grids, chunk_len


@dataclass(frozen=True)
class _FusedSlice:
    """One chunk-index range after axis fusion, arranged for per-request arithmetic.

    ``*_base``/``*_stride``/``*_mem`` are ``[layers, chunks]`` grids already
    transposed to local memory order (largest local step outermost), so that the
    flattened local addresses of sorted blocks come out ascending for every
    regular layout. ``block_outer`` says whether blocks vary slowest.
    """

    local_base: npt.NDArray[np.int64]
    remote_base: npt.NDArray[np.int64]
    local_stride: npt.NDArray[np.int64]
    remote_stride: npt.NDArray[np.int64]
    local_mem: npt.NDArray[np.int64]
    remote_mem: npt.NDArray[np.int64]
    block_outer: bool
    chunk_len: int

    @classmethod
    def arrange(cls, grids: list[npt.NDArray[np.int64]], chunk_len: int) -> _FusedSlice:
        lbase = grids[0]
        steps = {"layer": abs(int(lbase[1, 0] - lbase[0, 0])) if lbase.shape[0] > 1 else 0,
                 "chunk": abs(int(lbase[0, 1] - lbase[0, 0])) if lbase.shape[1] > 1 else 0}
        swap = steps["chunk"] > steps["layer"]
        lb, rb, ls, rs, lm, rm = ((g.T if swap else g).reshape(-1) for g in grids)
        block_step = int(grids[2][0, 0])
        return cls(lb, rb, ls, rs, lm, rm, block_outer=block_step >= max(steps.values()),
                   chunk_len=chunk_len)

    def addresses(self, pairs: BlockPairs, sub_len: int
                  ) -> tuple[npt.NDArray[np.int64], ...]:
        """Flattened (local, remote, local mem, remote mem, length) per chunk of the request;
        a sub-block ``k`` adds ``k * sub_len`` bytes on its side."""
        cells = len(self.local_base)
        local_ids, remote_ids = pairs.local_ids, pairs.remote_ids
        loff = 0 if pairs.local_sub is None else pairs.local_sub * sub_len
        roff = 0 if pairs.remote_sub is None else pairs.remote_sub * sub_len
        if self.block_outer:
            local = (local_ids[:, None] * self.local_stride[None] + self.local_base[None]
                     + np.reshape(loff, (-1, 1))).ravel()
            remote = (remote_ids[:, None] * self.remote_stride[None] + self.remote_base[None]
                      + np.reshape(roff, (-1, 1))).ravel()
            lmem, rmem = np.tile(self.local_mem, len(local_ids)), \
                np.tile(self.remote_mem, len(local_ids))
        else:
            local = (self.local_base[:, None] + local_ids[None] * self.local_stride[:, None]
                     + np.reshape(loff, (1, -1))).ravel()
            remote = (self.remote_base[:, None] + remote_ids[None] * self.remote_stride[:, None]
                      + np.reshape(roff, (1, -1))).ravel()
            lmem, rmem = np.repeat(self.local_mem, len(local_ids)), \
                np.repeat(self.remote_mem, len(local_ids))
        lengths = np.full(cells * len(local_ids), self.chunk_len, dtype=np.int64)
        return local, remote, lmem, rmem, lengths


def merge_runs(local: npt.NDArray[np.int64], remote: npt.NDArray[np.int64],
               lmem: npt.NDArray[np.int64], rmem: npt.NDArray[np.int64],
               lengths: npt.NDArray[np.int64], local_devices: U64Array,
               remote_devices: U64Array, remote_rank: int) -> RankDescriptors:
    """Merge neighbours (in local address order) contiguous on both sides, same memory."""
    if not len(local):
        empty = np.zeros((0, 3), dtype=U64)
        return RankDescriptors(remote_rank, empty, empty.copy())
    if not (local[1:] > local[:-1]).all():
        order = np.argsort(local, kind="stable")
        local, remote, lmem, rmem, lengths = (a[order] for a in (local, remote, lmem, rmem,
                                                                  lengths))
    brk = np.empty(len(local), dtype=bool)
    brk[0] = True
    np.not_equal(local[1:], local[:-1] + lengths[:-1], out=brk[1:])
    brk[1:] |= remote[1:] != remote[:-1] + lengths[:-1]
    brk[1:] |= lmem[1:] != lmem[:-1]
    brk[1:] |= rmem[1:] != rmem[:-1]
    starts = np.flatnonzero(brk)
    out_local = np.empty((len(starts), 3), dtype=U64)
    out_remote = np.empty((len(starts), 3), dtype=U64)
    out_local[:, 0] = local[starts]
    out_local[:, 1] = np.add.reduceat(lengths, starts)
    out_local[:, 2] = local_devices[lmem[starts]]
    out_remote[:, 0] = remote[starts]
    out_remote[:, 1] = out_local[:, 1]
    out_remote[:, 2] = remote_devices[rmem[starts]]
    return RankDescriptors(remote_rank, out_local, out_remote)


@dataclass(frozen=True)
class PeerReadPlan:
    """Everything about reading from one remote rank that does not depend on a request.

    Built once per (decode rank, prefill rank) pair, normally at handshake time;
    :meth:`build` then costs only the per-block address arithmetic and the merge.
    """

    remote_rank: int
    local: SideGeometry
    remote: SideGeometry
    slices: tuple[_FusedSlice, ...]

    @property
    def sub_len(self) -> int:
        """Bytes of one chunk's pairing unit (:func:`pairing_unit` tokens)."""
        return _sub_len(self.local, self.remote)

    def pair(self, local_block_ids: npt.ArrayLike, remote_block_ids: npt.ArrayLike,
             remote_num_blocks: int | None = None, remote_offset: int = 0) -> BlockPairs:
        """Validate and pair one request's logical block ids for :meth:`build`
        (``remote_offset``: see :func:`pair_blocks`)."""
        local, remote = self.local, self.remote
        return pair_blocks(local_block_ids, remote_block_ids, local.num_blocks,
                           remote.num_blocks if remote_num_blocks is None else remote_num_blocks,
                           local.block_size, remote.block_size, local.kernel_ratio,
                           remote.kernel_ratio, remote_offset)

    def build(self, pairs: BlockPairs) -> RankDescriptors:
        """Descriptors for one request's paired blocks (:meth:`pair`)."""
        parts = [piece.addresses(pairs, self.sub_len) for piece in self.slices]
        local, remote, lmem, rmem, lengths = parts[0] if len(parts) == 1 else \
            (np.concatenate([p[i] for p in parts]) for i in range(5))
        return merge_runs(local, remote, lmem, rmem, lengths, self.local.devices,
                          self.remote.devices, self.remote_rank)


def _sub_len(local: SideGeometry, remote: SideGeometry) -> int:
    """Bytes of one pairing unit of a local chunk (equal on both sides, checked)."""
    unit = pairing_unit(local.kernel_block_size, remote.kernel_block_size)
    return local.chunk_len // local.kernel_block_size * unit


def plan_peer_reads(local: SideGeometry, remotes: dict[int, SideGeometry],
                    plan: Sequence[HeadSlice], *, local_tp: int = 1,
                    remote_tp: int = 1) -> list[PeerReadPlan]:
    """Check the geometry pairs and precompute one :class:`PeerReadPlan` per remote rank."""
    by_rank: dict[int, list[HeadSlice]] = {}
    for piece in plan:
        by_rank.setdefault(piece.remote_rank, []).append(piece)
    out = []
    for rank, pieces in by_rank.items():
        remote = remotes.get(rank)
        if remote is None:
            raise ValueError(f"no geometry for prefill rank {rank}")
        for piece in pieces:  # before anything, a converted read included, relies on them
            if min(piece.local_head_offset, piece.remote_head_offset) < 0 or piece.count <= 0 \
                    or piece.local_head_offset + piece.count > local.num_kv_heads \
                    or piece.remote_head_offset + piece.count > remote.num_kv_heads:
                raise ValueError(f"head slice {piece} does not fit {local.num_kv_heads} local "
                                 f"and {remote.num_kv_heads} remote heads")
        check_compatible(local, remote, local_tp, remote_tp, pieces)
        fused = []
        for r0, l0, count in _chunk_slices(local, remote, pieces):
            grids = [local.base[:, l0:l0 + count], remote.base[:, r0:r0 + count],
                     local.block_stride[:, l0:l0 + count], remote.block_stride[:, r0:r0 + count],
                     local.mem[:, l0:l0 + count], remote.mem[:, r0:r0 + count]]
            fused.append(_FusedSlice.arrange(*_fuse(grids, _sub_len(local, remote))))
        out.append(PeerReadPlan(rank, local, remote, tuple(fused)))
    return out


def build_requests_descriptors(peers: Sequence[PeerReadPlan], local_block_ids: npt.ArrayLike,
                               remote_block_ids: npt.ArrayLike) -> list[RankDescriptors]:
    """One request's descriptors toward every planned remote rank (ids validated here)."""
    if not peers:
        return []
    remote_blocks = min(p.remote.num_blocks for p in peers)
    pairs = peers[0].pair(local_block_ids, remote_block_ids, remote_blocks)
    return [peer.build(pairs) for peer in peers]


def build_read_descriptors(local: SideGeometry, remotes: dict[int, SideGeometry],
                           plan: Sequence[HeadSlice], local_block_ids: npt.ArrayLike,
                           remote_block_ids: npt.ArrayLike, *, local_tp: int = 1,
                           remote_tp: int = 1) -> list[RankDescriptors]:
    """All descriptors one decode rank needs for a request, one entry per remote rank.

    Validates the geometry pairs, the head slices and every block id before
    building anything. Callers that read the same peers repeatedly should keep
    the :func:`plan_peer_reads` result and call :func:`build_requests_descriptors`.
    """
    peers = plan_peer_reads(local, remotes, plan, local_tp=local_tp, remote_tp=remote_tp)
    return build_requests_descriptors(peers, local_block_ids, remote_block_ids)
