"""Reads that byte copies cannot place: READ into a staging buffer, then convert.

Direct descriptors need every run the decode wants to be contiguous on both
sides. Two cases break that, and both are converted here instead of refused:

* the prefill keeps tokens outside heads (LBNHC, BLNHC: a layer page is
  ``[N, H, C]``) and this decode rank needs only some of its heads (a TP
  mismatch), so no head is a contiguous run there;
* the two sides order a block's heads and tokens differently (heads outside
  tokens on one side, inside on the other), so a run on one side is scattered
  on the other.

The decode then READs whole chunks of the prefill (a layer page where tokens are
outside heads; one head's ``[N, C]`` where heads are outside tokens, only the
heads it needs) for the request's blocks into a staging buffer it registered,
in (block, layer, chunk) order, merged into one descriptor wherever the prefill
side is contiguous too. Once the READ completed, :meth:`StagedRead.convert`
copies each needed head from the staged chunks into the decode's own views with
torch. Where the two sides pack K and V differently inside a head's block, K and
V are taken apart through each side's packing
(:func:`kvxfer.engine.attention.kv_views`) and copied one after the other.

Where the prefill is a process on the decode's host, :mod:`kvxfer.host_reads` does the
same conversion without staging, with a byte map it takes from :meth:`StagedRead.convert`.

Logical block sizes must be equal on a converted path (checked when planning);
kernel block sizes may differ. Staging holds the prefill's kernel blocks, each
logical block's in order; the conversion regroups their tokens into the decode's
kernel blocks (K and V apart where a packing depends on the kernel block size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.descriptors import (
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
from kvxfer.protocol import TOKEN_PACKING
from kvxfer.topology import HeadSlice


@dataclass(frozen=True)
class StagedRead:
    """The READ from one remote rank through staging, built once per peer.

    ``chunks`` are the remote chunk indices read for every layer and kernel block
    (view heads where the remote's heads are contiguous, else the single page ``0``);
    ``heads`` are (remote view head, local view head, count) ranges to place. Block ids
    given to it are logical; staging slots are per remote kernel block.
    """

    remote_rank: int
    local: SideGeometry
    remote: SideGeometry
    chunks: tuple[int, ...]
    heads: tuple[tuple[int, int, int], ...]

    @property
    def bytes_per_block(self) -> int:
        """Staging bytes one (logical) request block needs: what the READ moves."""
        geo = self.remote
        return geo.kernel_ratio * geo.num_layers * len(self.chunks) * geo.chunk_len

    @property
    def placed_per_block(self) -> int:
        """Bytes of one request block this rank keeps (its heads) once converted."""
        geo = self.remote
        per_head = geo.chunk_len // (1 if geo.heads_contiguous else geo.num_view_heads)
        return geo.kernel_ratio * geo.num_layers * sum(n for _, _, n in self.heads) * per_head

    def descriptors(self, remote_ids: np.ndarray, staging_addr: int,
                    staging_device: int = 0) -> RankDescriptors:
        """Remote chunks of logical ``remote_ids`` (request order) into staging at
        ``staging_addr``, slot ``(position, kernel block, layer, chunk)``; contiguous
        neighbours merged."""
        geo, chunks = self.remote, np.asarray(self.chunks, dtype=np.int64)
        ratio = geo.kernel_ratio
        kernel_ids = (np.asarray(remote_ids, dtype=np.int64)[:, None] * ratio
                      + np.arange(ratio, dtype=np.int64)).reshape(-1)
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
                local_ids: torch.Tensor, remote_packing: str = "token",
                local_packing: str = "token") -> None:
        """Copy the staged heads into this rank's views (its ``[B, H, N, C]`` views by
        logical layer, at its kernel block size, as :func:`layer_groups` of them) at
        logical blocks ``local_ids`` (request order, as the READ was built).

        One copy per logical block, head range and layer group: views that are one
        allocation at a fixed layer stride are one group, so a block's layers move in
        one call; indexing every view with the ids instead costs a few times more
        (measured about 1.8 vs 5.3 GB/s on one thread)."""
        from kvxfer.engine.attention import kv_views

        first = groups[0][1]
        geo, local = self.remote, self.local
        count = len(local_ids) * geo.kernel_ratio  # staged kernel blocks
        elems = geo.chunk_len // first.element_size()
        typed = staging[: len(local_ids) * self.bytes_per_block].view(first.dtype)
        staged = typed.view(count, geo.num_layers, len(self.chunks), elems)
        content, r_in, r_out = first.shape[-1], geo.kernel_ratio, local.kernel_ratio
        # K and V move together (one copy per head range) where both sides lay them out
        # alike in a kernel block: the same packing, and per token or at one kernel size
        together = remote_packing == local_packing and (
            local_packing == TOKEN_PACKING or r_in == r_out)
        blocks = local_ids.tolist()
        for layer, group in groups:  # group: [kernel blocks, G, H, N, C]
            part = staged[:, layer:layer + group.shape[1]]
            if geo.heads_contiguous:  # chunk = one view head, [N, C]
                heads = part.reshape(count, group.shape[1], len(self.chunks),
                                     geo.kernel_block_size, content)
            else:  # chunk = the page, [N, H, C]
                heads = part[:, :, 0].reshape(count, group.shape[1], geo.kernel_block_size,
                                              -1, content).permute(0, 1, 3, 2, 4)
            for r0, l0, n in self.heads:
                s0 = self.chunks.index(r0) if geo.heads_contiguous else r0
                for position, block in enumerate(blocks):
                    dst = group[block * r_out:(block + 1) * r_out, :, l0:l0 + n]
                    src = heads[position * r_in:(position + 1) * r_in, :, s0:s0 + n]
                    pairs = [(dst, src)] if together else zip(
                        kv_views(dst, local_packing), kv_views(src, remote_packing),
                        strict=True)
                    for d, s in pairs:
                        d.copy_(rekernel(s, r_in, r_out))


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


def rekernel(blocks: torch.Tensor, from_ratio: int, to_ratio: int) -> torch.Tensor:
    """``[n * from_ratio, ..., k, X]`` kernel blocks (``from_ratio`` per logical block, in
    order; any dims between, such as layers and heads) regrouped as
    ``[n * to_ratio, ..., k * from_ratio // to_ratio, X]``: the same logical blocks'
    tokens at another kernel block size."""
    if from_ratio == to_ratio:
        return blocks
    kernels, *mid, tokens, width = blocks.shape
    count = kernels // from_ratio
    logical = blocks.reshape(count, from_ratio, *mid, tokens, width).movedim(1, -3)
    regrouped = logical.reshape(count, *mid, to_ratio, -1, width).movedim(-3, 1)
    return regrouped.reshape(count * to_ratio, *mid, -1, width)


def plan_staged_read(local: SideGeometry, remote: SideGeometry, remote_rank: int,
                     slices: Sequence[HeadSlice], why: str = "") -> StagedRead:
    """A :class:`StagedRead` for ``slices`` of ``remote_rank``; raises
    :class:`IncompatibleLayoutError` when even staging cannot bridge the two (``why``:
    the reason byte copies could not, for the message)."""
    if local.num_layers != remote.num_layers:
        raise IncompatibleLayoutError(
            f"decode has {local.num_layers} layers but prefill has {remote.num_layers}")
    if local.block_size != remote.block_size:
        raise IncompatibleLayoutError(
            f"decode layout {local.layout} and prefill layout {remote.layout} need a "
            f"conversion, which needs equal block sizes; decode has {local.block_size}, "
            f"prefill {remote.block_size}" + (f" (a conversion because {why})" if why else ""))
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
               plan: Sequence[HeadSlice], *, local_tp: int = 1, remote_tp: int = 1
               ) -> list[PeerReadPlan | StagedRead]:
    """Per remote rank: direct descriptors where byte copies place every head, else a
    staged read (see the module docstring); raises :class:`IncompatibleLayoutError`
    when neither can."""
    by_rank: dict[int, list[HeadSlice]] = {}
    for piece in plan:
        by_rank.setdefault(piece.remote_rank, []).append(piece)
    out: list[PeerReadPlan | StagedRead] = []
    for rank, pieces in by_rank.items():
        try:
            out.extend(plan_peer_reads(local, remotes, pieces, local_tp=local_tp,
                                       remote_tp=remote_tp))
        except ConversionNeeded as exc:
            out.append(plan_staged_read(local, remotes[rank], rank, pieces, str(exc)))
    return out
