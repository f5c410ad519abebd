"""Push plans: which bytes one prefill rank WRITEs into which decode rank's blocks.

Pure: numpy and the descriptor math, no I/O. A push moves exactly the bytes the decode's
direct reads would move, the other way. So it is planned as those reads are: for each
decode rank, the head slices it would read (:func:`~kvxfer.plan.topology.read_plan`) from
this prefill rank are planned as that decode rank's read
(:func:`~kvxfer.plan.descriptors.plan_peer_reads`, the decode as the local side), built
for a request's blocks, then swapped: this rank's rows are a WRITE's sources, the decode
rank's its targets. Nothing here knows which side posts.

A layer group (``range`` of layer indices) restricts both geometries to those layers, so
that a push can WRITE each group while the engine computes the next; groups that
partition the layers move every byte of the whole plan, once.

Only byte-placeable pairs are planned: where a read would need a conversion (layouts
that order heads and tokens differently, a head split of a layout that keeps a block's
heads together, two K/V packings) :class:`PushRefused` names the pair and the fix (pull
converts those).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy.typing as npt

from kvxfer.plan.descriptors import (
    ConversionNeeded,
    IncompatibleLayoutError,
    PeerReadPlan,
    RankDescriptors,
    SideGeometry,
    plan_peer_reads,
)
from kvxfer.plan.topology import HeadSlice, read_plan


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

    def build(self, writer_ids: npt.ArrayLike, target_ids: npt.ArrayLike,
              layers: range | None = None, writer_offset: int = 0) -> RankDescriptors:
        """One request's WRITE rows for ``layers``: ``local`` this rank's (sources, from
        blocks ``writer_ids``, from token ``writer_offset`` of the first), ``remote`` the
        decode rank's (targets, blocks ``target_ids``, paired in order), ``remote_rank``
        the decode rank. Ids count logical blocks of each side; ValueError names a bad
        one. A decode whose prefix cache holds a prompt's first tokens reserves blocks
        for the rest only: they start inside a larger prefill block (``writer_offset``)."""
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
                writer_tp: int, target_tp: int, total_kv_heads: int) -> list[PushPlan]:
    """The decode ranks prefill rank ``writer_rank`` (geometry ``writer``, TP
    ``writer_tp``) writes into, one :class:`PushPlan` each, from every decode rank's
    geometry (``targets``, by rank, TP ``target_tp``). A rank that holds no head any
    decode rank reads from it writes nothing (an empty list). Checks every pair now:
    :class:`PushRefused` where byte copies cannot place the heads,
    :class:`~kvxfer.plan.descriptors.IncompatibleLayoutError` where nothing can."""
    out = []
    for rank, (mine, writers) in push_targets(writer_rank, writer_tp=writer_tp,
                                              target_tp=target_tp,
                                              total_kv_heads=total_kv_heads).items():
        if rank not in targets:
            raise ValueError(f"no geometry for decode rank {rank}")
        push = PushPlan(writer_rank, rank, writers, writer, targets[rank],
                        (target_tp, writer_tp), mine)
        push.group()  # check the pair now, not on a request
        out.append(push)
    return out
