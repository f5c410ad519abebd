"""``LeaseTable``: the blocks a prefill rank holds for decode readers, until they are done.

Who calls what (every method is thread-safe):

* the caller (the connector, vLLM's worker side), per request: :meth:`hold` leases the
  blocks until every expected decode reader has notified "done", the caller ends it
  (:meth:`end`, e.g. on a side-channel release) or the lease expires;
  :meth:`take_released` returns the leases that ended and why ("done", "abandoned",
  "expired"). A lease id is what the decode echoes back: keep it unique per lease, so
  a late "done" can never end a newer lease. The table never frees blocks: the caller
  frees them when released.
* the handshake listener's thread: :meth:`renew` claims or renews a lease for one
  decode engine (one claimer per lease, at most ``max_age`` seconds in all),
  :meth:`may_end` says whether a requester may release it, :meth:`holds` whether it
  is held.
* the worker's thread: :meth:`receive` takes the NIXL notifications the rank's agent
  got (each verified with the instances' key: one that does not verify or decode is
  ignored and counted, so nobody without the key can end a lease) and :meth:`expire`
  ends the leases whose time ran out.

A verified "done" for a lease that is not held counts as late, by how that lease had
ended: the last :data:`ENDED_REMEMBERED` ended leases are remembered for that.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvxfer.transfer.results import Released, Tally
from kvxfer.wire.errors import BadSignature, ProtocolError
from kvxfer.wire.notification import ReadDone, decode_notif

log = logging.getLogger(__name__)

ENDED_REMEMBERED = 4096    # ended leases kept to tell a late "done" from a stray one


@dataclass
class _Lease:
    block_ids: tuple[int, ...]
    readers: int | None
    expires: float
    done_by: set[tuple[str, int]] = field(default_factory=set)
    held_at: float = field(default_factory=time.monotonic)  # the maximum age counts from here
    claimer: str | None = None  # the decode engine that claimed it (see renew)


class LeaseTable:
    """See the module docstring; ``key`` verifies "done" notifications, ``tally`` counts
    the ones ignored or late."""

    def __init__(self, key: bytes | None, tally: Tally) -> None:
        self._key, self._tally = key, tally
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._released: list[Released] = []
        self._ended: dict[str, str] = {}  # lease id -> reason, the last ENDED_REMEMBERED

    def hold(self, request_id: str, block_ids: Sequence[int], readers: int | None,
             ttl: float) -> None:
        """Lease ``block_ids`` until ``readers`` decode ranks said "done" (None: the count
        each reader announces) or ``ttl`` seconds; ValueError for a bad count or ttl, or an
        id that holds a lease already."""
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        if readers is not None and readers <= 0:
            raise ValueError(f"readers must be positive, got {readers}")
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            self._leases[request_id] = _Lease(tuple(block_ids), readers, time.monotonic() + ttl)

    def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
              max_age: float = math.inf) -> float | str:
        """Extend lease ``request_id`` for decode ``requester`` to ``ttl`` seconds from now,
        never past ``max_age`` seconds after :meth:`hold`, never shorter; the seconds it
        now has left, or why not (a str). A claim (``claim``) is granted to the first
        engine that claims the lease (and again to it: a retried claim); a renewal only
        to its claimer."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return "the prefill no longer holds it (it ended, or was never handed out)"
            if claim and lease.claimer is None:
                lease.claimer = requester
            if lease.claimer != requester:
                return ("another decode claimed it first: a lease is read by one decode"
                        if lease.claimer is not None else "it was renewed before it was claimed")
            now = time.monotonic()
            end = lease.held_at + max_age
            if now >= end:
                return f"it reached the maximum lease age of {max_age:g} s"
            lease.expires = max(lease.expires, min(now + ttl, end))
            return lease.expires - now

    def may_end(self, request_id: str, requester: str) -> bool:
        """Whether decode ``requester`` may release lease ``request_id``: nobody else
        claimed it."""
        with self._lock:
            lease = self._leases.get(request_id)
            return lease is None or lease.claimer in (None, requester)

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def end(self, request_id: str, reason: str) -> bool:
        """End lease ``request_id`` now, released with ``reason``; False when it is not
        held (nothing changes)."""
        with self._lock:
            if request_id not in self._leases:
                return False
            self._end(request_id, reason)
        return True

    def take_released(self) -> list[Released]:
        """Leases that ended since the last call; their blocks may be freed now."""
        with self._lock:
            out, self._released = self._released, []
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def receive(self, notifications: Mapping[str, Sequence[bytes]]) -> None:
        """Worker thread: count the "done" notifications (raw, by sending agent) this
        rank's agent got."""
        for sender, messages in notifications.items():
            for raw in messages:
                try:
                    note = decode_notif(raw, peer=f"agent {sender!r}", hmac_key=self._key)
                except ProtocolError as exc:  # a forged "done" must not end a lease
                    log.warning("ignoring a notification: %s", exc)
                    self._tally.notifications_failed(
                        "bad_signature" if isinstance(exc, BadSignature) else "malformed")
                    continue
                self._count_done(sender, note)

    def _count_done(self, sender: str, note: ReadDone) -> None:
        """Record one reader's "done"; the lease ends once all its readers said it."""
        with self._lock:
            lease = self._leases.get(note.request_id)
            if lease is None:  # a late reader of an ended lease, or a stray note
                ended = self._ended.get(note.request_id, "unknown")
                self._tally.notification_late(ended)
                log.info("ignoring a done for lease %s from %s, which is not held "
                         "(ended: %s)", note.request_id, sender, ended)
                return
            lease.done_by.add((note.reader_engine_id, note.reader_rank))
            needed = lease.readers if lease.readers is not None else note.expected_readers
            if not note.ok:
                log.info("decode %s rank %d gave up on request %s", note.reader_engine_id,
                         note.reader_rank, note.request_id)
            if len(lease.done_by) >= needed:
                self._end(note.request_id, "done")

    def expire(self) -> None:
        """Worker thread: end the leases whose time ran out."""
        now = time.monotonic()
        with self._lock:
            for request_id, lease in list(self._leases.items()):
                if now >= lease.expires:
                    self._end(request_id, "expired")
                    log.warning("lease of request %s expired with %d reader(s) done", request_id,
                                len(lease.done_by))

    def _end(self, request_id: str, reason: str) -> None:
        """End held lease ``request_id`` (caller holds the lock); remember why, so that a
        "done" arriving later counts as late, not as a stray one."""
        del self._leases[request_id]
        self._released.append(Released(request_id, reason))
        self._ended[request_id] = reason
        if len(self._ended) > ENDED_REMEMBERED:
            del self._ended[next(iter(self._ended))]  # the oldest (dicts keep insertion order)
