"""The decode side's view of prefill leases: which may be read, which were used, renewals.

Pure: the standard library only. :class:`LeaseBook` is owned by a decode's ``LeaseClient``
and called from its owner's thread (``claim`` also from HTTP handlers: thread-safe);
:class:`HeldLease` deadlines are seconds on the decode's monotonic clock. The prefill, not
the book, decides who reads a lease.

Design: docs/design/leases.md#the-decodes-lease-book
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from kvxfer.wire.tickets import LeaseClaims, TicketError, verify_ticket

CLOCK_MARGIN_S = 1.0
"""How long past its expiry a consumed lease is still remembered (clock skew)."""

RENEW_FRACTION = 0.5
"""A waiting decode renews its lease once less than this share of its TTL is left."""

READ_MARGIN_S = 0.1
"""A READ starts only while at least min(the read timeout + this, the renewal point)
of the lease is left (:meth:`HeldLease.readable_for`); renewals go on while it runs."""

MAX_REMEMBERED = 100_000
"""How many consumed leases a :class:`LeaseBook` remembers at most; beyond, it refuses."""


class LeaseRefused(ValueError):
    """The params name a lease this decode must not read (expired, forged, used)."""


class LeaseExpired(LeaseRefused):
    """The params' lease ended by its own expiry (its ticket, with a key, is genuine):
    not read, but the request itself may be served by recomputing its prompt."""


@dataclass
class HeldLease:
    """A claimed lease that is still to be read (decode side, engine-loop thread).

    ``deadline`` is when the prefill may end it, on :func:`time.monotonic`'s
    clock; ``ttl`` is how long a renewal extends it (learned from the first
    renewal; before that, the time the ticket had left when it was claimed).
    """

    deadline: float
    ttl: float
    renewing: bool = False
    lost: str | None = None  # why the lease can no longer be read (a renewal failed)
    claimed: bool = False  # the prefill granted this decode's claim
    refused: bool = False  # the prefill refused the claim (another decode's, or ended)

    @classmethod
    def from_expiry(cls, expires_at: float, *, now_wall: float | None = None,
                    now: float | None = None) -> HeldLease:
        now_wall = time.time() if now_wall is None else now_wall
        now = time.monotonic() if now is None else now
        left = max(0.0, expires_at - now_wall)
        return cls(deadline=now + left, ttl=left)

    def needs_claim(self) -> bool:
        return self.lost is None and not self.renewing and not self.claimed

    def needs_renewal(self, now: float) -> bool:
        return (self.lost is None and not self.renewing and self.claimed
                and self.deadline - now < self.ttl * RENEW_FRACTION)

    def renewed(self, sent_at: float, expires_in: float, *, claim: bool = False) -> None:
        """A renewal (``claim``: the claim) sent at ``sent_at`` (monotonic) was granted for
        ``expires_in`` s. The claim's answer replaces the deadline taken from the ticket's
        wall-clock expiry: it is measured on the prefill's clock as a duration, so clock
        skew between the two sides does not matter (the delay only shortens it)."""
        self.renewing = False
        end = sent_at + expires_in
        self.deadline = end if claim else max(self.deadline, end)
        self.ttl = expires_in
        self.claimed = self.claimed or claim

    def readable_for(self, now: float, read_timeout: float) -> bool:
        """Whether a READ bounded by ``read_timeout`` may start now: claimed, not lost, and
        enough of the lease left (else renew first; a lease too short for the whole
        timeout needs only up to the renewal point, since renewals go on during it)."""
        need = min(read_timeout + READ_MARGIN_S, self.ttl * RENEW_FRACTION)
        return self.claimed and self.lost is None and self.deadline - now >= need

    def why_unusable(self, now: float) -> str | None:
        """None when a READ may start now, else why not."""
        if self.lost is not None:
            return self.lost
        if self.deadline - now < min(READ_MARGIN_S, self.ttl / 4):
            return (f"the lease expired (or is about to) {now - self.deadline:+.3f} s from "
                    f"its deadline, before the read started")
        return None


class LeaseBook:
    """Decode side: the leases this decode claimed, remembered until their expiry so that
    a replay is refused; :meth:`claim` is the local check before any READ. Thread-safe."""

    def __init__(self, key: bytes | None, *, max_age: float = math.inf,
                 max_remembered: int = MAX_REMEMBERED) -> None:
        self._key, self.max_age, self._max = key, max_age, max_remembered
        self._consumed: dict[tuple[str, str], float] = {}  # (engine, lease) -> forget at
        self._lock = threading.Lock()
        self._next_purge = 0.0

    @property
    def signed(self) -> bool:
        return self._key is not None

    def claim(self, claims: LeaseClaims, ticket: object, *,
              now: float | None = None) -> HeldLease:
        """Check ``claims`` (and ``ticket``) before any READ and mark the lease used.

        Raises :class:`LeaseRefused` naming the reason (:class:`LeaseExpired` for a lease
        that is genuine but ended); nothing is recorded then.
        """
        now = time.time() if now is None else now
        expires = claims.expires_at
        if self._key is not None:  # first: a forged ticket is refused as forged, expired or not
            try:
                verify_ticket(self._key, claims, ticket)
            except TicketError as exc:
                raise LeaseRefused(str(exc)) from None
        if not math.isfinite(expires):
            raise LeaseRefused(f"kv_transfer_params.lease_expires_at is {expires!r}")
        if expires <= now:
            raise LeaseExpired(f"kv_transfer_params.lease_expires_at is {now - expires:.3f} s "
                               f"in the past by this instance's clock: the lease ended and "
                               f"its blocks may hold other data")
        if expires - now > self.max_age + CLOCK_MARGIN_S:
            raise LeaseRefused(f"kv_transfer_params.lease_expires_at is {expires - now:.0f} s "
                               f"ahead, more than the maximum lease age of {self.max_age:g} s")
        lease = (claims.engine_id, claims.lease_id)
        with self._lock:
            if now >= self._next_purge or len(self._consumed) >= self._max:
                self._consumed = {k: t for k, t in self._consumed.items() if t > now}
                self._next_purge = now + 1.0
            if lease in self._consumed:
                raise LeaseRefused(f"lease {claims.lease_id!r} of prefill {claims.engine_id} "
                                   f"was already used by a request: a lease is read once")
            if len(self._consumed) >= self._max:
                raise LeaseRefused(f"this decode already remembers {self._max} unexpired "
                                   f"leases it read: try again later")
            self._consumed[lease] = expires + CLOCK_MARGIN_S
        return HeldLease.from_expiry(expires, now_wall=now)

    def was_claimed(self, engine_id: str, lease_id: str) -> bool:
        with self._lock:
            return (engine_id, lease_id) in self._consumed

    @property
    def num_remembered(self) -> int:
        with self._lock:
            return len(self._consumed)
