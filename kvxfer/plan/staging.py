"""Reads that byte copies cannot place: READ into a staging buffer, then convert.

Two cases: a prefill that keeps tokens outside heads read by a rank that needs only some of
its heads, and two sides that order a block's heads and tokens differently. A
:class:`StagedRead` plans the READ into staging and the torch copies that place it; block
sizes may differ, logical and kernel alike.

Design: docs/design/converted-reads.md
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.plan.descriptors import (
    U64,
    ConversionNeeded,
    IncompatibleLayoutError,
    PeerReadPlan,
    RankDescriptors,
    SideGeometry,
    check_packings,
    merge_runs,
    plan_peer_reads,
)
from kvxfer.plan.packing import TOKEN_PACKING, kv_views
from kvxfer.plan.pairing import validate_block_ids, validate_paired_ids
from kvxfer.plan.topology import HeadSlice

# how StagedRead.place copies one piece: (target, source), same shape and dtype
Copy = Callable[[torch.Tensor, torch.Tensor], object]


def _torch_copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source)


@dataclass(frozen=True)
class StagedRead:
    """The READ from one remote rank through staging, built once per peer.

    ``chunks`` are the remote chunk indices read for every layer and kernel block
    (view heads where the remote's heads are contiguous, else the single page ``0``);
    ``heads`` are (remote view head, local view head, count) ranges to place. Block ids
    given to it are logical; staging slots are per remote kernel block. The two sides'
    logical block sizes may differ (one a multiple of the other): a request's tokens
    then pair in order, as :func:`~kvxfer.plan.pairing.pair_blocks` pairs them.
    """

    remote_rank: int
    local: SideGeometry
    remote: SideGeometry
    chunks: tuple[int, ...]
    heads: tuple[tuple[int, int, int], ...]

    @property
    def bytes_per_block(self) -> int:
        """Staging bytes one remote (logical) block needs: what the READ moves for it."""
        geo = self.remote
        return geo.kernel_ratio * geo.num_layers * len(self.chunks) * geo.chunk_len

    @property
    def placed_per_block(self) -> int:
        """Bytes of one remote block this rank keeps (its heads) once converted."""
        geo = self.remote
        per_head = geo.chunk_len // (1 if geo.heads_contiguous else geo.num_view_heads)
        return geo.kernel_ratio * geo.num_layers * sum(n for _, _, n in self.heads) * per_head

    def ids(self, local_block_ids: Sequence[int] | np.ndarray,
            remote_block_ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A request's logical ids, validated, in the order the READ stages them: pairs
        sorted by local id at equal block sizes, request (token) order otherwise."""
        local, remote = self.local, self.remote
        if local.block_size == remote.block_size:
            return validate_block_ids(local_block_ids, remote_block_ids, local.num_blocks,
                                      remote.num_blocks)
        return validate_paired_ids(local_block_ids, remote_block_ids, local.num_blocks,
                                   remote.num_blocks, local.block_size, remote.block_size)

    def parts(self, local_count: int, remote_count: int, part_bytes: int
              ) -> list[tuple[slice, slice]]:
        """(local ids, remote ids) slices of a request (:meth:`ids`) cut into parts of
        about ``part_bytes`` of staging, each whole blocks on both sides."""
        local_per = max(1, self.remote.block_size // self.local.block_size)
        remote_per = max(1, self.local.block_size // self.remote.block_size)
        step = max(1, part_bytes // (remote_per * self.bytes_per_block))  # larger blocks
        units = -(-remote_count // remote_per) if remote_per > 1 else \
            -(-local_count // local_per)
        return [(slice(u * local_per, min((u + step) * local_per, local_count)),
                 slice(u * remote_per, min((u + step) * remote_per, remote_count)))
                for u in range(0, units, step)]

    def shares(self, local_count: int, remote_count: int, count: int
               ) -> list[tuple[slice, slice]]:
        """A request (:meth:`ids`) cut into ``count`` contiguous shares of whole blocks of
        both sides, as even as the blocks allow (empty ones where there are fewer)."""
        units = self.parts(local_count, remote_count, 1)  # one block of the larger size each
        bounds = np.linspace(0, len(units), count + 1).astype(int)
        return [(slice(units[lo][0].start, units[hi - 1][0].stop),
                 slice(units[lo][1].start, units[hi - 1][1].stop)) if hi > lo
                else (slice(0, 0), slice(0, 0)) for lo, hi in itertools.pairwise(bounds)]

    def descriptors(self, remote_ids: np.ndarray, staging_addr: int,
                    staging_device: int = 0) -> RankDescriptors:
        """Remote chunks of logical ``remote_ids`` (request order) into staging at
        ``staging_addr``, slot ``(position, kernel block, layer, chunk)``; contiguous
        neighbours merged."""
        geo, chunks = self.remote, np.asarray(self.chunks, dtype=np.int64)
        kernel_ids = kernel_rows(remote_ids, geo.kernel_ratio)
        base = geo.base[:, chunks]            # [layers, chunks]
        stride = geo.block_stride[:, chunks]
        mem = geo.mem[:, chunks]
        remote = (kernel_ids[:, None, None] * stride[None] + base[None]).reshape(-1)
        rmem = np.broadcast_to(mem[None], (len(kernel_ids), *mem.shape)).reshape(-1)
        local = staging_addr + np.arange(len(remote), dtype=np.int64) * geo.chunk_len
        lengths = np.full(len(remote), geo.chunk_len, dtype=np.int64)
        return merge_runs(local, remote, np.zeros(len(remote), dtype=np.int64), rmem, lengths,
                          np.array([staging_device], dtype=U64), geo.devices, self.remote_rank)

    def convert(self, staging: torch.Tensor, groups: Sequence[tuple[int, torch.Tensor]],
                local_ids: torch.Tensor | np.ndarray, remote_packing: str = TOKEN_PACKING,
                local_packing: str = TOKEN_PACKING, remote_blocks: int | None = None) -> None:
        """Copy the staged heads into this rank's views (its ``[B, H, N, C]`` views by
        logical layer, at its kernel block size, as :func:`layer_groups` of them) at
        logical blocks ``local_ids`` (request order, as the READ was built), from
        ``remote_blocks`` staged remote blocks (default: one per local block)."""
        remote_blocks = len(local_ids) if remote_blocks is None else remote_blocks
        count = remote_blocks * self.remote.kernel_ratio  # staged kernel blocks
        first = groups[0][1]
        typed = staging[: remote_blocks * self.bytes_per_block].view(first.dtype)
        staged = typed.view(count, self.remote.num_layers, len(self.chunks),
                            self.remote.chunk_len // first.element_size())
        self.place(staged, self.chunks, np.arange(count), groups, local_ids, remote_packing,
                   local_packing)

    def kv_together(self, remote_packing: str, local_packing: str) -> bool:
        """Whether :meth:`place` moves K and V together in every piece for these packings:
        the sides pack them alike, and per token or in whole kernel blocks (equal kernel
        block sizes, so that every :func:`token_segments` run is whole)."""
        return remote_packing == local_packing and (
            local_packing == TOKEN_PACKING
            or self.local.kernel_block_size == self.remote.kernel_block_size)

    def place(self, source: torch.Tensor, chunks: Sequence[int], rows: np.ndarray,
              groups: Sequence[tuple[int, torch.Tensor]], local_ids: torch.Tensor | np.ndarray,
              remote_packing: str = TOKEN_PACKING, local_packing: str = TOKEN_PACKING,
              copy: Copy | None = None, skip: int = 0) -> None:
        """Copy this rank's heads of the request's remote kernel blocks, rows ``rows`` of
        ``source`` in token order (``[kernel blocks, layers, chunks, chunk elements]``
        holding remote chunks ``chunks``: staging, or the prefill's memory itself,
        :mod:`kvxfer.transfer.converted.mapped_reads`), from token ``skip`` of the first row
        on, into view ``groups`` at logical blocks
        ``local_ids``, each piece with ``copy(target, source)`` (default: torch's
        ``copy_``, which may share a large piece out over torch's intra-op threads).
        ``source`` and the groups may be numpy arrays instead, with numpy's copy, where
        :meth:`kv_together` (no piece then needs :func:`kv_views`).

        One copy per :func:`token_segments` run, head range and layer group: views that
        are one allocation at a fixed layer stride are one group, so a block's layers
        move in one call; indexing every view with the ids instead costs a few times
        more (measured about 1.8 vs 5.3 GB/s on one thread)."""
        copy = copy or _torch_copy
        geo, content = self.remote, groups[0][1].shape[-1]
        count = source.shape[0]
        segments = token_segments(np.asarray(local_ids, dtype=np.int64), rows, self.local, geo,
                                  skip)
        # K and V move together (one copy per head range) where both sides lay them out
        # alike for the rows copied: whole kernel blocks of one packing, or rows of tokens
        # packed per token on both sides
        whole_together = remote_packing == local_packing
        rows_together = remote_packing == local_packing == TOKEN_PACKING
        for layer, group in groups:  # group: [kernel blocks, G, H, N, C]
            part = source[:, layer:layer + group.shape[1]]
            if geo.heads_contiguous:  # chunk = one view head, [N, C]
                heads = part.reshape(count, group.shape[1], len(chunks),
                                     geo.kernel_block_size, content)
            else:  # chunk = the page, [N, H, C]
                heads = part[:, :, 0].reshape(count, group.shape[1], geo.kernel_block_size,
                                              -1, content).swapaxes(2, 3)
            for r0, l0, n in self.heads:
                s0 = chunks.index(r0) if geo.heads_contiguous else r0
                for seg in segments:
                    dst = group[seg.local:seg.local + seg.kernels, :, l0:l0 + n]
                    src = heads[seg.remote:seg.remote + seg.kernels, :, s0:s0 + n]
                    together = whole_together if seg.whole else rows_together
                    pairs = [(dst, src)] if together else zip(
                        kv_views(dst, local_packing), kv_views(src, remote_packing),
                        strict=True)
                    for d, s in pairs:
                        if seg.whole:
                            copy(d, s)
                        else:
                            copy(d[..., seg.local_row:seg.local_row + seg.rows, :],
                                 s[..., seg.remote_row:seg.remote_row + seg.rows, :])


@dataclass(frozen=True)
class Segment:
    """Rows of a request copied in one call: ``kernels`` whole kernel blocks from source
    kernel block ``remote`` on into local kernel blocks ``local`` on (``whole``), or
    ``rows`` tokens from row ``remote_row`` of one source kernel block into row
    ``local_row`` of one local one."""

    local: int
    remote: int
    kernels: int = 1
    whole: bool = True
    local_row: int = 0
    remote_row: int = 0
    rows: int = 0


def token_segments(local_ids: np.ndarray, rows: np.ndarray, local: SideGeometry,
                   remote: SideGeometry, skip: int = 0) -> list[Segment]:
    """How the request's tokens go from the remote kernel blocks at ``rows`` of a source
    (token order, from its token ``skip`` on: fewer than a remote kernel block's) into the
    local kernel blocks of logical ``local_ids``, in token order up to the shorter side's
    end. Where both sides' kernel blocks hold the same tokens, whole kernel blocks move,
    consecutive ones on both sides in one segment; otherwise each overlap of a local and a
    remote kernel block is a segment of rows."""
    kl, kr = local.kernel_block_size, remote.kernel_block_size
    if not 0 <= skip < kr:
        raise ValueError(f"a source's first {skip} tokens cannot be skipped: its kernel blocks "
                         f"hold {kr}")
    tokens = min(len(local_ids) * local.block_size, len(rows) * kr - skip)
    if tokens <= 0:
        return []
    kernel = kernel_rows(local_ids, local.kernel_ratio)
    if kl == kr and not skip:
        ids, source = kernel[:tokens // kl], np.asarray(rows[:tokens // kl], dtype=np.int64)
        starts = np.flatnonzero(np.concatenate([[True], (np.diff(ids) != 1)
                                                | (np.diff(source) != 1)]))
        counts = np.diff(np.append(starts, len(ids)))
        return [Segment(int(ids[s]), int(source[s]), int(c))
                for s, c in zip(starts, counts, strict=True)]
    # local token a is source token a + skip
    bounds = np.union1d(np.arange(0, tokens, kl), np.arange(-skip, tokens, kr).clip(0))
    ends = np.append(bounds[1:], tokens)
    return [Segment(int(kernel[a // kl]), int(rows[(a + skip) // kr]), 1, False, int(a % kl),
                    int((a + skip) % kr), int(b - a))
            for a, b in zip(bounds.tolist(), ends.tolist(), strict=True)]


def layer_groups(views: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """``(first layer, [B, G, H, N, C] view)`` covering ``views`` (``[B, H, N, C]`` each) in
    order: consecutive views of one allocation with equal shapes and strides, spaced
    by one layer stride, become one view with the layers as its second dim; any other
    view is a group of its own."""
    groups: list[tuple[int, torch.Tensor]] = []
    start = 0
    while start < len(views):
        first, end = views[start], start + 1
        step = views[end].data_ptr() - first.data_ptr() if end < len(views) else 0
        if step > 0 and step % first.element_size() == 0:
            while end < len(views) and _alike(first, views[end]) and \
                    views[end].data_ptr() - views[end - 1].data_ptr() == step:
                end += 1
        layer_stride = step // first.element_size() if end - start > 1 else 1
        groups.append((start, first.as_strided((first.shape[0], end - start, *first.shape[1:]),
                                               (first.stride(0), layer_stride,
                                                *first.stride()[1:]))))
        start = end
    return groups


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, strides and dtype, in the same allocation."""
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and \
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def plan_staged_read(local: SideGeometry, remote: SideGeometry, remote_rank: int,
                     slices: Sequence[HeadSlice]) -> StagedRead:
    """A :class:`StagedRead` for ``slices`` of ``remote_rank``; raises
    :class:`IncompatibleLayoutError` when even staging cannot bridge the two."""
    if local.num_layers != remote.num_layers:
        raise IncompatibleLayoutError(
            f"decode has {local.num_layers} layers but prefill has {remote.num_layers}")
    if local.separate_kv_head_groups != remote.separate_kv_head_groups:
        raise IncompatibleLayoutError(
            "one side keeps K and V in separate head groups and the other packs them; "
            "use the same setting on both sides")
    check_packings(local, remote)
    per_token = (local.chunk_len // (1 if local.heads_contiguous else local.num_view_heads),
                 remote.chunk_len // (1 if remote.heads_contiguous else remote.num_view_heads))
    if per_token[0] * remote.kernel_block_size != per_token[1] * local.kernel_block_size:
        raise IncompatibleLayoutError(
            f"decode heads are {per_token[0] // local.kernel_block_size} bytes per token but "
            f"prefill heads are {per_token[1] // remote.kernel_block_size}: head size or "
            f"dtype differ")
    heads: list[tuple[int, int, int]] = []
    for piece in slices:
        heads.append((piece.remote_head_offset, piece.local_head_offset, piece.count))
        if local.separate_kv_head_groups:
            heads.append((remote.num_kv_heads + piece.remote_head_offset,
                          local.num_kv_heads + piece.local_head_offset, piece.count))
    if remote.heads_contiguous:
        chunks = tuple(sorted({r + k for r, _, n in heads for k in range(n)}))
    else:
        chunks = (0,)
    return StagedRead(remote_rank, local, remote, chunks, tuple(heads))


def plan_reads(local: SideGeometry, remotes: dict[int, SideGeometry],
               plan: Sequence[HeadSlice], *, local_tp: int = 1, remote_tp: int = 1,
               convert_cut: bool = False) -> list[PeerReadPlan | StagedRead]:
    """Per remote rank: direct descriptors where byte copies place every head, else a
    staged read (READ into staging, then converted); raises :class:`IncompatibleLayoutError`
    when neither can. With ``convert_cut`` (a host cache), byte copies that two kernel
    block sizes cut at every block of the smaller one (a descriptor per run: 8 KiB runs
    of Llama-8B-like heads, 2-3.5x the time of an equal-size read) are converted too: a
    few long READs and a local copy, or one copy from a mapped cache."""
    by_rank: dict[int, list[HeadSlice]] = {}
    for piece in plan:
        by_rank.setdefault(piece.remote_rank, []).append(piece)
    out: list[PeerReadPlan | StagedRead] = []
    for rank, pieces in by_rank.items():
        try:
            direct = plan_peer_reads(local, remotes, pieces, local_tp=local_tp,
                                     remote_tp=remote_tp)
        except ConversionNeeded:
            direct = []
        if direct and not (convert_cut and
                           local.kernel_block_size != remotes[rank].kernel_block_size):
            out.extend(direct)
        else:
            out.append(plan_staged_read(local, remotes[rank], rank, pieces))
    return out


def fixed_strides(base: np.ndarray, block_stride: np.ndarray
                  ) -> tuple[int, int, int, int] | None:
    """(first chunk's address, layer stride, chunk stride, block stride) where every chunk
    of ``base`` (``[layers, chunks]``) lies at fixed, non-negative strides and every block
    stride is one; else None."""
    first = int(base[0, 0])
    layer = int(base[1, 0] - first) if base.shape[0] > 1 else 0
    chunk = int(base[0, 1] - first) if base.shape[1] > 1 else 0
    grid = first + np.arange(base.shape[0])[:, None] * layer \
        + np.arange(base.shape[1])[None] * chunk
    if min(layer, chunk) < 0 or not (base == grid).all() or \
            not (block_stride == block_stride[0, 0]).all() or block_stride[0, 0] <= 0:
        return None
    return first, layer, chunk, int(block_stride[0, 0])


# numpy's view of a tensor's elements, by element size (numpy lacks bfloat16 and fp8)
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of ``tensor``'s elements, as integers of its element size."""
    return tensor.view(_SAME_SIZE[tensor.element_size()]).numpy()


def kernel_rows(block_ids: Sequence[int] | np.ndarray, kernel_ratio: int) -> np.ndarray:
    """The kernel blocks of logical ``block_ids``, in order: block ``b`` is kernel blocks
    ``b * kernel_ratio .. b * kernel_ratio + kernel_ratio - 1``."""
    return (np.asarray(block_ids, dtype=np.int64)[:, None] * kernel_ratio
            + np.arange(kernel_ratio, dtype=np.int64)).reshape(-1)


def chunk_view(memory: torch.Tensor, geometry: SideGeometry, start: int) -> torch.Tensor | None:
    """``geometry``'s chunks as ``[kernel blocks, layers, chunks, chunk elements]`` of
    ``memory`` (a tensor of the cache's dtype whose storage's first byte lies at address
    ``start`` of the geometry's process), what :meth:`StagedRead.place` reads from; None
    unless every chunk lies at fixed strides inside that storage."""
    strides = fixed_strides(geometry.base, geometry.block_stride)
    size = memory.element_size()
    if strides is None or strides[0] < start or \
            any(x % size for x in (strides[0] - start, *strides[1:], geometry.chunk_len)):
        return None
    first, layer, chunk, block = (x // size for x in (strides[0] - start, *strides[1:]))
    layers, chunks = geometry.base.shape
    try:
        return memory.as_strided((geometry.num_blocks * geometry.kernel_ratio, layers, chunks,
                                  geometry.chunk_len // size), (block, layer, chunk, 1), first)
    except RuntimeError:  # past the storage's end: the chunks lie elsewhere
        return None
