"""Block ids of one paged KV cache: who may write which block.

Every block is either free or allocated, never both; ``num_free + num_used ==
num_blocks`` always. Mistakes (double free, unknown id) raise instead of
silently corrupting another request's KV.
"""

from __future__ import annotations

from collections.abc import Iterable


class NoFreeBlocks(RuntimeError):
    """Fewer free blocks than requested."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} KV cache blocks but only {free} are free")
        self.requested = requested
        self.free = free


class BlockAllocator:
    """Hands out block ids ``[0, num_blocks)``; lowest free ids first."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """``n`` distinct free block ids, now allocated; all or nothing."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"block count must be a non-negative integer, got {n!r}")
        if n > len(self._free):
            raise NoFreeBlocks(n, len(self._free))
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return allocated blocks; checks every id before freeing any."""
        ids = list(ids)
        seen: set[int] = set()
        for block in ids:
            if isinstance(block, bool) or not isinstance(block, int) \
                    or not 0 <= block < self.num_blocks:
                raise ValueError(f"block id {block!r} is not in [0, {self.num_blocks})")
            if block not in self._used or block in seen:
                raise ValueError(f"block {block} is not allocated (double free?)")
            seen.add(block)
        self._used.difference_update(ids)
        # Freed blocks are reused last, so a stale block table shows up as wrong
        # numbers in tests instead of being masked by immediate reuse.
        self._free[:0] = reversed(ids)
