"""Push plans: which bytes one prefill rank WRITEs into which decode rank's blocks.

No I/O. A push moves exactly the bytes the decode's direct reads would move, planned as those
reads and swapped (this rank's rows are the WRITEs' sources); a layer group restricts a plan
to those layers. Where byte copies cannot place the heads, a :class:`ConvertedPush` first
converts into a shadow.

Design: docs/design/push.md#push-plans
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvxfer.plan.descriptors import (
    U64,
    ConversionNeeded,
    IncompatibleLayoutError,
    PeerReadPlan,
    RankDescriptors,
    SideGeometry,
    plan_peer_reads,
)
from kvxfer.plan.staging import (
    StagedRead,
    as_numpy,
    chunk_view,
    kernel_rows,
    plan_staged_read,
)
from kvxfer.plan.topology import HeadSlice, read_plan

# copies one piece of a conversion: (target, source) numpy arrays of one shape and dtype
NumpyCopy = Callable[[npt.NDArray[Any], npt.NDArray[Any]], object]


class PushRefused(IncompatibleLayoutError):
    """A push cannot place these bytes with WRITEs; the message says why and what to run."""


def check_layers(layers: range, num_layers: int) -> None:
    """ValueError unless ``layers`` is a layer group: a non-empty step-1 run inside
    ``range(num_layers)``."""
    if layers.step != 1 or not layers or layers.start < 0 or layers.stop > num_layers:
        raise ValueError(f"layer group {layers} is not a non-empty run of the {num_layers} "
                         f"layers")


def layers_of(geometry: SideGeometry, layers: range) -> SideGeometry:
    """``geometry`` restricted to ``layers`` (a step-1 range inside its layers): layer
    ``layers[i]`` becomes layer ``i``. ValueError for a range that does not fit."""
    check_layers(layers, geometry.num_layers)
    rows = slice(layers.start, layers.stop)
    return replace(geometry, base=geometry.base[rows],
                   block_stride=geometry.block_stride[rows], mem=geometry.mem[rows])


@dataclass
class PushPlan:
    """What prefill rank ``writer_rank`` WRITEs into decode rank ``target_rank`` for any
    request: the decode rank's read of this rank, planned per layer group on first use.
    ``writers``: how many prefill ranks write into that decode rank (the "done" count it
    waits for)."""

    writer_rank: int
    target_rank: int
    writers: int
    writer: SideGeometry
    target: SideGeometry
    tp: tuple[int, int]  # (decode TP, prefill TP)
    slices: tuple[HeadSlice, ...]  # the decode rank's slices read from writer_rank
    _groups: dict[range, PeerReadPlan] = field(default_factory=dict, repr=False)

    def group(self, layers: range | None = None) -> PeerReadPlan:
        """The read plan of ``layers`` (None: every layer), computed once."""
        layers = range(self.writer.num_layers) if layers is None else layers
        plan = self._groups.get(layers)
        if plan is None:
            target, writer = layers_of(self.target, layers), layers_of(self.writer, layers)
            plan = _plan(target, writer, self)
            self._groups[layers] = plan
        return plan

    def shadow_bytes(self, target_blocks: int) -> int:
        """Bytes of the shadow a push into ``target_blocks`` decode blocks converts in:
        none, byte copies place the heads."""
        return 0

    def build(self, writer_ids: npt.ArrayLike, target_ids: npt.ArrayLike,
              layers: range | None = None, writer_offset: int = 0,
              shadow: torch.Tensor | None = None) -> RankDescriptors:
        """One request's WRITE rows for ``layers``: ``local`` this rank's (sources, from
        blocks ``writer_ids``, from token ``writer_offset`` of the first), ``remote`` the
        decode rank's (targets, blocks ``target_ids``, paired in order), ``remote_rank``
        the decode rank. Ids count logical blocks of each side; ValueError names a bad
        one. A decode whose prefix cache holds a prompt's first tokens reserves blocks
        for the rest only: they start inside a larger prefill block (``writer_offset``).
        ``shadow``: unused (see :class:`ConvertedPush`)."""
        plan = self.group(layers)
        read = plan.build(plan.pair(target_ids, writer_ids, remote_offset=writer_offset))
        return RankDescriptors(self.target_rank, read.remote, read.local)


def _plan(target: SideGeometry, writer: SideGeometry, push: PushPlan) -> PeerReadPlan:
    local_tp, remote_tp = push.tp
    try:
        plans = plan_peer_reads(target, {push.writer_rank: writer}, push.slices,
                                local_tp=local_tp, remote_tp=remote_tp)
    except ConversionNeeded as exc:
        raise PushRefused(f"prefill rank {push.writer_rank} cannot WRITE into decode rank "
                          f"{push.target_rank} with byte copies ({exc}); pull mode converts "
                          f"this pair: run the sidecars with --kv-transfer-mode pull") from exc
    return plans[0]


def push_targets(writer_rank: int, *, writer_tp: int, target_tp: int, total_kv_heads: int
                 ) -> dict[int, tuple[tuple[HeadSlice, ...], int]]:
    """The decode ranks prefill rank ``writer_rank`` writes into (those that read heads
    from it), each with its slices read from this rank and how many prefill ranks write
    into it (the "done" count it waits for): topology alone, no geometry."""
    out = {}
    for rank in range(target_tp):
        slices = read_plan(rank, target_tp, writer_tp, total_kv_heads)
        mine = tuple(s for s in slices if s.remote_rank == writer_rank)
        if mine:
            out[rank] = (mine, len({s.remote_rank for s in slices}))
    return out


def plan_pushes(writer_rank: int, writer: SideGeometry, targets: dict[int, SideGeometry], *,
                writer_tp: int, target_tp: int, total_kv_heads: int,
                converted: Callable[[PushPlan], ConvertedPush] | None = None
                ) -> list[PushPlan | ConvertedPush]:
    """The decode ranks prefill rank ``writer_rank`` (geometry ``writer``, TP
    ``writer_tp``) writes into, one plan each, from every decode rank's geometry
    (``targets``, by rank, TP ``target_tp``). A rank that holds no head any decode rank
    reads from it writes nothing (an empty list). Checks every pair now: where byte
    copies cannot place the heads, ``converted`` makes the pair's
    :class:`ConvertedPush` (:meth:`ConvertedPush.of` with this rank's cache), or
    :class:`PushRefused` without it;
    :class:`~kvxfer.plan.descriptors.IncompatibleLayoutError` where nothing can."""
    out: list[PushPlan | ConvertedPush] = []
    for rank, (mine, writers) in push_targets(writer_rank, writer_tp=writer_tp,
                                              target_tp=target_tp,
                                              total_kv_heads=total_kv_heads).items():
        if rank not in targets:
            raise ValueError(f"no geometry for decode rank {rank}")
        push = PushPlan(writer_rank, rank, writers, writer, targets[rank],
                        (target_tp, writer_tp), mine)
        try:
            push.group()  # check the pair now, not on a request
            out.append(push)
        except PushRefused:
            if converted is None:
                raise
            out.append(converted(push))
    return out


@dataclass
class ConvertedPush:
    """What this prefill rank WRITEs into one decode rank where byte copies cannot place
    the heads (different layouts or packings, a split of heads kept together): ``staged``
    places this rank's heads, from
    ``source`` (its own cache as ``[kernel blocks, layers, chunks, chunk elements]``),
    into a shadow (``staged.local``: the decode rank's geometry, compact, block after
    block, at address 0), and ``direct`` WRITEs the shadow's blocks into the decode
    rank's, byte for byte."""

    direct: PushPlan
    staged: StagedRead
    source: torch.Tensor
    copy: NumpyCopy | None = None  # copies a piece, as numpy arrays (default: numpy's)

    @classmethod
    def of(cls, push: PushPlan, cache: torch.Tensor, copy: NumpyCopy | None = None
           ) -> ConvertedPush:
        """``push``'s pair converted, ``cache`` any view of this rank's cache (one
        allocation at fixed strides); :class:`PushRefused` names why not and the fix.
        ``copy(target, source)`` copies each piece as numpy arrays (default: numpy's
        copy); where every piece moves K and V together
        (:meth:`~kvxfer.plan.staging.StagedRead.kv_together`) the pieces are cut from
        numpy arrays, whose slicing costs a fraction of torch's."""
        shadow = shadow_geometry(push.target)
        staged = plan_staged_read(shadow, push.writer, push.writer_rank, push.slices)
        same = tuple(HeadSlice(s.remote_rank, s.local_head_offset, s.local_head_offset,
                               s.count) for s in push.slices)  # the shadow's are the decode's
        direct = PushPlan(push.writer_rank, push.target_rank, push.writers, shadow, push.target,
                          push.tp, same)
        if not push.target.heads_contiguous and push.writers > 1:
            # the decode rank keeps a block's heads together and gathers them from several
            # prefill ranks: this rank's are a run per token there, each (token, head) a chunk
            direct = PushPlan(push.writer_rank, push.target_rank, push.writers,
                              token_heads(shadow), token_heads(push.target), push.tp,
                              per_token(same, push.target))
        direct.group()
        return cls(direct, staged, own_chunks(push.writer, cache), copy)

    @property
    def writer_rank(self) -> int:
        return self.direct.writer_rank

    @property
    def target_rank(self) -> int:
        return self.direct.target_rank

    @property
    def writers(self) -> int:
        return self.direct.writers

    def shadow_bytes(self, target_blocks: int) -> int:
        geo = self.staged.local
        return target_blocks * geo.kernel_ratio * int(geo.block_stride[0, 0])

    def build(self, writer_ids: npt.ArrayLike, target_ids: npt.ArrayLike,
              layers: range | None = None, writer_offset: int = 0,
              shadow: torch.Tensor | None = None) -> RankDescriptors:
        """As :meth:`PushPlan.build`, once this rank's heads of ``layers`` are converted
        into ``shadow`` (a host byte buffer of at least :meth:`shadow_bytes`, registered,
        kept until the WRITEs ended): the rows' sources lie in it."""
        targets = np.asarray(target_ids, dtype=np.int64)
        need = self.shadow_bytes(len(targets))
        if shadow is None or shadow.numel() < need or shadow.dtype != torch.uint8:
            raise ValueError(f"a converted push into {len(targets)} blocks needs a shadow of "
                             f"{need} bytes")
        geo, writer = self.staged.local, self.staged.remote
        layers = range(writer.num_layers) if layers is None else layers
        skip_rows, skip = divmod(writer_offset, writer.kernel_block_size)
        rows = kernel_rows(np.asarray(writer_ids, dtype=np.int64),
                           writer.kernel_ratio)[skip_rows:]
        if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < self.source.shape[0]:
            raise ValueError(f"a prefill block id is outside this rank's {writer.num_blocks}")
        views = shadow_views(shadow, geo, len(targets), self.source.dtype)
        slots = np.arange(len(targets), dtype=np.int64)
        source: Any = self.source
        group: Any = views[:, layers.start:layers.stop]
        copy: Any = self.copy or np.copyto
        if self.staged.kv_together(writer.kv_packing, geo.kv_packing) and not skip:
            source, group = as_numpy(source), as_numpy(group)
        else:  # tensors: K and V apart (kv_views), each piece copied as numpy arrays
            copy = functools.partial(_numpy_copy, copy)
        # whole shadow blocks are written: past the prefill's last block, zeros rather than
        # what the buffer held before (another request's heads); the kernel block with the
        # last token is zeroed whole first (a packing may keep a block's K apart from its V)
        paired = min(len(targets) * geo.block_size,
                     len(rows) * writer.kernel_block_size - skip)
        views[max(paired, 0) // geo.kernel_block_size:, layers.start:layers.stop] = 0
        self.staged.place(source, range(self.source.shape[2]), rows, [(layers.start, group)],
                          slots, writer.kv_packing, geo.kv_packing, copy, skip)
        rows_out = self.direct.build(slots, targets, layers)
        local = rows_out.local.copy()
        local[:, 0] += np.uint64(shadow.data_ptr())
        return RankDescriptors(rows_out.remote_rank, local, rows_out.remote)


def _numpy_copy(copy: NumpyCopy, target: torch.Tensor, source: torch.Tensor) -> None:
    """``copy`` of two tensors as numpy arrays (on this thread: not torch's intra-op
    threads, which a forward pass uses)."""
    copy(as_numpy(target), as_numpy(source))


def shadow_geometry(target: SideGeometry) -> SideGeometry:
    """``target``'s chunks (per layer: its view heads where heads are contiguous, else the
    page), compact and block after block from address 0: kernel block ``k``'s layer ``l``
    chunk ``c`` at ``((k * layers + l) * chunks + c) * chunk_len``."""
    layers, chunks = target.base.shape
    base = (np.arange(layers, dtype=np.int64)[:, None] * chunks
            + np.arange(chunks, dtype=np.int64)[None]) * target.chunk_len
    stride = np.full((layers, chunks), layers * chunks * target.chunk_len, dtype=np.int64)
    return replace(target, base=base, block_stride=stride, mem=np.zeros_like(base),
                   devices=np.zeros(1, dtype=U64))


def token_heads(geometry: SideGeometry) -> SideGeometry:
    """A geometry whose pages keep tokens outside heads (``[N, H, C]``), seen as one chunk
    per (token, view head) of a kernel block: chunk ``t * H + h``, ``C`` bytes, and as
    many "heads", packed together; what byte copies of some heads of each token need.
    A chunk holds one "token" (the kernel blocks hold one each): only a pair of two such
    geometries of equal block sizes pairs right (whole blocks)."""
    tokens, heads = geometry.kernel_block_size, geometry.num_view_heads
    count = tokens * heads
    size = geometry.chunk_len // count
    step = np.arange(count, dtype=np.int64)[None] * size
    return replace(geometry, block_size=geometry.kernel_ratio, num_kv_heads=count,
                   separate_kv_head_groups=False,
                   heads_contiguous=True, chunk_len=size, base=geometry.base[:, :1] + step,
                   block_stride=np.repeat(geometry.block_stride[:, :1], count, axis=1),
                   mem=np.repeat(geometry.mem[:, :1], count, axis=1))


def per_token(slices: tuple[HeadSlice, ...], geometry: SideGeometry) -> tuple[HeadSlice, ...]:
    """``slices`` of KV heads (their K and V groups where those are apart) as slices of
    :func:`token_heads` chunks, one per token of a kernel block."""
    heads, kv = geometry.num_view_heads, geometry.num_kv_heads
    groups = (0, kv) if geometry.separate_kv_head_groups else (0,)
    return tuple(HeadSlice(s.remote_rank, t * heads + g + s.remote_head_offset,
                           t * heads + g + s.local_head_offset, s.count)
                 for t in range(geometry.kernel_block_size) for g in groups for s in slices)


def shadow_views(shadow: torch.Tensor, geometry: SideGeometry, blocks: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` logical blocks of a :func:`shadow_geometry` in byte buffer ``shadow``, as
    ``[kernel blocks, layers, H, N, C]`` (view heads, kernel block tokens, content)."""
    size = torch.empty((), dtype=dtype).element_size()
    layers, chunks = geometry.base.shape
    heads, tokens = geometry.num_view_heads, geometry.kernel_block_size
    content = geometry.chunk_len // size // (tokens * (1 if geometry.heads_contiguous
                                                       else heads))
    kernels = blocks * geometry.kernel_ratio
    typed = shadow[:kernels * layers * chunks * geometry.chunk_len].view(dtype)
    page = heads * tokens * content
    inner = (tokens * content, content) if geometry.heads_contiguous else \
        (content, heads * content)  # (head, token) strides
    return typed.as_strided((kernels, layers, heads, tokens, content),
                            (layers * page, page, *inner, 1))


def own_chunks(geometry: SideGeometry, cache: torch.Tensor) -> torch.Tensor:
    """This rank's cache (``geometry``; ``cache``: a view of it) as ``[kernel blocks,
    layers, chunks, chunk elements]`` (:func:`~kvxfer.plan.staging.chunk_view`);
    :class:`PushRefused` unless every chunk lies at fixed strides in ``cache``'s
    allocation."""
    chunks = chunk_view(cache, geometry, cache.untyped_storage().data_ptr())
    if chunks is None:
        raise PushRefused("converting a push needs this prefill's cache in one allocation "
                          "at fixed strides (kvxfer's engine allocates it so); run the "
                          "sidecars with --kv-transfer-mode pull")
    return chunks
