"""``Liveness``: since when each prefill side channel a decode reads from has left a
heartbeat unanswered.

Pure (the standard library only) and thread-safe: readers (worker threads) watch channels
and ask :meth:`Liveness.silent_since`; the heartbeat thread sends, records answers and
forgets idle channels. Only heartbeats actually sent count. The bound: a READ from a peer
silent since ``t`` fails at most ``interval + timeout`` seconds after ``t``.

Design: docs/design/side-channel.md#liveness-the-bookkeeping
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

Channel = tuple[str, int]
"""A prefill side channel: its host and port (one per prefill instance, or one per rank
where its ranks listen apart, ``remote_rank_ports``)."""

HEARTBEATS_PER_TIMEOUT = 4  # the interval between heartbeats is a quarter of the timeout
MAX_UNANSWERED = 64  # more unanswered heartbeats on one channel add nothing: none is sent
LINGER_S = 30.0  # an unwatched channel keeps its connection this long, then it is closed


@dataclass
class _Channel:
    """One side channel's heartbeats: the next ``seq``, when the next one is due, the
    unanswered ones (seq -> monotonic time sent) and when nobody watched it any more."""

    next_seq: int = 0
    next_due: float = 0.0
    unanswered: dict[int, float] = field(default_factory=dict)
    idle_since: float | None = None
    answered_at: float | None = None  # when a heartbeat was last answered


class Liveness:
    """Per watched side channel, heartbeats sent and answered (thread-safe).
    ``timeout`` (s): how long a channel may leave a heartbeat
    unanswered while a READ from it is in flight; heartbeats go every ``timeout /``
    :data:`HEARTBEATS_PER_TIMEOUT` seconds."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"the heartbeat timeout must be a positive number of seconds, "
                             f"got {timeout!r}")
        self.timeout = timeout
        self.interval = timeout / HEARTBEATS_PER_TIMEOUT
        self._watching: dict[Hashable, frozenset[Channel]] = {}  # by owner (a reader)
        self._channels: dict[Channel, _Channel] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._on_new_channel: Callable[[], None] = lambda: None

    def on_new_channel(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the watching thread) whenever a channel nobody watched
        is watched: the heartbeat thread, which waits in its poll while nothing is due,
        sends its first heartbeat at once."""
        self._on_new_channel = callback

    @property
    def bound(self) -> float:
        """The longest a READ in flight from a silent peer goes on after the peer went
        silent: a heartbeat interval plus the timeout."""
        return self.interval + self.timeout

    # -- readers ----------------------------------------------------------------------------
    def watch(self, owner: Hashable, channels: Iterable[Channel], now: float) -> None:
        """``owner`` (a reader) has READs in flight from ``channels`` (replacing what it
        said before; none: it watches nothing). A channel newly watched gets its first
        heartbeat at once."""
        watched = frozenset(channels)
        with self._lock:
            if self._stopped or self._watching.get(owner, frozenset()) == watched:
                return
            before = self._watched()
            if watched:
                self._watching[owner] = watched
            else:
                self._watching.pop(owner, None)
            everyone = self._watched()
            for channel in watched:
                self._channels.setdefault(channel, _Channel())
            for channel, state in self._channels.items():
                if channel in everyone:
                    state.idle_since = None
                elif state.idle_since is None:
                    state.idle_since = now
        if not watched <= before:
            self._on_new_channel()

    def silent_since(self, channels: Iterable[Channel]) -> float | None:
        """The monotonic time since which one of ``channels`` has left a heartbeat
        unanswered (the earliest such), or None while every one answers."""
        with self._lock:
            sent = [min(state.unanswered.values()) for channel in channels
                    if (state := self._channels.get(channel)) is not None and state.unanswered]
        return min(sent, default=None)

    def stop(self) -> None:
        """No more heartbeats go out (their thread ended): nothing is silent from now on,
        so reads wait for their read timeout again, as without heartbeats."""
        with self._lock:
            self._stopped = True
            self._watching.clear()
            self._channels.clear()

    # -- the heartbeat thread ---------------------------------------------------------------
    def beats_due(self, now: float) -> list[tuple[Channel, int]]:
        """The watched channels whose heartbeat is due, each with the ``seq`` to send; each
        counts as sent at ``now`` (none while :data:`MAX_UNANSWERED` wait)."""
        due: list[tuple[Channel, int]] = []
        with self._lock:
            for channel in self._watched():
                state = self._channels[channel]
                if now < state.next_due:
                    continue
                state.next_due = now + self.interval
                if len(state.unanswered) < MAX_UNANSWERED:
                    seq, state.next_seq = state.next_seq, state.next_seq + 1
                    state.unanswered[seq] = now
                    due.append((channel, seq))
        return due

    def next_due(self) -> float | None:
        """When the next heartbeat is due (monotonic), None when no channel is watched."""
        with self._lock:
            return min((self._channels[c].next_due for c in self._watched()), default=None)

    def answered(self, channel: Channel, seq: int) -> bool:
        """Heartbeat ``seq`` on ``channel`` was answered, and so every earlier one; False
        (nothing changes) for a heartbeat not waiting for an answer there."""
        with self._lock:
            state = self._channels.get(channel)
            if state is None or seq not in state.unanswered:
                return False
            state.unanswered = {s: t for s, t in state.unanswered.items() if s > seq}
            state.answered_at = time.monotonic()
            return True

    def last_answered(self, channels: Iterable[Channel]) -> float | None:
        """The monotonic time by which every one of ``channels`` had answered its latest
        heartbeat (the earliest of their last answers), None when one never answered."""
        with self._lock:
            times = [state.answered_at if (state := self._channels.get(c)) is not None
                     else None for c in channels]
        if not times or any(t is None for t in times):
            return None
        return min(t for t in times if t is not None)

    def channels(self) -> list[Channel]:
        """Every channel with a connection to keep: watched, or idle for under
        :data:`LINGER_S`."""
        with self._lock:
            return list(self._channels)

    def forget_idle(self, now: float) -> list[Channel]:
        """Forget the channels nobody watched for :data:`LINGER_S`; they are returned (their
        connections to close)."""
        with self._lock:
            gone = [c for c, state in self._channels.items()
                    if state.idle_since is not None and now - state.idle_since >= LINGER_S]
            for channel in gone:
                del self._channels[channel]
        return gone

    def _watched(self) -> set[Channel]:
        return {c for channels in self._watching.values() for c in channels}
