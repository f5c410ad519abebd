"""``Read``: one decode rank's read of one request, whichever paths it takes.

Only what every path shares lives here: the request, the prefill's params, the local
block ids, when it started and when its paths were posted, and the paths themselves
(:class:`~kvxfer.transfer.reads.path.ReadPath`, each with its own state). Made by
:meth:`~kvxfer.transfer.worker.TransferWorker.start_read` on the caller's thread, then owned
by the worker's thread (:class:`~kvxfer.transfer.reads.reader.Reader`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np

from kvxfer.transfer.liveness import Channel, Liveness
from kvxfer.transfer.reads.path import (
    LANDED,
    Deadline,
    Progress,
    ReadFailed,
    ReadPath,
    Waiting,
)
from kvxfer.transfer.results import ReadStats, merge_spans
from kvxfer.wire.params import RemoteParams


@dataclass
class Read:
    """One decode rank's read of one request and its paths. Block ids count logical blocks
    on both sides."""

    request_id: str
    remote: RemoteParams
    local_block_ids: np.ndarray
    started: float  # monotonic, when start_read queued it
    posted: float | None = None  # when its paths were posted (after any staging wait)
    paths: list[ReadPath] = field(default_factory=list)
    # a benchmark's probe: the same bytes as one READ of whole memory spans from the
    # request's first block on each side, over whatever blocks follow (kvxfer.plan.span_probe)
    span_probe: bool = False
    # when the lease read would end anyway (monotonic): its "done" reports are resent
    # while unanswered until then
    lease_ends: float = 0.0

    @property
    def engine(self) -> str:
        return self.remote.remote_engine_id

    @property
    def lease_id(self) -> str:
        """The prefill's lease id, which its "done" notifications name."""
        return self.remote.remote_request_id

    @functools.cached_property
    def side_channels(self) -> tuple[Channel, ...]:
        """The prefill side channels serving the ranks it reads (one, unless the prefill's
        ranks listen apart): where its peer's heartbeats are answered (asked on every turn
        of the reader's loop: computed once)."""
        host = self.remote.remote_host
        return tuple((host, port) for port in self.remote.side_channels())

    def deadline(self, timeout: float) -> Deadline:
        """Its read timeout: ``timeout`` seconds from when it was posted, or, while it
        waits to be, from when it started."""
        return Deadline((self.posted if self.posted is not None else self.started) + timeout,
                        timeout)

    def silence_deadline(self, liveness: Liveness, now: float) -> Deadline | None:
        """When a posted read is given up because its peer went silent: ``liveness.timeout``
        after the later of its post and the first heartbeat its side channels left
        unanswered (None: posted not yet, posted under that long ago, or they answer). A
        read that lands first is never failed for it."""
        if self.posted is None or now - self.posted <= liveness.timeout:
            return None  # not due yet whatever the heartbeats say: nothing to ask
        silent = liveness.silent_since(self.side_channels)
        if silent is None:
            return None
        start = max(silent, self.posted)
        return Deadline(start + liveness.timeout, start + liveness.timeout - self.posted,
                        f"its side channel has answered no heartbeat for {now - silent:.1f} s "
                        f"(heartbeat timeout {liveness.timeout:g} s)")

    def overdue(self, waiting: Waiting, timeout: float, liveness: Liveness | None,
                now: float) -> ReadFailed | None:
        """The failure of this read, still ``waiting``, once past its deadline, else None.
        The deadline: its read timeout (``timeout``, :meth:`deadline`), or, where the peer
        owes the bytes, its peer's silence (:meth:`silence_deadline`), whichever comes
        first. Called from the reader's thread, or from a lane's while a path copies."""
        deadline = self.deadline(timeout)
        if waiting.peer is not None and liveness is not None:
            deadline = deadline.earlier(self.silence_deadline(liveness, now))
        if now <= deadline.at:
            return None
        if waiting.peer is not None and liveness is not None and deadline.silence is None:
            waiting = replace(waiting, reason=f"{waiting.reason}{self._heard(liveness, now)}")
        return waiting.timed_out(deadline)

    def _heard(self, liveness: Liveness, now: float) -> str:
        """What the heartbeats say of a peer whose READ timed out, it narrows the cause: a
        peer that answers them is up (the READ did not complete); one that has left one
        unanswered for a heartbeat's interval or longer (less than the heartbeat timeout:
        else the read failed for its silence) may be gone."""
        silent = liveness.silent_since(self.side_channels)
        if silent is not None and now - silent >= liveness.timeout / 4:
            return (f" (its side channel has left a heartbeat unanswered for "
                    f"{now - silent:.1f} s)")
        answered = liveness.last_answered(self.side_channels)
        if answered is None:
            return ""
        return (f" (its side channel answered a heartbeat {now - answered:.1f} s before: the "
                f"prefill is up, the READ did not complete)")

    def progress(self) -> Progress:
        """:data:`~kvxfer.transfer.reads.path.LANDED` once every path landed, else what a
        timeout would report (a READ the peer owes before a wait of this side's own);
        raises :class:`~kvxfer.transfer.reads.path.ReadFailed`."""
        waits: list[Waiting] = []
        for path in self.paths:
            outcome = path.progress()
            if isinstance(outcome, Waiting):
                waits.append(outcome)
            else:
                path.landed()
        if not waits:
            return LANDED
        return next((w for w in waits if w.peer is not None), waits[0])

    def stats(self, now: float) -> ReadStats:
        """What the read moved, from every path; ``now``: when it ended."""
        posted = None if self.posted is None else now - self.posted
        span = merge_spans(path.nixl_span for path in self.paths)
        stats = ReadStats(0, 0, now - self.started, posted_seconds=posted,
                          nixl_seconds=None if span is None else span[1] - span[0])
        for path in self.paths:
            stats = path.add_to(stats)
        return stats

    @property
    def told(self) -> set[int]:
        """The prefill ranks whose "done" rode on this read's READs."""
        return {rank for path in self.paths if path.notifies for rank in path.ranks}
