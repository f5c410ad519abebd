"""``ProcessShares``: what the decode ranks of one process share when they read.

The TP ranks of one decode instance that live in one process (kvxfer's sidecar runs them
as threads) read the same requests from the same prefill ranks. Where their reads
overlap they meet (:mod:`kvxfer.transfer.converted.siblings`): a host read is copied once
for all of them (:class:`~kvxfer.transfer.converted.host_reads.SharedCopies`), a staged read
of pages that hold every head is READ once and placed into every member's views
(:class:`~kvxfer.transfer.converted.shared_staging.SharedStaging`), and a prefill's cache
is mapped once (:class:`~kvxfer.transfer.converted.mapped_reads.Mappings`).

Whoever creates the workers of one instance's in-process ranks creates one
``ProcessShares`` and hands it to each (``TransferWorker(..., shares=...)``); a worker
given none gets its own and shares nothing. Each worker registers the prefill ranks it
shares reads of when it connects to a prefill (:meth:`join`) and unregisters when it
drops it (:meth:`leave`). Thread-safe.

The prefill's side, the shared-memory buffers its cache lies in
(:func:`~kvxfer.transfer.converted.mapped_reads.shared_zeros`), is not here: those are
facts of the process (its descriptors and addresses), recorded where the memory is
allocated, before any worker exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvxfer.transfer.converted.host_reads import SharedCopies
from kvxfer.transfer.converted.mapped_reads import Mappings
from kvxfer.transfer.converted.shared_staging import SharedStaging


@dataclass
class ProcessShares:
    """See the module docstring."""

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
