"""``LeaseTable``: the blocks a prefill rank holds for decode readers, until they are done;
``LeaseAnswers``: a prefill's side-channel answers about its leases, over its rank tables
(``ReservationAnswers``: the same for a push-mode decode's reservations).

A lease ends "done", "failed", "abandoned", "cached", "answered" or "expired"; the table
never frees blocks (its caller does, on :meth:`LeaseTable.take_released`), and a lease id
must be unique per lease. Every method is thread-safe: the listener's thread claims, renews,
releases and counts reports; the worker's thread receives notifications and expires leases;
the owner's thread holds, ends and takes releases. A "done" that does not verify is ignored.

Design: docs/design/leases.md
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvxfer.transfer.faults import LOSS, MessageLoss
from kvxfer.transfer.results import STALE_LIMIT_S, Released, Tally
from kvxfer.wire.messages import DoneReport, ReleaseOutcome, RenewRefused
from kvxfer.wire.notification import ReadDone, decode_notif
from kvxfer.wire.protocol_errors import BadSignature, ProtocolError

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
    gave_up: bool = False  # a party's "done" said it did not move its bytes (ok=False)
    due: float = math.inf  # the deadline it was held with (``expires`` may be extended)


class LeaseTable:
    """One prefill rank's leases: held blocks, their claimer, and why each ended (thread-safe).
    ``key`` verifies "done" notifications, ``tally`` counts
    the ones ignored or late, ``loss`` loses some on purpose (:mod:`kvxfer.transfer.faults`:
    the process's, none unless its environment asks)."""

    def __init__(self, key: bytes | None, tally: Tally, loss: MessageLoss = LOSS) -> None:
        self._key, self._tally, self._loss = key, tally, loss
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
            expires = time.monotonic() + ttl
            self._leases[request_id] = _Lease(tuple(block_ids), readers, expires, due=expires)

    def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
              max_age: float = math.inf) -> float:
        """Extend lease ``request_id`` for decode ``requester`` to ``ttl`` seconds from now,
        never past ``max_age`` seconds after :meth:`hold`, never shorter; the seconds it
        now has left; :class:`~kvxfer.wire.messages.RenewRefused` says why not. A claim
        (``claim``) is granted to the first engine that claims the lease (and again to
        it: a retried claim); a renewal only to its claimer."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                raise RenewRefused("the prefill no longer holds it (it ended, or was never "
                                   "handed out)")
            if claim and lease.claimer is None:
                if time.monotonic() >= lease.due:
                    raise RenewRefused("its deadline passed before anyone claimed it")
                lease.claimer = requester
            if lease.claimer != requester:
                raise RenewRefused("another decode claimed it first: a lease is read by one "
                                   "decode" if lease.claimer is not None else
                                   "it was renewed before it was claimed")
            now = time.monotonic()
            end = lease.held_at + max_age
            if now >= end:
                raise RenewRefused(f"it reached the maximum lease age of {max_age:g} s")
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

    def claimer(self, request_id: str) -> str | None:
        """The engine that claimed held lease ``request_id`` (None: unclaimed, not held)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return None if lease is None else lease.claimer

    def end(self, request_id: str, reason: str, *,
            claimers: tuple[str | None, ...] | None = None) -> bool:
        """End lease ``request_id`` now, released with ``reason``; False when it is not
        held, or (``claimers`` given) when its claimer is none of them (None: nobody
        claimed it), checked as one step with claims: nothing changes then."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or (claimers is not None and lease.claimer not in claimers):
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

    def awaited(self) -> int:
        """Leases within the deadline they were held with: their party's "done" is due
        any moment (the worker polls for it fast). A lease a claim or renewal kept past
        that deadline waits for a straggler (a write given up in flight, say)."""
        now = time.monotonic()
        with self._lock:
            return sum(now < lease.due for lease in self._leases.values())

    def receive(self, notifications: Mapping[str, Sequence[bytes]]) -> None:
        """Worker thread: count the "done" notifications (raw, by sending agent) this
        rank's agent got."""
        for sender, messages in notifications.items():
            for raw in messages:
                if self._loss.drop("notification"):
                    self._tally.notifications_failed("dropped")
                    continue
                try:
                    note = decode_notif(raw, peer=f"agent {sender!r}", hmac_key=self._key)
                except ProtocolError as exc:  # a forged "done" must not end a lease
                    log.warning("ignoring a notification: %s", exc)
                    self._tally.notifications_failed(
                        "bad_signature" if isinstance(exc, BadSignature) else "malformed")
                    continue
                self.count_done(note, f"agent {sender!r}")

    def count_done(self, note: ReadDone, sender: str, *, report: bool = False) -> bool:
        """Record one reader's "done" (from a NIXL notification or, ``report``, the side
        channel: each counted once per reader); the lease ends once all its readers said
        it. Whether the lease was held as it came: a late notification is counted as late
        (not a report, whose notification was counted, nor one for a lease that ended
        "done": its readers' other copy came first), and one from another engine than
        the lease's claimer changes nothing."""
        with self._lock:
            lease = self._leases.get(note.request_id)
            if lease is None:  # a late reader of an ended lease, or a stray note
                ended = self._ended.get(note.request_id, "unknown")
                # each reader's "done" comes twice (notification, report): the second
                # copy of one that ended the lease is no late one
                if not report and ended not in ("done", "failed"):
                    self._tally.notification_late(ended)
                log.debug("ignoring a done for lease %s from %s, which is not held "
                          "(ended: %s)", note.request_id, sender, ended)
                return False
            if lease.claimer not in (None, note.reader_engine_id):
                log.warning("ignoring a done for lease %s from %s: decode %s claimed it, not "
                            "%s", note.request_id, sender, lease.claimer,
                            note.reader_engine_id)
                return False
            lease.done_by.add((note.reader_engine_id, note.reader_rank))
            needed = lease.readers if lease.readers is not None else note.expected_readers
            if not note.ok:
                lease.gave_up = True
                log.info("%s rank %d gave up on request %s", note.reader_engine_id,
                         note.reader_rank, note.request_id)
            if len(lease.done_by) >= needed:
                self._end(note.request_id, "failed" if lease.gave_up else "done")
            return True

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


