"""``LeaseClient``: a decode's claims, renewals and releases of the prefill leases it reads.

One per decode, shared by the sidecar's pull decode and the vLLM worker side
(:class:`~kvxfer.vllm.worker_side.WorkerSide`); each keeps its own requests and asks this
one about their leases. Every method runs on the owner's thread (the engine loop, vLLM's
model-runner thread) except :meth:`release_named` and :meth:`release`, which only queue;
the senders' answers are applied on the owner's thread by :meth:`take_answers`. A lease's
life on the decode side (check, claim, renew, read, release) and leases held on several
ports: ``docs/design/leases.md``, "A decode's claims".
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvxfer.wire.lease_book import HeldLease, LeaseBook
from kvxfer.wire.messages import ReleaseOutcome

if TYPE_CHECKING:  # the senders import ZMQ
    from kvxfer.transfer.side_channel.reports import Reports
    from kvxfer.transfer.side_channel.sender import SideChannelSender
    from kvxfer.wire.messages import RenewAck
    from kvxfer.wire.params import RemoteParams

log = logging.getLogger(__name__)


class Answer(enum.Enum):
    """What the prefill said to one claim or renewal."""

    GRANTED = "granted"        # it holds the lease for this decode, ``expires_in`` more s
    REFUSED = "refused"        # ended, another decode's, too old: never read it
    UNANSWERED = "unanswered"  # no answer (unreachable, timed out, garbled)


class Readiness(enum.Enum):
    """Whether a held lease may be read now (:meth:`LeaseClient.readiness`)."""

    WAIT = "wait"    # its claim, or a renewal it needs first, is on its way
    READ = "read"    # a READ may start now
    ENDED = "ended"  # lost, or past its deadline: never read (fail the request)


class LeaseEnded(Exception):
    """A lease ended before its READ started, or before it finished: its KV is not used."""

    def __init__(self, lease_id: str, message: str) -> None:
        super().__init__(message)
        self.lease_id = lease_id


@dataclass(frozen=True)
class LeaseAnswer:
    """The prefill's answer to one claim (``claim``) or renewal of lease ``lease_id``.

    ``sent_at`` is when it was sent (monotonic), ``expires_in`` the seconds granted
    (GRANTED only), ``why`` why not (otherwise).
    """

    lease_id: str
    claim: bool
    answer: Answer
    sent_at: float
    expires_in: float = 0.0
    why: str = ""

    @classmethod
    def of(cls, lease_id: str, ack: RenewAck | None, sent_at: float, why: str, *,
           claim: bool) -> LeaseAnswer:
        """From :meth:`SideChannelSender.submit_renew`'s ``done(ack, sent_at, why)``."""
        if ack is None:
            return cls(lease_id, claim, Answer.UNANSWERED, sent_at, why=why)
        if not ack.found:
            return cls(lease_id, claim, Answer.REFUSED, sent_at, why=why)
        return cls(lease_id, claim, Answer.GRANTED, sent_at, expires_in=ack.expires_in)

    def apply(self, lease: HeldLease) -> None:
        """Change ``lease`` as this answer says (the owner's thread)."""
        if self.answer is Answer.GRANTED:
            lease.renewed(self.sent_at, self.expires_in, claim=self.claim)
            return
        lease.renewing = False  # a failed renewal is retried until the deadline
        if self.answer is Answer.REFUSED:
            lease.lost = f"the prefill no longer holds it for this decode ({self.why})"
            lease.refused = self.claim
        elif self.claim:  # not retried: a dead or frozen prefill costs one attempt
            lease.lost = f"the prefill did not answer this decode's claim: {self.why}"


