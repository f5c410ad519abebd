"""Which token of one side's blocks pairs with which of the other's (pure numpy, no I/O).

A request names blocks on both sides by logical id, in token order. Where both sides'
blocks are of one size, block ``i`` of one list pairs with block ``i`` of the other.
Otherwise (one block size a multiple of the other, kernel blocks of any size) both
sides are cut into *pairing units*, the greatest common divisor of the two kernel block
sizes, and the ``p``-th unit of one side's token sequence pairs with the ``p``-th of the
other's (:func:`pair_blocks`, :class:`BlockPairs`); the remote side's sequence may start
inside its first block (``remote_offset``: a decode whose prefix cache holds the tokens
before, in push mode). :mod:`kvxfer.plan.descriptors` turns the pairs into addresses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


def validate_block_ids(local_block_ids: Sequence[int] | npt.ArrayLike,
                       remote_block_ids: Sequence[int] | npt.ArrayLike,
                       local_num_blocks: int, remote_num_blocks: int
                       ) -> tuple[IntArray, IntArray]:
    """Both id lists as int64 arrays, pairs sorted by local id; ValueError names a bad id."""
    local, remote = _checked_ids(local_block_ids, remote_block_ids, local_num_blocks,
                                 remote_num_blocks, 1, 1)
    order = np.argsort(local, kind="stable")
    local, remote = local[order], remote[order]
    _no_repeats(local)
    return local, remote


def validate_paired_ids(local_block_ids: Sequence[int] | npt.ArrayLike,
                        remote_block_ids: Sequence[int] | npt.ArrayLike, local_num_blocks: int,
                        remote_num_blocks: int, local_block_size: int, remote_block_size: int,
                        remote_offset: int = 0) -> tuple[IntArray, IntArray]:
    """Both lists of logical ids as int64 arrays in request (token) order, for block sizes
    one a multiple of the other: the side with the larger blocks has ``ceil(n / ratio)`` ids
    for ``n`` on the other, counting the ``remote_offset`` tokens its first block holds
    before the pairing starts (only a remote side with the larger blocks has them: a
    multiple of the smaller size, short of its own); ValueError names a bad id or count."""
    small = min(local_block_size, remote_block_size)
    if remote_offset and (remote_offset < 0 or remote_offset % small
                          or remote_offset >= remote_block_size
                          or remote_block_size <= local_block_size):
        raise ValueError(f"remote_offset {remote_offset}: pairing starts inside a remote "
                         f"block only at a multiple of the local block size "
                         f"{local_block_size} short of the remote's {remote_block_size}")
    local, remote = _checked_ids(local_block_ids, remote_block_ids, local_num_blocks,
                                 remote_num_blocks, local_block_size // small,
                                 remote_block_size // small, remote_offset // small)
    _no_repeats(np.sort(local))
    return local, remote


def _checked_ids(local_block_ids: Sequence[int] | npt.ArrayLike,
                 remote_block_ids: Sequence[int] | npt.ArrayLike, local_num_blocks: int,
                 remote_num_blocks: int, local_ratio: int, remote_ratio: int,
                 remote_lead: int = 0) -> tuple[IntArray, IntArray]:
    """Both lists as int64 arrays, each id in range and the lengths consistent with the
    ratios (the larger-block side has ``ceil(n / ratio)`` ids for ``n`` on the other, after
    ``remote_lead`` units of the remote's first block that pair with nothing)."""
    local = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    if local_ratio == remote_ratio:
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local block ids but {len(remote)} remote block ids")
    else:
        coarse, fine, ratio = (local, remote, local_ratio) if local_ratio > 1 else \
            (remote, local, remote_ratio)
        need = -(-(len(fine) + remote_lead) // ratio)
        if len(coarse) != need:
            raise ValueError(
                f"{len(local)} local block ids but {len(remote)} remote block ids; with "
                f"blocks {ratio}x larger on the {'local' if local_ratio > 1 else 'remote'} "
                f"side, {len(fine)} blocks need {need} there"
                + (f" ({remote_lead} of the first one's {ratio} parts pair with nothing)"
                   if remote_lead else ""))
    for side, ids, limit in (("local", local, local_num_blocks),
                             ("remote", remote, remote_num_blocks)):
        bad = np.flatnonzero((ids < 0) | (ids >= limit))
        if len(bad):
            raise ValueError(f"{side} block id {int(ids[bad[0]])} at position {int(bad[0])} is "
                             f"outside 0..{limit - 1}")
    return local, remote


def _no_repeats(sorted_local: IntArray) -> None:
    repeats = np.flatnonzero(sorted_local[1:] == sorted_local[:-1])
    if len(repeats):
        raise ValueError(f"local block id {int(sorted_local[repeats[0]])} repeats: a block "
                         f"would be written twice")


@dataclass(frozen=True)
class BlockPairs:
    """One request's tokens in pairing units, sorted by local (kernel id, sub-block).

    Position ``p`` reads sub-block ``remote_sub[p]`` of remote kernel block
    ``remote_ids[p]`` into sub-block ``local_sub[p]`` of local kernel block
    ``local_ids[p]``; a side's sub-blocks are None where its kernel blocks are one
    pairing unit (the greatest common divisor of both kernel block sizes). Kernel ids equal
    block ids without kernel blocks.
    """

    local_ids: IntArray
    local_sub: IntArray | None
    remote_ids: IntArray
    remote_sub: IntArray | None


def pairing_unit(local_kernel_block_size: int, remote_kernel_block_size: int) -> int:
    """Tokens per pairing unit: the largest run both sides' kernel blocks are cut into."""
    return math.gcd(local_kernel_block_size, remote_kernel_block_size)


def kernel_units(block_ids: IntArray, kernel_ratio: int, subs: int, count: int,
                 first: int = 0) -> tuple[IntArray, IntArray]:
    """``count`` pairing units of logical ``block_ids`` in token order from unit ``first``,
    as (kernel block id, sub-block): block ``b`` is kernel blocks ``b * kernel_ratio + i``
    (``i < kernel_ratio``), each ``subs`` units."""
    per_block = kernel_ratio * subs
    position = np.arange(first, first + count, dtype=np.int64)
    within = position % per_block
    return block_ids[position // per_block] * kernel_ratio + within // subs, within % subs


def pair_blocks(local_block_ids: Sequence[int] | npt.ArrayLike,
                remote_block_ids: Sequence[int] | npt.ArrayLike, local_num_blocks: int,
                remote_num_blocks: int, local_block_size: int = 1, remote_block_size: int = 1,
                local_kernel_ratio: int = 1, remote_kernel_ratio: int = 1,
                remote_offset: int = 0) -> BlockPairs:
    """Validate both lists of logical ids and pair their tokens (see :class:`BlockPairs`).

    ``*_block_size`` are the logical block sizes (one a multiple of the other),
    ``*_kernel_ratio`` each side's kernel blocks per logical block; ids count logical
    blocks (``*_num_blocks``). The side with the larger blocks has ``ceil(n / ratio)``
    ids for ``n`` on the other; tokens pair in order up to the shorter side's end, the
    remote side's from token ``remote_offset`` of its first block (where the local side
    already holds the tokens before: a decode's prefix cache, in push mode).
    """
    if local_block_size == remote_block_size and local_kernel_ratio == remote_kernel_ratio == 1 \
            and not remote_offset:
        local, remote = validate_block_ids(local_block_ids, remote_block_ids,
                                           local_num_blocks, remote_num_blocks)
        return BlockPairs(local, None, remote, None)
    local, remote = validate_paired_ids(local_block_ids, remote_block_ids, local_num_blocks,
                                        remote_num_blocks, local_block_size, remote_block_size,
                                        remote_offset)
    local_kernel = local_block_size // local_kernel_ratio
    remote_kernel = remote_block_size // remote_kernel_ratio
    unit = pairing_unit(local_kernel, remote_kernel)
    count = min(len(local) * local_block_size,
                len(remote) * remote_block_size - remote_offset) // unit
    local_ids, local_sub = kernel_units(local, local_kernel_ratio, local_kernel // unit, count)
    remote_ids, remote_sub = kernel_units(remote, remote_kernel_ratio, remote_kernel // unit,
                                          count, remote_offset // unit)
    order = np.lexsort((local_sub, local_ids))
    return BlockPairs(local_ids[order], local_sub[order] if local_kernel > unit else None,
                      remote_ids[order], remote_sub[order] if remote_kernel > unit else None)
