"""In-process TP ranks of one decode share a staged read of one prefill rank.

Each member READs its share of the pages once and places every member's heads from it.
Invariant: a member's read ends only when every share ended, and a failed share fails every
member; a member that gives up closes its target before it reports the failure.

Design: docs/design/converted-reads.md#shared-staging
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.plan.staging import StagedRead
from kvxfer.transfer.converted.siblings import Meeting, Siblings


@dataclass(frozen=True)
class Target:
    """One member: its read plan, the view groups its heads go to, and the event that
    wakes its worker thread."""

    rank: int
    plan: StagedRead
    groups: Sequence[tuple[int, torch.Tensor]]
    wake: threading.Event


class StagedMeeting:
    """A closed meeting's shared read: the members' targets, each member's share of the
    request (local and remote id slices), which shares ended and how."""

    def __init__(self, targets: dict[int, Target],
                 shares: dict[int, tuple[slice, slice]]) -> None:
        self.targets, self.shares = targets, shares
        self._cond = threading.Condition()
        self._ended: dict[int, str | None] = {}  # by member: None, or why its share failed
        self._closed: set[int] = set()  # members whose views take no more placements
        self._running: Counter[int] = Counter()  # placements running, by target member

    @property
    def settled(self) -> bool:
        """Every share ended."""
        with self._cond:
            return len(self._ended) == len(self.shares)

    @property
    def error(self) -> str | None:
        """Why a share failed (the first), if one did."""
        with self._cond:
            return next((why for why in self._ended.values() if why is not None), None)

    def end_share(self, rank: int, error: str | None = None) -> None:
        """Member ``rank``'s share ended: placed into every member, or failed (``error``);
        the first call counts. Wakes every member."""
        with self._cond:
            if rank in self._ended:
                return
            self._ended[rank] = error
        for target in self.targets.values():
            target.wake.set()

    @contextmanager
    def writing(self, rank: int) -> Iterator[bool]:
        """Guard one placement into member ``rank``'s views: True to go ahead, False when
        that member closed its target."""
        with self._cond:
            if rank in self._closed:
                allowed = False
            else:
                self._running[rank] += 1
                allowed = True
        try:
            yield allowed
        finally:
            if allowed:
                with self._cond:
                    self._running[rank] -= 1
                    self._cond.notify_all()

    def close(self, rank: int) -> None:
        """Member ``rank`` gives up: no placement into its views starts from now on;
        returns once none is running."""
        with self._cond:
            self._closed.add(rank)
            self._cond.wait_for(lambda: self._running[rank] == 0)


class SharedStaging:
    """Where the staged reads of a process's decode ranks meet (one per group of ranks
    that share their reads: :class:`~kvxfer.transfer.converted.process_shares.ProcessShares`)."""

    def __init__(self) -> None:
        self.siblings: Siblings[Target] = Siblings()

    def register(self, engine: str, prefill: str, prefill_rank: int, rank: int) -> None:
        """Decode rank ``rank`` of ``engine`` reads ``prefill_rank`` of ``prefill``'s pages
        through staging and shares them with its siblings."""
        self.siblings.register(engine, prefill, prefill_rank, rank)

    def unregister(self, engine: str, prefill: str, rank: int) -> None:
        self.siblings.unregister(engine, prefill, rank)

    def join(self, engine: str, prefill: str, request: str, target: Target,
             local_ids: np.ndarray, remote_ids: np.ndarray) -> StagedMeeting | None:
        """The shared read ``target``'s member takes part in, or None: it reads alone
        (no sibling, or it came late, or with other ids)."""
        plan = target.plan
        meeting = self.siblings.join((engine, prefill, request, plan.remote_rank), target.rank,
                                     local_ids, remote_ids, target,
                                     lambda m: _close(m, len(local_ids), len(remote_ids)))
        if meeting is None or len(meeting.joined) == 1:
            return None
        state: StagedMeeting = meeting.state
        return state


def _close(meeting: Meeting[Target], local_count: int, remote_count: int) -> None:
    ranks = sorted(meeting.joined)
    shares = meeting.joined[ranks[0]].plan.shares(local_count, remote_count, len(ranks))
    meeting.state = StagedMeeting(dict(meeting.joined), dict(zip(ranks, shares, strict=True)))
