"""``ProcessShares``: what the decode ranks of one process share when they read.

One per instance's in-process ranks, handed to each (``TransferWorker(..., shares=...)``; a
worker given none shares nothing): host reads copied once, staged reads of pages that hold
every head READ once, a prefill's cache mapped once. Thread-safe.

Design: docs/design/converted-reads.md#what-one-process-shares
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvxfer.transfer.converted.host_reads import SharedCopies
from kvxfer.transfer.converted.mapped_reads import Mappings
from kvxfer.transfer.converted.shared_staging import SharedStaging


@dataclass
class ProcessShares:
    """The shared host copies, shared staging and mappings of one process's decode ranks."""

    copies: SharedCopies = field(default_factory=SharedCopies)
    staging: SharedStaging = field(default_factory=SharedStaging)
    mappings: Mappings = field(default_factory=Mappings)

    def join(self, engine: str, prefill: str, rank: int, host_read: Iterable[int],
             staged: Iterable[int]) -> None:
        """Decode rank ``rank`` of ``engine`` shares its host reads of prefill ranks
        ``host_read`` and its staged reads of prefill ranks ``staged`` of ``prefill``."""
        for prefill_rank in host_read:
            self.copies.register(engine, prefill, prefill_rank, rank)
        for prefill_rank in staged:
            self.staging.register(engine, prefill, prefill_rank, rank)

    def leave(self, engine: str, prefill: str, rank: int) -> None:
        """Decode rank ``rank`` of ``engine`` shares nothing more with ``prefill``."""
        self.copies.unregister(engine, prefill, rank)
        self.staging.unregister(engine, prefill, rank)
