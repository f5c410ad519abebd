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

Block sizes must be equal on a converted path (checked when planning).
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
from kvxfer.topology import HeadSlice


@dataclass(frozen=True)
class StagedRead:
    """The READ from one remote rank through staging, built once per peer.

    ``chunks`` are the remote chunk indices read for every layer and block (view
    heads where the remote's heads are contiguous, else the single page ``0``);
    ``heads`` are (remote view head, local view head, count) ranges to place.
    """

    remote_rank: int
    local: SideGeometry
    remote: SideGeometry
    chunks: tuple[int, ...]
    heads: tuple[tuple[int, int, int], ...]

    @property
    def bytes_per_block(self) -> int:
        """Staging bytes one request block needs: what the READ moves."""
        return self.remote.num_layers * len(self.chunks) * self.remote.chunk_len

    @property
    def placed_per_block(self) -> int:
        """Bytes of one request block this rank keeps (its heads) once converted."""
        geo = self.remote
        per_head = geo.chunk_len // (1 if geo.heads_contiguous else geo.num_view_heads)
        return geo.num_layers * sum(n for _, _, n in self.heads) * per_head

    def descriptors(self, remote_ids: np.ndarray, staging_addr: int,
                    staging_device: int = 0) -> RankDescriptors:
        """Remote chunks of ``remote_ids`` (request order) into staging at ``staging_addr``,
        slot ``(position, layer, chunk)``; contiguous neighbours merged."""
        geo, chunks = self.remote, np.asarray(self.chunks, dtype=np.int64)
        base = geo.base[:, chunks]            # [layers, chunks]
        stride = geo.block_stride[:, chunks]
        mem = geo.mem[:, chunks]
        remote = (remote_ids[:, None, None] * stride[None] + base[None]).reshape(-1)
        rmem = np.broadcast_to(mem[None], (len(remote_ids), *mem.shape)).reshape(-1)
        local = staging_addr + np.arange(len(remote), dtype=np.int64) * geo.chunk_len
        lengths = np.full(len(remote), geo.chunk_len, dtype=np.int64)
        return merge_runs(local, remote, np.zeros(len(remote), dtype=np.int64), rmem, lengths,
                          np.array([staging_device], dtype=U64), geo.devices, self.remote_rank)

    def convert(self, staging: torch.Tensor, local_views: Sequence[torch.Tensor],
                local_ids: torch.Tensor, remote_packing: str = "token",
                local_packing: str = "token") -> None:
        """Copy the staged heads into ``local_views`` (this rank's ``[B, H, N, C]`` views, by
        logical layer) at blocks ``local_ids`` (request order, as the READ was built)."""
        from kvxfer.engine.attention import kv_views

        first = local_views[0]
        count = len(local_ids)
        geo = self.remote
        elems = geo.chunk_len // first.element_size()
        typed = staging[: count * self.bytes_per_block].view(first.dtype)
        staged = typed.view(count, geo.num_layers, len(self.chunks), elems)
        content = first.shape[3]
        for layer, view in enumerate(local_views):
            if geo.heads_contiguous:  # chunk = one view head, [N, C]
                heads = staged[:, layer].view(count, len(self.chunks), geo.block_size, content)
            else:  # chunk = the page, [N, H, C]
                heads = staged[:, layer, 0].view(count, geo.block_size, -1, content) \
                    .permute(0, 2, 1, 3)
            # the same packing: K and V move together, one copy per head range
            pairs = [(view, heads)] if remote_packing == local_packing else \
                list(zip(kv_views(view, local_packing), kv_views(heads, remote_packing),
                         strict=True))
            for r0, l0, n in self.heads:
                s0 = self.chunks.index(r0) if geo.heads_contiguous else r0
                for dst, src in pairs:
                    dst[local_ids, l0:l0 + n] = src[:, s0:s0 + n]


def plan_staged_read(local: SideGeometry, remote: SideGeometry, remote_rank: int,
                     slices: Sequence[HeadSlice]) -> StagedRead:
    """A :class:`StagedRead` for ``slices`` of ``remote_rank``; raises
    :class:`IncompatibleLayoutError` when even staging cannot bridge the two."""
    if local.num_layers != remote.num_layers:
        raise IncompatibleLayoutError(
            f"decode has {local.num_layers} layers but prefill has {remote.num_layers}")
    if local.block_size != remote.block_size:
        raise IncompatibleLayoutError(
            f"decode layout {local.layout} and prefill layout {remote.layout} need a "
            f"conversion, which needs equal block sizes; decode has {local.block_size}, "
            f"prefill {remote.block_size}")
    if local.separate_kv_head_groups != remote.separate_kv_head_groups:
        raise IncompatibleLayoutError(
            "one side keeps K and V in separate head groups and the other packs them; "
            "use the same setting on both sides")
    check_packings(local, remote)
    per_token = (local.chunk_len // (1 if local.heads_contiguous else local.num_view_heads),
                 remote.chunk_len // (1 if remote.heads_contiguous else remote.num_view_heads))
    if per_token[0] != per_token[1]:
        raise IncompatibleLayoutError(
            f"decode heads are {per_token[0] // local.block_size} bytes per token but prefill "
            f"heads are {per_token[1] // remote.block_size}: head size or dtype differ")
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
        except ConversionNeeded:
            out.append(plan_staged_read(local, remotes[rank], rank, pieces))
    return out
