"""The decode side's view of prefill leases: which may be read, which were used, renewals.

Pure: the standard library only, no I/O. :class:`LeaseBook` is owned by a decode
instance's connector and called from its engine-loop thread (``claim`` also from
HTTP handlers: it is thread-safe).

* :meth:`LeaseBook.claim` is the check before a decode accepts a request's
  ``kv_transfer_params``, before any READ: the lease has not expired
  (``lease_expires_at`` present and in the future), its ticket verifies with the
  shared key when there is one (:mod:`kvxfer.tickets`), and it was not claimed
  before. A claimed lease is remembered until its ticket's expiry (plus the
  clock margin), after which a replay is refused as expired anyway, so a lease
  is read at most once.
* :class:`HeldLease` tracks a claimed lease while the decode still has to read
  it: its deadline on the decode's monotonic clock, moved on by each renewal
  (``RenewAck.expires_in``), and when to renew next.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from kvxfer.tickets import LeaseClaims, TicketError, verify_ticket

CLOCK_MARGIN_S = 1.0
"""How long past its expiry a consumed lease is still remembered (clock skew)."""

RENEW_FRACTION = 0.5
"""A waiting decode renews its lease once less than this share of its TTL is left."""

READ_MARGIN_S = 0.1
"""A READ starts only while at least min(this, a quarter of the TTL) of the lease is left."""


class LeaseRefused(ValueError):
    """The params name a lease this decode must not read (expired, forged, used)."""


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

    @classmethod
    def from_expiry(cls, expires_at: float, *, now_wall: float | None = None,
                    now: float | None = None) -> HeldLease:
        now_wall = time.time() if now_wall is None else now_wall
        now = time.monotonic() if now is None else now
        left = max(0.0, expires_at - now_wall)
        return cls(deadline=now + left, ttl=left)

    def needs_renewal(self, now: float) -> bool:
        return (self.lost is None and not self.renewing
                and self.deadline - now < self.ttl * RENEW_FRACTION)

    def renewed(self, sent_at: float, expires_in: float) -> None:
        """A renewal sent at ``sent_at`` (monotonic) was granted for ``expires_in`` s."""
        self.renewing = False
        self.deadline = max(self.deadline, sent_at + expires_in)
        self.ttl = expires_in

    def why_unusable(self, now: float) -> str | None:
        """None when a READ may start now, else why not."""
        if self.lost is not None:
            return self.lost
        if self.deadline - now < min(READ_MARGIN_S, self.ttl / 4):
            return (f"the lease expired (or is about to) {now - self.deadline:+.3f} s from "
                    f"its deadline, before the read started")
        return None


class LeaseBook:
    """Decode side: which leases may be read (see the module docstring). Thread-safe."""

    def __init__(self, key: bytes | None) -> None:
        self._key = key
        self._consumed: dict[tuple[str, str], float] = {}  # (engine, lease) -> forget at
        self._lock = threading.Lock()
        self._next_purge = 0.0

    @property
    def signed(self) -> bool:
        return self._key is not None

    def claim(self, claims: LeaseClaims, ticket: object, *,
              now: float | None = None) -> HeldLease:
        """Check ``claims`` (and ``ticket``) before any READ and mark the lease used.

        Raises :class:`LeaseRefused` naming the reason; nothing is recorded then.
        """
        now = time.time() if now is None else now
        expires = claims.expires_at
        if not math.isfinite(expires) or expires <= now:
            raise LeaseRefused(f"kv_transfer_params.lease_expires_at is {expires!r}, "
                               f"{now - expires:.3f} s in the past by this instance's clock: "
                               f"the lease ended and its blocks may hold other data")
        if self._key is not None:
            try:
                verify_ticket(self._key, claims, ticket)
            except TicketError as exc:
                raise LeaseRefused(str(exc)) from None
        lease = (claims.engine_id, claims.lease_id)
        with self._lock:
            if now >= self._next_purge:
                self._consumed = {k: t for k, t in self._consumed.items() if t > now}
                self._next_purge = now + 1.0
            if lease in self._consumed:
                raise LeaseRefused(f"lease {claims.lease_id!r} of prefill {claims.engine_id} "
                                   f"was already used by a request: a lease is read once")
            self._consumed[lease] = expires + CLOCK_MARGIN_S
        return HeldLease.from_expiry(expires, now_wall=now)

    def was_claimed(self, engine_id: str, lease_id: str) -> bool:
        with self._lock:
            return (engine_id, lease_id) in self._consumed

    @property
    def num_remembered(self) -> int:
        with self._lock:
            return len(self._consumed)
