""":class:`SideChannelSender` sends side-channel messages (claims, renewals, releases,
"done" reports) from one background thread, so that no caller waits on a peer. A decode's
lease client renews with one; an instance's
:class:`~kvxfer.transfer.side_channel.reports.Reports` sends its reports and releases with
a few."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvxfer.net.hosts import endpoint
from kvxfer.transfer.side_channel.client import RELEASE_TIMEOUT_S, SideChannelClient
from kvxfer.transfer.side_channel.failures import PeerUnreachable, SideChannelTimeout
from kvxfer.transfer.side_channel.sockets import (
    JOIN_TIMEOUT_S,
    POLL_INTERVAL_S,
    PROBE_TIMEOUT_S,
)
from kvxfer.wire.messages import DoneReport, ReleaseOutcome, RenewAck
from kvxfer.wire.protocol_errors import SideChannelError

log = logging.getLogger(__name__)

RELEASE_QUEUE = 1024          # releases waiting to be sent; more are dropped (and logged)
RELEASE_DRAIN_S = 1.0         # how long SideChannelSender.close() keeps sending what is queued
# Pauses before each resend of an unanswered report, the last one repeated until the
# report's lease would have ended anyway (its expiry, or DONE_RESEND_FOR_S without one): a
# report lost several times in a row must still end its lease long before the TTL.
DONE_RESENDS_S = (0.1, 0.2, 0.4, 0.8, 1.0)
DONE_RESEND_FOR_S = 30.0
# One attempt of a "done" report (resent after): a lease's end may wait on it where the
# notification was lost, and an unanswered one holds up the messages behind it.
DONE_TIMEOUT_S = 0.1


@dataclass(frozen=True)
class _Renewal:
    """A queued renewal (or claim) and whom to tell how it went."""

    done: Callable[[RenewAck | None, float, str], None]
    claim: bool


@dataclass(frozen=True)
class _Release:
    """A queued release: why (for the prefill's log) and how the lease ends there."""

    reason: str
    outcome: ReleaseOutcome


@dataclass(frozen=True)
class _Report:
    """A queued "done" report, how many times it was sent already, and until when
    (monotonic s) an unanswered one is resent."""

    report: DoneReport
    until: float
    sent: int = 0


class SideChannelSender:
    """Sends releases, claims, renewals and "done" reports from one daemon thread.

    Every ``submit`` only queues (thread-safe, never blocks), so the engine-loop
    thread and HTTP handlers can call it. Releases are best effort: at most
    ``max_queued`` wait (further ones are dropped), each gets one attempt of
    ``timeout`` seconds, and failures are only logged; a lost release means the
    prefill frees the blocks at lease expiry instead. A "done" report
    (:meth:`submit_done`) is resent after each pause of :data:`DONE_RESENDS_S` (the last
    one repeated) while it gets no answer, until its lease would have ended anyway: it
    is what ends a lease when the NIXL notification was lost. :meth:`close` keeps
    sending what is queued for at most ``drain_s`` seconds, then drops the rest
    and stops the thread. ``sent``, ``dropped`` and ``failed`` count outcomes
    (``sent``: the prefill answered, whether or not it held the lease). The
    sender owns ``client`` and closes it in :meth:`close`.
    """

    _STOP = object()

    def __init__(self, client: SideChannelClient, *, timeout: float = RELEASE_TIMEOUT_S,
                 max_queued: int = RELEASE_QUEUE, drain_s: float = RELEASE_DRAIN_S) -> None:
        self._client, self._timeout, self._drain_s = client, timeout, drain_s
        self._queue: queue.Queue[object] = queue.Queue(max_queued)
        self._give_up_at: float | None = None  # set by close(): drop what is still queued then
        self._resends: list[tuple[float, int, tuple[str, int, str, _Report]]] = []  # a heap
        self._order = itertools.count()  # ties in the heap: first queued, first resent
        self._closed = False
        self.sent = self.dropped = self.failed = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvxfer-release-{client.engine_id}")
        self._thread.start()

    def submit(self, host: str, port: int, lease_id: str, reason: str,
               outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        """Queue one release; False (logged) when closed or the queue is full."""
        return self._put((host, port, lease_id, _Release(reason, outcome)), "release")

    def submit_renew(self, host: str, port: int, lease_id: str,
                     done: Callable[[RenewAck | None, float, str], None], *,
                     claim: bool = False) -> bool:
        """Queue one renewal or claim (:meth:`SideChannelClient.renew`); ``done(ack,
        sent_at, why)`` is called on the sender's thread with the ack (None on failure),
        the monotonic time it was sent and, unless renewed, why not. False (and no call)
        when closed or the queue is full."""
        return self._put((host, port, lease_id, _Renewal(done, claim)),
                         "claim" if claim else "renewal")

    def submit_done(self, host: str, port: int, report: DoneReport,
                    expires_in: float | None = None) -> bool:
        """Queue one reader's "done" report for the prefill rank at ``host:port``
        (:meth:`SideChannelClient.report_done`), resent while unanswered for the
        ``expires_in`` seconds its lease has left (None: :data:`DONE_RESEND_FOR_S`);
        False (logged) when closed or full."""
        until = time.monotonic() + (DONE_RESEND_FOR_S if expires_in is None
                                    else max(0.0, expires_in))
        return self._put((host, port, report.done.request_id, _Report(report, until)),
                         "done report")

    def _put(self, item: tuple[str, int, str, _Release | _Renewal | _Report],
             what: str) -> bool:
        host, port, lease_id, _ = item
        if self._closed:
            log.info("%s of lease %s at %s not sent: the sender is closed", what, lease_id,
                     endpoint(host, port))
            return False
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            log.warning("%s of lease %s at %s dropped: %d messages already wait; its "
                        "holder frees it at its expiry", what, lease_id,
                        endpoint(host, port), self._queue.maxsize)
            return False
        return True

    def close(self) -> None:
        """Send what is queued for at most ``drain_s`` s, then stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._give_up_at = time.monotonic() + self._drain_s
        # When the queue is full the thread drains it (fast past the deadline), then
        # finds it empty and stops.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(self._STOP)
        self._thread.join(self._drain_s + self._timeout + PROBE_TIMEOUT_S + JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # its socket is still open: leave the context alone
            log.error("side-channel sender of %s did not stop", self._client.engine_id)
            return
        self._client.close()

    def _run(self) -> None:
        while True:
            wait = self._resends[0][0] - time.monotonic() if self._resends else None
            if self._closed:  # the timeout only matters when close() found the queue full
                wait = POLL_INTERVAL_S if wait is None else min(wait, POLL_INTERVAL_S)
            try:
                item = self._queue.get(timeout=None if wait is None else max(0.0, wait))
            except queue.Empty:
                item = None
            if item is self._STOP or (item is None and self._closed and not self._resends):
                self._drop_resends()
                return
            while self._resends and self._resends[0][0] <= time.monotonic():
                self._handle(heapq.heappop(self._resends)[2])
            if item is not None:
                assert isinstance(item, tuple)
                self._handle(item)

    def _handle(self, item: tuple[str, int, str, _Release | _Renewal | _Report]) -> None:
        host, port, lease_id, reason = item
        if self._give_up_at is not None and time.monotonic() > self._give_up_at:
            self.dropped += 1
            what = ("renewal" if isinstance(reason, _Renewal)
                    else "done report" if isinstance(reason, _Report) else "release")
            log.info("%s of lease %s at %s dropped: shutting down", what, lease_id,
                     endpoint(host, port))
            return
        if isinstance(reason, _Renewal):
            self._send_renew(host, port, lease_id, reason)
        elif isinstance(reason, _Report):
            self._send_report(host, port, reason)
        else:
            self._send(host, port, lease_id, reason)

    def _send_report(self, host: str, port: int, queued: _Report) -> None:
        """Send a "done" report; one without an answer is resent after the next pause."""
        done = queued.report.done
        try:
            found = self._client.report_done(host, port, queued.report,
                                             timeout=min(self._timeout, DONE_TIMEOUT_S))
        except Exception as exc:  # the thread must survive anything
            unanswered = isinstance(exc, (SideChannelTimeout, PeerUnreachable))
            due = time.monotonic() + DONE_RESENDS_S[min(queued.sent, len(DONE_RESENDS_S) - 1)]
            if unanswered and due < queued.until and not self._closed:
                retry = (host, port, done.request_id, replace(queued, sent=queued.sent + 1))
                heapq.heappush(self._resends, (due, next(self._order), retry))
                log.info("the done of lease %s at %s got no answer (%s): resending it",
                         done.request_id, endpoint(host, port), exc)
                return
            self.failed += 1
            log.warning("the done of lease %s at %s failed after %d attempt(s) (%s): its "
                        "holder frees it at its expiry", done.request_id,
                        endpoint(host, port), queued.sent + 1, exc)
            return
        self.sent += 1
        log.debug("reported the done of lease %s (rank %d) at %s: %s", done.request_id,
                  done.reader_rank, endpoint(host, port),
                  "counted" if found else "it was not held (ended already)")

    def _drop_resends(self) -> None:
        if self._resends:
            self.dropped += len(self._resends)
            log.info("%d done reports not resent: shutting down", len(self._resends))
            self._resends.clear()

    def _send_renew(self, host: str, port: int, lease_id: str, renewal: _Renewal) -> None:
        sent_at, done = time.monotonic(), renewal.done
        try:
            got = self._client.renew(host, port, lease_id, timeout=self._timeout,
                                     claim=renewal.claim)
            ack: RenewAck | None = got
            why = "" if got.found else (got.reason or "the prefill no longer holds it")
        except Exception as exc:  # the thread must survive anything
            ack, why = None, str(exc)
            log.warning("could not renew lease %s at %s: %s", lease_id, endpoint(host, port),
                        exc)
        try:
            done(ack, sent_at, why)
        except Exception:
            log.exception("the renewal callback of lease %s failed", lease_id)

    def _send(self, host: str, port: int, lease_id: str, release: _Release) -> None:
        reason = release.reason
        try:
            found = self._client.release(host, port, lease_id, reason, timeout=self._timeout,
                                         outcome=release.outcome)
        except (SideChannelError, ValueError, RuntimeError) as exc:
            self.failed += 1
            log.warning("could not release lease %s: %s (the prefill frees it at lease "
                        "expiry)", lease_id, exc)
            return
        except Exception:  # the thread must survive anything
            self.failed += 1
            log.exception("releasing lease %s at %s failed unexpectedly", lease_id,
                          endpoint(host, port))
            return
        self.sent += 1
        log.info("released lease %s at %s (%s): %s", lease_id, endpoint(host, port), reason,
                 "freed" if found else "it was not held (ended already)")
