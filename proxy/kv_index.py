"""Which token-block prefixes each instance holds in its cache, as its KV events tell.

Pure: no I/O (:mod:`proxy.event_streams` feeds it). Blocks are keyed by the proxy's own chain
hash of their token ids (:func:`prefix_keys`), not by the engine's hashes, which depend on
an engine's hash seed and version; an engine's names for its blocks only map its later
events onto those keys. Everything here errs one way: an index may know fewer blocks than
its instance holds (an event missed, a chain whose start was never seen), which costs a
recomputed prefix, never a wrong answer (an instance computes whatever it lacks).

Design: docs/design/kv-events.md#the-index
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvxfer.net.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored

ROOT_KEY = b"kvxfer-router-root"
KEY_BYTES = 16


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block of ``tokens`` after the block keyed ``parent``."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=KEY_BYTES,
                           key=parent[:64]).digest()


def prefix_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of the full ``block_size``-token blocks of ``token_ids``, in order."""
    keys: list[bytes] = []
    parent = ROOT_KEY
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


class InstanceIndex:
    """One instance's cached blocks, by key, as of the last event applied.

    ``unknown_parents`` counts stored blocks that could not be keyed: their chain's earlier
    blocks were never seen here (stored before the index started, or in a missed event).
    """

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size  # None: the first stored block's (a stream not announced)
        self._key_of: dict[BlockHash, bytes] = {}  # engine's name -> key
        self._holders: dict[bytes, int] = {}       # key -> engine blocks holding it
        self.unknown_parents = 0

    def __len__(self) -> int:
        return len(self._holders)

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            for name in event.block_hashes:
                key = self._key_of.pop(name, None)
                if key is not None:
                    self._release(key)
        else:
            self.clear()

    def _stored(self, event: BlockStored) -> None:
        size = event.block_size
        if self.block_size is None and size > 0:
            self.block_size = size
        if event.parent_block_hash is None:
            parent: bytes | None = ROOT_KEY
        else:
            parent = self._key_of.get(event.parent_block_hash)
        if parent is None or size != self.block_size or \
                len(event.token_ids) < size * len(event.block_hashes):
            self.unknown_parents += len(event.block_hashes)
            return
        for i, name in enumerate(event.block_hashes):
            parent = block_key(parent, event.token_ids[i * size:(i + 1) * size])
            old = self._key_of.get(name)
            if old == parent:
                continue
            if old is not None:
                self._release(old)
            self._key_of[name] = parent
            self._holders[parent] = self._holders.get(parent, 0) + 1

    def _release(self, key: bytes) -> None:
        left = self._holders[key] - 1
        if left:
            self._holders[key] = left
        else:
            del self._holders[key]

    def clear(self) -> None:
        self._key_of.clear()
        self._holders.clear()

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prompt's :func:`prefix_keys` at this block size), from
        the first, this instance holds."""
        for count, key in enumerate(keys):
            if key not in self._holders:
                return count
        return len(keys)
