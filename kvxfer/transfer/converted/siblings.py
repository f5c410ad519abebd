"""Where in-process TP ranks of one decode instance meet to share one read.

A rank joins the request's meeting and waits up to :data:`MEET_S` for its registered
siblings; the rank that closes the meeting runs ``on_close`` once, under the lock. Only ranks
with the same block ids meet; a late one reads alone. Thread-safe.

Design: docs/design/converted-reads.md#where-siblings-meet
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

MEET_S = 0.02  # how long a rank waits for its in-process siblings before reading alone

T = TypeVar("T")
Key = tuple[str, str, str, int]  # decode engine, prefill engine, request, prefill rank


@dataclass
class Meeting(Generic[T]):
    """Ranks of one instance reading one request from one prefill rank together:
    ``joined`` what each rank brought, ``state`` what ``on_close`` made of them."""

    ids: tuple[bytes, bytes]  # the request's (local, remote) block ids
    expected: int
    cond: threading.Condition
    joined: dict[int, T] = field(default_factory=dict)
    open: bool = True  # still waiting for members
    state: Any = None
    error: BaseException | None = None  # raised by on_close: every member raises it


class Siblings(Generic[T]):
    """The meetings of one kind of shared read: who registered for which prefill rank,
    and the meeting each request's ranks join (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._ranks: dict[tuple[str, str, int], set[int]] = {}
        self._meetings: dict[Key, Meeting[T]] = {}

    def register(self, engine: str, prefill: str, prefill_rank: int, rank: int) -> None:
        """Decode rank ``rank`` of ``engine`` shares its reads of ``prefill_rank`` of
        ``prefill``."""
        with self.lock:
            self._ranks.setdefault((engine, prefill, prefill_rank), set()).add(rank)

    def unregister(self, engine: str, prefill: str, rank: int) -> None:
        with self.lock:
            for key in [k for k in self._ranks if k[:2] == (engine, prefill)]:
                self._ranks[key].discard(rank)
                if not self._ranks[key]:
                    del self._ranks[key]

    def join(self, key: Key, rank: int, local_ids: np.ndarray, remote_ids: np.ndarray,
             item: T, on_close: Callable[[Meeting[T]], None]) -> Meeting[T] | None:
        """Join ``key``'s meeting with ``item``; the closed meeting (``on_close`` ran), or
        None to read alone (no sibling registered, the meeting closed already, or it
        holds other ids)."""
        engine, prefill, _, prefill_rank = key
        ids = (np.asarray(local_ids, dtype=np.int64).tobytes(),
               np.asarray(remote_ids, dtype=np.int64).tobytes())
        with self.lock:
            members = len(self._ranks.get((engine, prefill, prefill_rank), ()))
            meeting = self._meetings.get(key)
            if members < 2 or (meeting is not None and (not meeting.open or meeting.ids != ids)):
                return None
            if meeting is None:
                meeting = Meeting(ids, members, threading.Condition(self.lock))
                self._meetings[key] = meeting
            meeting.joined[rank] = item
            if len(meeting.joined) < meeting.expected:
                meeting.cond.wait_for(lambda: not meeting.open, MEET_S)
            if meeting.open:  # all came, or the others are late: go with whoever came
                self._close(key, meeting, on_close)
            if meeting.error is not None:
                raise meeting.error
            return meeting

    def _close(self, key: Key, meeting: Meeting[T],
               on_close: Callable[[Meeting[T]], None]) -> None:
        """Stop waiting (caller holds the lock); an error of ``on_close`` is every
        member's."""
        meeting.open = False
        del self._meetings[key]
        try:
            on_close(meeting)
        except Exception as exc:
            meeting.error = exc
        finally:
            meeting.cond.notify_all()

    @property
    def waiting(self) -> int:
        """Meetings still open (for tests: none is left behind)."""
        with self.lock:
            return len(self._meetings)
