"""Blocks whose KV is final, found again by the tokens they hold: the prefix cache.

A full block is named by a chain hash of its tokens from the start. Invariants:
``num_free + num_used == num_blocks``; idle cached blocks count as free (evicted least
recently used, never while held); a cached block is never handed out by ``allocate`` while
cached; nobody writes into a held cached block. Once asked for them (:meth:`take_events`),
it records its changes as KV events (:mod:`kvxfer.net.kv_events`): blocks stored, evicted.

Design: docs/design/engine.md#the-prefix-cache
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from kvxfer.engine.block_allocator import BlockAllocator, NoFreeBlocks
from kvxfer.net.kv_events import BlockRemoved, BlockStored

ROOT_HASH = b"kvxfer-prefix-cache-v1"


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                  count: int) -> list[bytes]:
    """Extend ``hashes`` (the chain hashes of the first blocks of ``token_ids``) in place
    to ``count`` full blocks (fewer if ``token_ids`` has fewer); returns it."""
    count = min(count, len(token_ids) // block_size)
    for index in range(len(hashes), count):
        parent = hashes[index - 1] if index else ROOT_HASH
        tokens = np.asarray(token_ids[index * block_size:(index + 1) * block_size],
                            dtype=np.int64)
        hashes.append(hashlib.sha256(parent + tokens.tobytes()).digest())
    return hashes


class PrefixCache(BlockAllocator):
    """A block allocator that keeps final blocks for reuse, found by their chain hash;
    idle cached blocks count as free and are evicted least recently used."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks)
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._holders: dict[int, int] = {}  # held cached block -> requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.queries = 0  # tokens looked up (see :meth:`record`)
        self.hits = 0     # of those, tokens found cached
        self._events: list[BlockStored | BlockRemoved] | None = None  # None: nobody takes them

    @property
    def num_free(self) -> int:
        return super().num_free + len(self._idle)

    @property
    def num_used(self) -> int:
        return super().num_used - len(self._idle)

    @property
    def num_cached(self) -> int:
        """Blocks cached now, held or idle."""
        return len(self._hash_of)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def holders(self, block: int) -> int:
        """Requests holding cached ``block`` (0 when idle or not cached)."""
        return self._holders.get(block, 0)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for new content, evicting idle cached blocks (least recently
        used first) only when the free list runs short; all or nothing."""
        if isinstance(n, int) and not isinstance(n, bool) and n > self.num_free:
            raise NoFreeBlocks(n, self.num_free)
        evicted = []
        for _ in range(max(0, n - super().num_free)):
            block, _ = self._idle.popitem(last=False)
            evicted.append(self._hash_of.pop(block))
            del self._block_of[evicted[-1]]
            super().free([block])
        if evicted and self._events is not None:
            self._events.append(BlockRemoved(block_hashes=list(evicted)))
        return super().allocate(n)

    def free(self, ids: Iterable[int]) -> None:
        """A request lets go of its blocks: a cached block loses one holder (idle, most
        recently used, at none); any other block is freed. Checks every id first."""
        ids = list(ids)
        for block in ids:
            if block in self._idle:
                raise ValueError(f"block {block} is cached but held by no request "
                                 f"(double free?)")
        cached = [b for b in ids if b in self._hash_of]
        if len(set(cached)) != len(cached):
            raise ValueError(f"cached blocks {sorted(cached)} repeat (double free?)")
        super().free([b for b in ids if b not in self._hash_of])
        for block in cached:
            self._holders[block] -= 1
            if not self._holders[block]:
                del self._holders[block]
                self._idle[block] = None

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are cached (nothing changes)."""
        for count, block_hash in enumerate(hashes):
            if block_hash not in self._block_of:
                return count
        return len(hashes)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes``, each now held once more
        by the caller (who frees them like its other blocks)."""
        found = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._idle.pop(block, None)
            self._holders[block] = self._holders.get(block, 0) + 1
        return found

    def insert(self, hashes: Sequence[bytes], block_ids: Sequence[int],
               token_ids: Sequence[int], parent: bytes | None = None) -> None:
        """Cache ``block_ids[i]`` under ``hashes[i]``: blocks the caller holds (allocated
        or matched) whose KV is final, holding ``token_ids`` (``block_size`` per hash),
        after the block named ``parent`` (None: the first blocks of a sequence). A hash
        cached already in another block leaves this block private, freed as usual."""
        if len(token_ids) != len(hashes) * self.block_size:
            raise ValueError(f"{len(hashes)} blocks of {self.block_size} tokens hold "
                             f"{len(hashes) * self.block_size} tokens, not {len(token_ids)}")
        stored: list[int] = []  # indices into hashes of one run of newly cached blocks
        try:
            for index, (block_hash, block) in enumerate(zip(hashes, block_ids, strict=False)):
                if block in self._hash_of or block_hash in self._block_of:
                    self._record_stored(hashes, token_ids, parent, stored)
                    continue
                if block not in self._used:
                    raise ValueError(f"block {block} is not allocated: only a held block "
                                     f"with final content can be cached")
                self._block_of[block_hash], self._hash_of[block] = block, block_hash
                self._holders[block] = 1
                stored.append(index)
        finally:  # what was cached before an error is recorded too
            self._record_stored(hashes, token_ids, parent, stored)

    def _record_stored(self, hashes: Sequence[bytes], token_ids: Sequence[int],
                       parent: bytes | None, stored: list[int]) -> None:
        """Record the run ``stored`` (consecutive indices into ``hashes``) as one
        :class:`BlockStored`, and empty it."""
        if stored and self._events is not None:
            first, end, size = stored[0], stored[-1] + 1, self.block_size
            self._events.append(BlockStored(
                block_hashes=list(hashes[first:end]),
                parent_block_hash=hashes[first - 1] if first else parent,
                token_ids=list(token_ids[first * size:end * size]), block_size=size))
        stored.clear()

    def record(self, queried: int, hit: int) -> None:
        """Count one admitted lookup: ``queried`` tokens could have come from the cache,
        ``hit`` did (Prometheus counters read these totals)."""
        self.queries += queried
        self.hits += hit

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The changes recorded since the last call, oldest first. The first call starts
        the recording (and returns ``[]``): a cache nobody takes events from keeps none."""
        taken, self._events = self._events or [], []
        return taken