class _Fanin:
    """The answers of every side channel to one claim or renewal, made one: granted when
    every port granted it (for the least time any granted), else the first refusal, else
    the first unanswered. ``answered(answer, partly)`` gets it once the last port
    answered; ``partly``: it is not granted, but some port granted it."""

    def __init__(self, ports: int, answered: Callable[[LeaseAnswer, bool], None]) -> None:
        self._left, self._answered = ports, answered
        self._parts: list[LeaseAnswer] = []
        self._lock = threading.Lock()

    def add(self, part: LeaseAnswer) -> None:
        with self._lock:
            self._parts.append(part)
            self._left -= 1
            if self._left:
                return
        parts = self._parts
        partly = any(p.answer is Answer.GRANTED for p in parts)
        for kind in (Answer.REFUSED, Answer.UNANSWERED):
            failed = [p for p in parts if p.answer is kind]
            if failed:
                self._answered(failed[0], partly)
                return
        first = min(parts, key=lambda p: p.sent_at)
        self._answered(dataclasses.replace(first, expires_in=min(p.expires_in for p in parts)),
                       False)


class LeaseClient:
    """A decode's claims, renewals and releases of the leases it reads.

    ``renewer`` sends claims and renewals (the client owns it and closes it in
    :meth:`close`); ``reports``, the instance's, sends releases. ``read_timeout`` (s)
    bounds a READ: one starts only with that much of the lease left (or up to the
    renewal point, see :meth:`HeldLease.readable_for`).
    """

    def __init__(self, book: LeaseBook, reports: Reports, renewer: SideChannelSender, *,
                 read_timeout: float) -> None:
        self.book, self.read_timeout = book, read_timeout
        self._reports: Reports | None = reports
        self._renewer: SideChannelSender | None = renewer
        self._answers: queue.SimpleQueue[tuple[HeldLease, LeaseAnswer]] = queue.SimpleQueue()
        self._answered = threading.Event()  # an answer is queued

    def check(self, remote: RemoteParams) -> HeldLease:
        """The local check of ``remote``'s lease before anything is sent or read; it is
        marked used. Raises LeaseRefused (expired, forged, used) or ValueError (no expiry)."""
        return self.book.claim(remote.claims(), remote.lease_ticket)

    def claim(self, remote: RemoteParams, lease: HeldLease) -> bool:
        """Ask the prefill for ``lease`` now; False when it could not be queued (closed,
        or too many queued): :meth:`renew_due` tries again."""
        return self._send(remote, lease, claim=True)

    def renew_due(self, held: Iterable[tuple[RemoteParams, HeldLease]],
                  now: float | None = None) -> None:
        """Send the claims not sent yet and the renewals due of the ``held`` leases."""
        now = time.monotonic() if now is None else now
        for remote, lease in held:
            if lease.needs_claim() or lease.needs_renewal(now):
                self._send(remote, lease, claim=not lease.claimed)

    def _send(self, remote: RemoteParams, lease: HeldLease, *, claim: bool) -> bool:
        """Queue a claim or renewal of ``lease`` on the renewer's thread (never the
        caller's); True when one is on its way, queued now or before."""
        renewer = self._renewer  # read once: close() clears it
        if lease.renewing:
            return True
        if renewer is None:
            return False
        lease_id = remote.remote_request_id
        ports = list(remote.side_channels())  # one, unless the prefill's ranks listen apart

        def answered(answer: LeaseAnswer, partly: bool) -> None:  # a sender thread
            self._answers.put((lease, answer))
            self._answered.set()
            if partly and claim:  # some ranks hold it for this decode: free them now
                self.release(remote, f"the claim was refused by another prefill rank: "
                                     f"{answer.why}")
            elif claim and answer.answer is Answer.UNANSWERED:
                # a frozen prefill may grant it on waking, to a decode that gave up on it
                self.release(remote, f"this decode gave up on its claim: {answer.why}")

        fanin = _Fanin(len(ports), answered)
        lease.renewing = True
        for index, port in enumerate(ports):
            def done(ack: RenewAck | None, sent_at: float, why: str, port: int = port) -> None:
                fanin.add(LeaseAnswer.of(lease_id, ack, sent_at,
                                         why if len(ports) == 1 else f"port {port}: {why}",
                                         claim=claim))

            if renewer.submit_renew(remote.remote_host, port, lease_id, done, claim=claim):
                continue
            if index == 0:  # nothing sent: renew_due tries again
                lease.renewing = False
                return False
            done(None, time.monotonic(), "not sent: too many claims and renewals queued")
        return True

    def wait_for_answer(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until an answer is queued; whether one is. For an
        owner with nothing else to do meanwhile (vLLM's step waiting for a claim)."""
        return self._answered.wait(timeout)

    def take_answers(self) -> list[LeaseAnswer]:
        """Apply the answers that came back since the last call to their leases (a
        lease whose request ended meanwhile changes, and nobody looks at it)."""
        self._answered.clear()
        taken: list[LeaseAnswer] = []
        while True:
            try:
                lease, answer = self._answers.get_nowait()
            except queue.Empty:
                return taken
            answer.apply(lease)
            taken.append(answer)

    def readiness(self, lease: HeldLease, now: float | None = None) -> Readiness:
        """Whether a READ of ``lease`` may start now (see :class:`Readiness`)."""
        now = time.monotonic() if now is None else now
        if lease.lost is not None:
            return Readiness.ENDED
        if not lease.claimed:
            return Readiness.WAIT
        if lease.readable_for(now, self.read_timeout):
            return Readiness.READ
        return Readiness.ENDED if now >= lease.deadline else Readiness.WAIT

    @staticmethod
    def check_unread(remote: RemoteParams, lease: HeldLease, now: float | None = None) -> None:
        """Raise :class:`LeaseEnded` when ``lease`` must not be read now (lost, or expired
        or about to): its blocks may hold another prompt's KV."""
        ended = lease.why_unusable(time.monotonic() if now is None else now)
        if ended is not None:
            raise LeaseEnded(remote.remote_request_id,
                             f"lease {remote.remote_request_id} of prefill "
                             f"{remote.remote_engine_id} was not read: {ended}")

    @staticmethod
    def check_in_time(remote: RemoteParams, lease: HeldLease, now: float | None = None) -> None:
        """Raise :class:`LeaseEnded` when a READ of ``lease`` that just finished ended
        after the lease could (a refused renewal alone proves nothing: the READ's own
        "done" may have ended it first)."""
        now = time.monotonic() if now is None else now
        if now >= lease.deadline:
            raise LeaseEnded(remote.remote_request_id,
                             f"lease {remote.remote_request_id} was read, but its KV is not "
                             f"used: the lease ended {now - lease.deadline:.3f} s before the "
                             f"read did")

    def release(self, remote: RemoteParams, reason: str,
                outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        """Any thread: tell the prefill that ``remote``'s lease will not be read (queued
        for a sender thread; ``outcome``: why, as the prefill counts it); False when not
        queued."""
        reports = self._reports  # read once: close() may clear it from another thread
        if reports is None:
            return False
        queued = [reports.release(remote.remote_host, port, remote.remote_request_id, reason,
                                  outcome)
                  for port in remote.side_channels()]
        return all(queued)

    def release_named(self, remote: RemoteParams, reason: str,
                      outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        """Any thread: :meth:`release` a lease that a request named but never reached the
        owner with, only when this decode may claim it (:meth:`check`): a refused request
        must not free a lease it merely names. False when not queued."""
        try:
            self.check(remote)
        except ValueError as exc:  # LeaseRefused, or no expiry
            log.info("not releasing lease %s named by a refused request: %s",
                     remote.remote_request_id, exc)
            return False
        return self.release(remote, reason, outcome)

    def release_after_failed_read(self, remote: RemoteParams, why: str) -> bool:
        """A READ failed and some prefill rank was never told by a NIXL notification."""
        return self.release(remote, f"the decode's KV read failed: {why}")

    def close(self) -> None:
        """Stop the renewer (idempotent); nothing is sent afterwards (the instance closes
        its reports, which sends the releases still queued)."""
        renewer = self._renewer
        self._reports = self._renewer = None
        if renewer is not None:
            renewer.close()
