"""``LeaseAnswers``: a prefill's side-channel answers about its leases, over its rank workers.

One per prefill instance: the sidecar's :class:`~kvxfer.sidecar.connector.KVConnector`
(over all its TP ranks) and the vLLM worker's :class:`~kvxfer.vllm.transfers.WorkerSide`
(its one rank) hand :meth:`LeaseAnswers.on_release` and :meth:`LeaseAnswers.on_renew`
to their :class:`~kvxfer.transfer.side_channel.listener.HandshakeListener`.

Who calls what:

* the listener's thread calls :meth:`on_release` for a decode's ``ReleaseLease``: it
  is ignored from another engine than the lease's claimer; otherwise it is queued
  (the lease is ended by the owner's thread, not here) and the answer says whether
  the lease is held right now;
* the listener's thread calls :meth:`on_renew` for a ``RenewLease``: every rank claims
  (the first claimer only) or extends the lease by ``ttl`` seconds, never past
  ``max_age`` after it was held; the answer is the seconds it has left (the least of
  all ranks), or why a rank refused;
* the owner's thread (the engine loop; vLLM's model runner) calls
  :meth:`take_releases` now and then: every queued release ends its lease on each
  rank still holding it (``end_lease(..., "abandoned")``); the ranks report it through
  ``poll_released`` as for any other end. An id that is not a held lease (ended
  already, or never handed out) changes nothing.

The rank workers' lease methods are thread-safe; the listener's thread reads them
only.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


class RankLeases(Protocol):
    """The lease table of one prefill rank (``TransferWorker``'s, thread-safe)."""

    def renew(self, request_id: str, ttl: float, requester: str, *, claim: bool = False,
              max_age: float = ...) -> float | str: ...

    def may_end(self, request_id: str, requester: str) -> bool: ...

    def holds_lease(self, request_id: str) -> bool: ...

    def end_lease(self, request_id: str, reason: str = ...) -> bool: ...


@dataclass(frozen=True)
class Release:
    """A decode's side-channel release of lease ``lease_id``, as queued for the owner."""

    lease_id: str
    requester: str  # the decode's engine id
    reason: str


class LeaseAnswers:
    """A prefill's answers to releases and renewals over ``ranks`` (see the module
    docstring). ``ttl`` (s): how long a claim or renewal extends a lease; ``max_age``
    (s): no lease is renewed past that long after it was held."""

    def __init__(self, ranks: Sequence[RankLeases], *, ttl: float, max_age: float) -> None:
        self.ranks, self.ttl, self.max_age = ranks, ttl, max_age
        self._releases: queue.SimpleQueue[Release] = queue.SimpleQueue()

    def on_release(self, lease_id: str, requester: str, reason: str) -> bool:
        """Listener thread: queue a decode's release for :meth:`take_releases` (only
        its claimer's, or an unclaimed lease's); whether the lease is held right now."""
        if not all(rank.may_end(lease_id, requester) for rank in self.ranks):
            log.warning("decode %s released lease %s, which another decode claimed: ignored",
                        requester, lease_id)
            return False
        self._releases.put(Release(lease_id, requester, reason))
        return any(rank.holds_lease(lease_id) for rank in self.ranks)

    def on_renew(self, lease_id: str, requester: str, claim: bool) -> float | str:
        """Listener thread: claim (``claim``) or extend a held lease by ``ttl`` on every
        rank: the seconds it has left, or why a rank refused (ended, another claimer,
        too old)."""
        answers = [rank.renew(lease_id, self.ttl, requester, claim=claim,
                              max_age=self.max_age) for rank in self.ranks]
        refused = [a for a in answers if isinstance(a, str)]
        if refused:
            return refused[0]
        log.debug("decode %s %s lease %s", requester, "claimed" if claim else "renewed",
                  lease_id)
        return min(a for a in answers if not isinstance(a, str))

    def take_releases(self) -> list[Release]:
        """Owner's thread: end the released leases on every rank still holding them; the
        releases that ended a lease on some rank."""
        taken: list[Release] = []
        while True:
            try:
                release = self._releases.get_nowait()
            except queue.Empty:
                return taken
            ended = [rank.end_lease(release.lease_id, "abandoned") for rank in self.ranks]
            if not any(ended):
                log.info("decode %s released lease %s, which is not held (ended already or "
                         "never handed out): ignored", release.requester, release.lease_id)
                continue
            log.info("decode %s will not read lease %s (%s): freeing its blocks",
                     release.requester, release.lease_id, release.reason)
            taken.append(release)
