"""Tensor-parallel head mapping between a decode instance and a prefill instance.

KV heads are sharded contiguously: with ``total_kv_heads >= tp`` rank ``r``
holds heads ``[r * h, (r + 1) * h)`` with ``h = total_kv_heads // tp``; with
fewer heads than ranks, heads are replicated and rank ``r`` holds the single
head ``r * total_kv_heads // tp``. Head offsets below are in KV-head units.

A latent (MLA) cache is the case ``total_kv_heads == 1``: its one latent "head" is
on every rank, decode rank ``r`` reads it whole from prefill rank ``r % remote_tp``,
and the prefill ranks nobody reads from are only told to free (:func:`notify_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSlice:
    """``count`` heads read from ``remote_rank``: remote heads
    ``[remote_head_offset, +count)`` land on local heads ``[local_head_offset, +count)``."""

    remote_rank: int
    remote_head_offset: int
    local_head_offset: int
    count: int


def _check_tp(role: str, tp: int, total_kv_heads: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"{role} TP size must be a positive integer, got {tp!r}")
    if total_kv_heads >= tp and total_kv_heads % tp:
        raise ValueError(f"{total_kv_heads} KV heads cannot be split evenly over {role} TP {tp}")
    if total_kv_heads < tp and tp % total_kv_heads:
        raise ValueError(f"{role} TP {tp} is not a multiple of the {total_kv_heads} KV heads, "
                         f"so heads cannot be replicated evenly")


def heads_per_rank(tp: int, total_kv_heads: int) -> int:
    """KV heads each rank holds (1 when heads are replicated)."""
    _check_tp("local", tp, total_kv_heads)
    return max(total_kv_heads // tp, 1)


def rank_heads(rank: int, tp: int, total_kv_heads: int) -> range:
    """Global KV head ids held by ``rank``."""
    per = heads_per_rank(tp, total_kv_heads)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside TP size {tp}")
    first = rank * per if total_kv_heads >= tp else rank * total_kv_heads // tp
    return range(first, first + per)


def _owners(head: int, tp: int, total_kv_heads: int) -> list[int]:
    """Ranks that hold global ``head`` (several when heads are replicated)."""
    if total_kv_heads >= tp:
        return [head // (total_kv_heads // tp)]
    copies = tp // total_kv_heads
    return list(range(head * copies, (head + 1) * copies))


def read_plan(local_rank: int, local_tp: int, remote_tp: int,
              total_kv_heads: int) -> list[HeadSlice]:
    """Head slices decode rank ``local_rank`` must read, one per contiguous run.

    Each needed head is read once; among replicas the copy is picked by the
    local rank so that replicated prefill ranks share the read load.
    """
    if isinstance(total_kv_heads, bool) or not isinstance(total_kv_heads, int) \
            or total_kv_heads <= 0:
        raise ValueError(f"total KV heads must be a positive integer, got {total_kv_heads!r}")
    _check_tp("decode", local_tp, total_kv_heads)
    _check_tp("prefill", remote_tp, total_kv_heads)
    mine = rank_heads(local_rank, local_tp, total_kv_heads)
    slices: list[HeadSlice] = []
    for local_offset, head in enumerate(mine):
        owners = _owners(head, remote_tp, total_kv_heads)
        owner = owners[local_rank % len(owners)]
        remote_offset = head - rank_heads(owner, remote_tp, total_kv_heads).start
        last = slices[-1] if slices else None
        if last and last.remote_rank == owner and \
                last.remote_head_offset + last.count == remote_offset and \
                last.local_head_offset + last.count == local_offset:
            slices[-1] = HeadSlice(owner, last.remote_head_offset, last.local_head_offset,
                                   last.count + 1)
        else:
            slices.append(HeadSlice(owner, remote_offset, local_offset, 1))
    return slices


def readers_per_remote_rank(local_tp: int, remote_tp: int, total_kv_heads: int) -> dict[int, int]:
    """How many decode ranks read from each prefill rank (prefill waits for that many "done")."""
    counts: dict[int, int] = {}
    for rank in range(local_tp):
        for remote in {s.remote_rank for s in read_plan(rank, local_tp, remote_tp, total_kv_heads)}:
            counts[remote] = counts.get(remote, 0) + 1
    return counts


def notify_plan(local_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int
                ) -> dict[int, int]:
    """Remote ranks this decode rank must tell "done", each with its expected count.

    Every prefill rank holds the request's blocks, including ranks nobody reads
    from (replicated heads read from one copy only). Those are released by one
    designated decode rank (``remote_rank % local_tp``) that notifies without
    reading, so no lease has to run into its expiry. The count is how many
    decode ranks will notify that prefill rank in total.
    """
    readers = readers_per_remote_rank(local_tp, remote_tp, total_kv_heads)
    mine = {s.remote_rank for s in read_plan(local_rank, local_tp, remote_tp, total_kv_heads)}
    plan = {}
    for remote in range(remote_tp):
        if remote in readers:
            if remote in mine:
                plan[remote] = readers[remote]
        elif remote % local_tp == local_rank:
            plan[remote] = 1
    return plan
