"""The ceiling of a read: its bytes moved in as few descriptors as registered memory allows.

Pure: numpy, no I/O. The bytes land wherever the spans start, over whatever blocks lie
there: only a benchmark may post it.

Design: docs/design/plan.md#the-span-probe-a-reads-ceiling
"""

from __future__ import annotations

import numpy as np

from kvxfer.plan.descriptors import U64, RankDescriptors, SideGeometry


def memory_spans(side: SideGeometry) -> list[tuple[int, int, int]]:
    """``(start, length, device id)`` of each memory entry ``side`` addresses, from the
    lowest chunk of block 0 to the end of the highest chunk of its last kernel block."""
    blocks = side.num_blocks * side.kernel_ratio
    ends = side.base + (blocks - 1) * side.block_stride + side.chunk_len
    spans = []
    for mem in np.unique(side.mem):
        inside = side.mem == mem
        start, end = int(side.base[inside].min()), int(ends[inside].max())
        spans.append((start, end - start, int(side.devices[mem])))
    return sorted(spans)


def span_descriptors(local: SideGeometry, remote: SideGeometry, num_bytes: int,
                        remote_rank: int = 0, *, local_start: int | None = None,
                        remote_start: int | None = None) -> RankDescriptors:
    """``num_bytes`` of ``remote``'s memory into ``local``'s, from ``remote_start`` and
    ``local_start`` (addresses inside the sides' spans, :func:`memory_spans`; None: the
    first span's start; moved back where too few bytes follow), one descriptor per
    overlap of the two sides' spans; ValueError when either side has fewer bytes
    registered, or a start outside its spans."""
    if num_bytes < 0:
        raise ValueError(f"a read moves zero or more bytes, not {num_bytes}")
    pieces = [_pieces(memory_spans(geometry), num_bytes, start, name)
              for geometry, start, name in ((local, local_start, "decode"),
                                            (remote, remote_start, "prefill"))]
    rows: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]] = ([], [])
    (mine, theirs), li, ri, l_off, r_off = pieces, 0, 0, 0, 0
    while li < len(mine) and ri < len(theirs):
        (l_addr, l_len, l_dev), (r_addr, r_len, r_dev) = mine[li], theirs[ri]
        n = min(l_len - l_off, r_len - r_off)
        rows[0].append((l_addr + l_off, n, l_dev))
        rows[1].append((r_addr + r_off, n, r_dev))
        l_off, r_off = l_off + n, r_off + n
        if l_off == l_len:
            li, l_off = li + 1, 0
        if r_off == r_len:
            ri, r_off = ri + 1, 0
    shape = (len(rows[0]), 3)
    return RankDescriptors(remote_rank, np.array(rows[0], dtype=U64).reshape(shape),
                           np.array(rows[1], dtype=U64).reshape(shape))


def _pieces(spans: list[tuple[int, int, int]], num_bytes: int, start: int | None,
            name: str) -> list[tuple[int, int, int]]:
    """``num_bytes`` of ``spans`` from address ``start`` on, as ``(address, length,
    device)`` pieces, one per span crossed."""
    total = sum(length for _, length, _ in spans)
    if total < num_bytes:
        raise ValueError(f"the {name} registered {total} bytes, fewer than the "
                         f"{num_bytes} to read")
    position, before = 0, 0  # ``start`` as an offset into the spans laid end to end
    for addr, length, _ in spans:
        if start is not None and addr <= start < addr + length:
            position = before + start - addr
            break
        before += length
    else:
        if start is not None:
            raise ValueError(f"the {name}'s start {start:#x} is outside its registered "
                             f"memory")
    position = min(position, total - num_bytes)
    out, left = [], num_bytes
    for addr, length, device in spans:
        if position >= length:
            position -= length
            continue
        n = min(length - position, left)
        if n:
            out.append((addr + position, n, device))
        left, position = left - n, 0
        if not left:
            break
    return out
