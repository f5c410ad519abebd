"""``Reports``: the one sender of an instance's "done" reports and releases to its peers.

Pull and push alike: a decode rank's read that ended reports each prefill rank's "done"
here, a prefill rank's push that ended each decode rank's, and a decode's releases of
leases it will not read go out here too. Every caller only queues (any thread); a few
:class:`~kvxfer.transfer.side_channel.sender.SideChannelSender` threads send, each lease
always on the same one, so that a peer that does not answer holds up only the messages
that share its thread. One policy for every "done": acknowledged, and resent while
unanswered until the lease would have ended anyway and at least
:data:`~kvxfer.transfer.side_channel.sender.DONE_RESEND_FOR_S`; releases are best effort.
"""

from __future__ import annotations

import threading
import time
import zlib

from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.sender import DONE_RESEND_FOR_S, SideChannelSender
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.messages import DoneReport, ReleaseOutcome

SENDERS = 4  # threads, made as needed; a lease's messages always go through the same one


class Reports:
    """An instance's reports and releases, sent in the background (see the module)."""

    def __init__(self, engine_id: str, compat: CompatInfo, key: bytes | None, *,
                 senders: int = SENDERS) -> None:
        self._engine_id, self._compat, self._key = engine_id, compat, key
        self._count = senders
        self._senders: dict[int, SideChannelSender] = {}
        self._lock = threading.Lock()
        self._closed = False

    def done(self, host: str, port: int, report: DoneReport, lease_ends: float) -> bool:
        """Queue one reader's or writer's "done" for the peer rank at ``host:port``,
        resent while unanswered until ``lease_ends`` (monotonic s: when the lease would
        end anyway) and for at least ``DONE_RESEND_FOR_S``; False when not queued."""
        sender = self._sender(report.done.request_id)
        resend_for = max(lease_ends - time.monotonic(), DONE_RESEND_FOR_S)
        return sender is not None and sender.submit_done(host, port, report, resend_for)

    def release(self, host: str, port: int, lease_id: str, reason: str,
                outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        """Queue the release of lease ``lease_id`` at ``host:port`` (one attempt, best
        effort: a lost one costs its holder the lease's expiry); False when not queued."""
        sender = self._sender(lease_id)
        return sender is not None and sender.submit(host, port, lease_id, reason, outcome)

    @property
    def sent(self) -> int:
        return sum(sender.sent for sender in list(self._senders.values()))

    def close(self) -> None:
        """Send what is queued (about a second at most), all senders at once (idempotent);
        nothing is queued afterwards."""
        with self._lock:
            self._closed = True
            senders = list(self._senders.values())
        closing = [threading.Thread(target=sender.close, name="kvxfer-reports-close")
                   for sender in senders]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()

    def _sender(self, lease_id: str) -> SideChannelSender | None:
        index = zlib.crc32(lease_id.encode()) % self._count
        with self._lock:
            if self._closed:
                return None
            if index not in self._senders:  # its thread alone uses its client
                client = SideChannelClient(self._engine_id, self._compat, hmac_key=self._key,
                                           keep_connections=True)
                self._senders[index] = SideChannelSender(client)
            return self._senders[index]
