"""``ReadPath``: one way a read moves some of its prefill ranks' blocks, and its outcomes.

The :class:`~kvxfer.transfer.reads.reader.Reader` drives every path alike, on the worker's
thread: :meth:`ReadPath.reserve` (False: not yet), :meth:`ReadPath.start` (posts),
:meth:`ReadPath.progress` until :data:`LANDED`, then :meth:`ReadPath.finish`, or
:meth:`ReadPath.abandon`, which hands READs still in flight to the reader as :class:`Stale`.
:class:`ReadFailed` is the one way a read fails. A new way to move bytes is a new path class.

Design: docs/design/reads.md#read-paths
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from kvxfer.transfer.nixl_agent import in_flight, release_transfers
from kvxfer.transfer.results import PathStats, ReadStats, Span, TransferError

TIMEOUT: Final = "{timeout}"  # where a Waiting's reason names the read timeout's seconds


class ReadFailed(TransferError):
    """A read cannot go on. ``notify``: its prefill ranks may be told over NIXL that this
    rank will not read (``ok=False``); ``peer_gone``: why the peer is taken for dead
    (None: not the peer's fault)."""

    def __init__(self, message: str, *, notify: bool = True, peer_gone: str | None = None
                 ) -> None:
        super().__init__(message)
        self.notify, self.peer_gone = notify, peer_gone


@dataclass(frozen=True)
class Landed:
    """Every byte of the path is in place."""


LANDED: Final = Landed()


@dataclass(frozen=True)
class Deadline:
    """When a read that is still waiting is given up (``at``, monotonic), ``seconds`` after
    it was posted (what a :class:`Waiting`'s ``{timeout}`` then says); ``silence`` says
    why it came before the read timeout (its peer's side channel went silent: see
    :class:`~kvxfer.transfer.liveness.Liveness`), None at the read timeout itself."""

    at: float
    seconds: float
    silence: str | None = None

    def earlier(self, other: Deadline | None) -> Deadline:
        """Whichever of the two comes first (this one when ``other`` is None, or a tie)."""
        return other if other is not None and other.at < self.at else self


@dataclass(frozen=True)
class Waiting:
    """Not landed yet: ``reason`` is what a read timeout then reports (``{timeout}``
    standing for its seconds); ``peer`` names the prefill when it owes the bytes (a
    timeout then takes it for dead, and its silence may bring the deadline forward)."""

    reason: str
    peer: str | None = None

    def timed_out(self, deadline: Deadline) -> ReadFailed:
        """The failure of a read still waiting at its ``deadline``."""
        seconds = deadline.seconds
        why = self.reason.replace(TIMEOUT, f"{seconds:.0f}" if seconds >= 10 or
                                  seconds == int(seconds) else f"{seconds:.1f}")
        if deadline.silence is not None:
            why = f"{why}: {deadline.silence}"
        if self.peer is None:
            return ReadFailed(why)
        return ReadFailed(f"{self.peer}: {why}", peer_gone=why)


Progress = Landed | Waiting


class ReadPath(ABC):
    """One way of moving a read's bytes: ``reserve``, ``start``/``post``, ``progress``,
    then ``finish`` or ``abandon``. ``ranks``: the prefill ranks this path reads."""

    name = "nixl"  # the path's word in stats and metrics (kvxfer.transfer.routes.PATHS)
    # its READs carry its ranks' "done" (else the reader tells them once the read landed)
    notifies = False
    lands_in_post = False  # every byte is in place once post() returned

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)
        self.num_bytes = 0  # placed into this rank's views
        self.descriptors = 0  # NIXL descriptors, or copies
        self.seconds: float | None = None  # from its post until it landed
        # NIXL's own timing where NIXL alone moved the path's bytes (first post to last
        # completion seen, kvxfer.transfer.nixl_agent.merge_spans); None for copies
        self.nixl_span: Span | None = None
        self._began: float | None = None

    def reserve(self) -> bool:
        """Take what :meth:`post` needs; False to wait (nothing is taken then)."""
        return True

    def start(self) -> None:
        """:meth:`post`, timed: :attr:`seconds` runs from here until :meth:`landed`."""
        self._began = time.perf_counter()
        self.post()
        if self.lands_in_post:
            self.landed()

    def landed(self) -> None:
        """The path landed (its first :data:`LANDED`): stop its clock."""
        if self.seconds is None and self._began is not None:
            self.seconds = time.perf_counter() - self._began

    @abstractmethod
    def post(self) -> None:
        """Start the path (the read timeout counts from here)."""

    def progress(self) -> Progress:
        """Where the path stands (a path that copies in :meth:`post` has landed)."""
        return LANDED

    @abstractmethod
    def finish(self) -> None:
        """Every path of the read landed: give back what this one holds."""

    def abandon(self, reason: str) -> Stale | None:
        """The read failed or is given up (``reason``): stop and give back everything but
        the READs still in flight, returned as :class:`Stale` (None: nothing more lands
        for it once this returns)."""
        self.finish()
        return None

    def add_to(self, stats: ReadStats) -> ReadStats:
        """``stats`` with what this path moved added."""
        return replace(stats, num_bytes=stats.num_bytes + self.num_bytes,
                       descriptors=stats.descriptors + self.descriptors,
                       paths=(*stats.paths, PathStats(self.name, self.num_bytes, self.seconds)))


def reads_landed(transfers: Sequence[Any]) -> bool:
    """Whether every posted READ landed; each is asked (which progresses its agent).
    Raises :class:`TransferError` with the first failure's text (NIXL's state)."""
    states = []
    for transfer in transfers:
        try:
            states.append(transfer.state())
        except Exception as exc:
            states.append(f"ERR: {exc}")
    failed = next((s for s in states if s.startswith("ERR")), None)
    if failed is not None:
        raise TransferError(failed)
    return all(s == "DONE" for s in states)


class Stale:
    """READs an abandoned path left in flight (``transfers``: their bytes may still land);
    ``blocks``: whether they land in the read's blocks (else in staging, which the pool
    holds meanwhile). :meth:`settled` asks each one (which progresses its agent; the
    thread that owns the agents calls it); :meth:`release` frees the handles."""

    def __init__(self, transfers: Sequence[Any], request_id: str, *, blocks: bool = True
                 ) -> None:
        self.transfers, self.request_id = list(transfers), request_id
        self.blocks = blocks

    def settled(self) -> bool:
        """Whether every READ ended (landed or failed): nothing more lands for them."""
        return not in_flight(self.transfers)

    def release(self) -> None:
        release_transfers(self.transfers, self.request_id)


def abandon_transfers(transfers: list[Any], request_id: str, *, blocks: bool = True
                      ) -> Stale | None:
    """Release the ``transfers`` that ended; those still in flight become :class:`Stale`."""
    pending = in_flight(transfers)
    release_transfers([t for t in transfers if t not in pending], request_id)
    transfers.clear()
    return Stale(pending, request_id, blocks=blocks) if pending else None