class RankLeases(Protocol):
    """The lease table of one prefill rank (``TransferWorker``'s, thread-safe)."""

    @property
    def rank(self) -> int: ...

    def count_done(self, note: ReadDone, sender: str) -> bool:
        """A reader's "done" reported over the side channel (:meth:`LeaseTable.count_done`
        with ``report``)."""

    def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
              max_age: float = ...) -> float: ...

    def may_end(self, request_id: str, requester: str) -> bool: ...

    def holds_lease(self, request_id: str) -> bool: ...

    def end_lease(self, request_id: str, reason: str = ..., *,
                  claimers: tuple[str | None, ...] | None = ...) -> bool: ...


@dataclass(frozen=True)
class Release:
    """A decode's side-channel release of lease ``lease_id``, as queued for the owner."""

    lease_id: str
    requester: str  # the decode's engine id
    reason: str
    outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED


class LeaseAnswers:
    """A prefill's side-channel answers to releases, claims, renewals and "done" reports over
    ``ranks``. ``ttl`` (s): how long a claim or renewal extends a lease; ``max_age``
    (s): no lease is renewed past that long after it was held."""

    releasable = True  # a decode may release a lease over the side channel

    def __init__(self, ranks: Sequence[RankLeases], *, ttl: float, max_age: float) -> None:
        self.ranks, self.ttl, self.max_age = ranks, ttl, max_age
        self._releases: queue.SimpleQueue[Release] = queue.SimpleQueue()
        # a claim over the ranks and a release's end over them never interleave: else a
        # claim refused on a rank the release ended would keep the others, unread
        self._over_ranks = threading.Lock()


    def on_release(self, lease_id: str, requester: str, reason: str,
                   outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        """Listener thread: queue a decode's release for :meth:`take_releases` (only
        its claimer's, or an unclaimed lease's); whether the lease is held right now."""
        if not all(rank.may_end(lease_id, requester) for rank in self.ranks):
            log.warning("decode %s released lease %s, which another decode claimed: ignored",
                        requester, lease_id)
            return False
        self._releases.put(Release(lease_id, requester, reason, outcome))
        return any(rank.holds_lease(lease_id) for rank in self.ranks)

    def on_renew(self, lease_id: str, requester: str, claim: bool) -> float:
        """Listener thread: claim (``claim``) or extend a held lease by ``ttl`` on every
        rank: the seconds it has left. The first rank's refusal (ended, another claimer,
        too old) is raised, after every rank was asked (as each would be asked alone)."""
        answers: list[float] = []
        refused: list[RenewRefused] = []
        with self._over_ranks:
            for rank in self.ranks:
                try:
                    answers.append(rank.renew(lease_id, self.ttl, requester, claim=claim,
                                              max_age=self.max_age))
                except RenewRefused as exc:
                    refused.append(exc)
        if refused:
            raise refused[0]
        log.debug("decode %s %s lease %s", requester, "claimed" if claim else "renewed",
                  lease_id)
        return min(answers)

    def on_done(self, report: DoneReport, requester: str) -> bool:
        """Listener thread: count a reader's "done" (a push's writer's, on a decode)
        reported over the side channel on the rank it names, as its NIXL notification
        would be; whether that rank held the lease. ValueError for a rank this instance
        does not serve."""
        for rank in self.ranks:
            if rank.rank == report.prefill_rank:
                return rank.count_done(report.done, f"{requester} (side channel)")
        raise ValueError(f"this instance serves ranks {sorted(r.rank for r in self.ranks)}, "
                         f"not {report.prefill_rank}")

    def take_releases(self) -> list[Release]:
        """Owner's thread: end the released leases on every rank still holding them; the
        releases that ended a lease on some rank."""
        taken: list[Release] = []
        while True:
            try:
                release = self._releases.get_nowait()
            except queue.Empty:
                return taken
            with self._over_ranks:  # a decode that claimed it since keeps it
                ended = [rank.end_lease(release.lease_id, release.outcome.value,
                                        claimers=(None, release.requester))
                         for rank in self.ranks]
            if not any(ended):
                log.info("decode %s released lease %s, which is not held (ended already, "
                         "never handed out, or claimed by another decode since): ignored",
                         release.requester, release.lease_id)
                continue
            log.info("decode %s will not read lease %s (%s): freeing its blocks",
                     release.requester, release.lease_id, release.reason)
            taken.append(release)


class ReservationAnswers(LeaseAnswers):
    """A push-mode decode's side-channel answers over its ``ranks``, whose reservations
    are leases: a prefill claims one before its first WRITE (:meth:`on_renew` with
    ``claim``; the first engine only, and before the deadline it was held with), which
    keeps it held up to :data:`~kvxfer.transfer.results.STALE_LIMIT_S` past the
    reservation's deadline (``reservation_ttl`` after it was made), unless its writers end
    it ("done", or ``ok=False`` once their WRITEs ended). Nothing renews a reservation,
    and only the caller holding one releases it (over HTTP, not the side channel)."""

    releasable = False

    def __init__(self, ranks: Sequence[RankLeases], reservation_ttl: float) -> None:
        span = reservation_ttl + STALE_LIMIT_S
        super().__init__(ranks, ttl=span, max_age=span)

    def on_renew(self, lease_id: str, requester: str, claim: bool) -> float:
        if not claim:
            raise RenewRefused("a reservation is claimed by its writer, never renewed")
        return super().on_renew(lease_id, requester, claim)

    def on_release(self, lease_id: str, requester: str, reason: str,
                   outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        log.warning("engine %s released reservation %s over the side channel: ignored (its "
                    "holder releases it over HTTP)", requester, lease_id)
        return False
