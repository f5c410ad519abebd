"""Decode side of the side channel: :class:`SideChannelClient` fetches a prefill's metadata
and sends one release, renewal or claim of its leases, each over a fresh DEALER socket."""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TypeVar

import zmq

from kvxfer.net.hosts import endpoint
from kvxfer.transfer.side_channel.failures import PeerRefused, PeerUnreachable, SideChannelTimeout
from kvxfer.transfer.side_channel.sockets import (
    MAX_RESPONSE_BYTES,
    PROBE_TIMEOUT_S,
    connect_error,
    new_socket,
)
from kvxfer.wire.compat import CompatInfo, compat_hash
from kvxfer.wire.envelope import decode_envelope, decode_payload, encode_message
from kvxfer.wire.messages import (
    MAX_RELEASE_REASON_CHARS,
    DoneReport,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    MessageKind,
    MetadataRequest,
    MetadataResponse,
    ReleaseAck,
    ReleaseLease,
    ReleaseOutcome,
    RenewAck,
    RenewLease,
    check_response,
)
from kvxfer.wire.protocol_errors import MalformedMessage, SideChannelError
from kvxfer.wire.replay import ReplayGuard

log = logging.getLogger(__name__)
_Ack = TypeVar("_Ack", ReleaseAck, RenewAck)
_Reply = TypeVar("_Reply", ReleaseAck, RenewAck, HeartbeatAck)

BACKOFF_S = 0.05              # first pause between attempts; doubles, capped at MAX_BACKOFF_S
MAX_BACKOFF_S = 0.5
PROBE_AFTER_S = 0.05          # a renewal unanswered this long: probe whether anyone listens
RELEASE_TIMEOUT_S = 1.0       # one release attempt; a lost release only costs the lease TTL


class SideChannelClient:
    """Decode side: fetches a prefill instance's metadata. Cheap to call repeatedly.

    One ZMQ context per client; each :meth:`fetch` attempt opens and closes its
    own DEALER socket. Safe to call from several threads at once. Caching the
    answer per remote engine is the caller's job.

    With ``keep_connections`` (a client that one thread uses, as a
    :class:`~kvxfer.transfer.side_channel.sender.SideChannelSender`'s), a call that
    was answered leaves its connection open for the next call to the same address, so
    a claim, renewal, release or "done" report costs its one exchange, not a TCP and
    ZMTP handshake first (nor, for a release, a TCP probe). A call that got no answer
    or failed closes it: a late reply can never be taken for the next call's.
    """

    def __init__(self, engine_id: str, compat: CompatInfo,
                 hmac_key: bytes | None = None, *, keep_connections: bool = False) -> None:
        self.engine_id = engine_id
        self.compat, self._hash = compat, compat_hash(compat)
        self._key = hmac_key
        self._replay = ReplayGuard()  # replies, too, are refused when replayed
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._kept: dict[str, zmq.Socket[bytes]] | None = {} if keep_connections else None
        self._closed = False

    @property
    def connections(self) -> int:
        """Connections kept open (0 without ``keep_connections``)."""
        return len(self._kept or {})

    def fetch(self, host: str, port: int, ranks: Sequence[int], *, timeout: float = 5.0,
              retries: int = 2) -> MetadataResponse:
        """Metadata of prefill ``ranks`` from the listener at ``host:port``.

        Up to ``1 + retries`` attempts of ``timeout`` seconds each, with a short
        backoff between them; only timeouts are retried (a refusal or a protocol
        error would repeat). When every attempt timed out, a TCP probe of at most
        PROBE_TIMEOUT_S tells the error message whether anything listens there.
        The response holds exactly the requested ranks, in request order.
        """
        if self._closed:
            raise RuntimeError("SideChannelClient is closed")
        if not timeout > 0:
            raise ValueError(f"handshake timeout must be positive, got {timeout!r}")
        if retries < 0:
            raise ValueError(f"handshake retries must not be negative, got {retries!r}")
        if not 0 < port < 65536:
            raise ValueError(f"handshake port must be in 1..65535, got {port!r}")
        address = endpoint(host, port)
        wanted = tuple(operator.index(r) for r in ranks)  # numpy ints yes, floats no
        request = encode_message(MetadataRequest(self.engine_id, wanted),
                                 compat=self.compat, hmac_key=self._key)
        # A refused TCP connect is definitive and costs microseconds; without this
        # check a dead prefill would cost every attempt's full timeout. Handshakes
        # are cached by the caller, so the extra connect is paid once per peer.
        why_not = connect_error(host, port, min(timeout, PROBE_TIMEOUT_S))
        if why_not is not None and "timed out" not in why_not:
            raise PeerUnreachable(f"cannot connect to {address}: {why_not}", peer=address,
                                  expected="a listening side channel", found=why_not)
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S))
            frames = self._exchange(host, address, request, timeout)
            if frames is not None:
                return self._parse(frames, address, wanted)
            log.info("handshake with %s: no answer within %g s (attempt %d of %d)", address,
                     timeout, attempt + 1, retries + 1)
        why = ("something accepts connections there but did not answer"
               if connect_error(host, port, min(timeout, PROBE_TIMEOUT_S)) is None
               else "nothing accepts connections there")
        raise SideChannelTimeout(f"no answer from {address} within {timeout:g} s on any of "
                               f"{retries + 1} attempts ({why})", peer=address,
                               expected=f"an answer within {timeout:g} s", found=why)

    def release(self, host: str, port: int, lease_id: str, reason: str, *,
                timeout: float = RELEASE_TIMEOUT_S,
                outcome: ReleaseOutcome = ReleaseOutcome.ABANDONED) -> bool:
        """Tell the prefill listening at ``host:port`` that lease ``lease_id`` will not
        be read; True when it held that lease, False when it did not (nothing changed).

        One attempt of at most ``timeout`` seconds (a lost release only means the
        lease runs until its TTL, so it is not worth retrying). ``reason`` is
        truncated to MAX_RELEASE_REASON_CHARS. The reply's compatibility hash is
        not checked: the prefill may serve another model. Raises a
        :class:`SideChannelError` naming the peer address on any failure
        (:class:`PeerRefused` for an :class:`ErrorReply`).
        """
        message = ReleaseLease(lease_id, self.engine_id, reason[:MAX_RELEASE_REASON_CHARS],
                               outcome)
        return self._acknowledged(host, port, message, lease_id, "release", timeout,
                                  probe_first=True)

    def report_done(self, host: str, port: int, report: DoneReport, *,
                    timeout: float = RELEASE_TIMEOUT_S) -> bool:
        """Tell the prefill listening at ``host:port`` a reader's "done" (``report``); True
        when it held that lease as the report came, False when not (nothing changed).
        One attempt, failures raised as by :meth:`release` (the caller resends); sent at
        once, a refused TCP connect is looked for only when no answer came within
        :data:`PROBE_AFTER_S` (a report goes with every read: no probe when all is well)."""
        return self._acknowledged(host, port, report, report.done.request_id, "done report",
                                  timeout, probe_first=False)

    def _acknowledged(self, host: str, port: int, message: ReleaseLease | DoneReport,
                      lease_id: str, what: str, timeout: float, *, probe_first: bool) -> bool:
        """Send ``message`` (about lease ``lease_id``) in one attempt, after a TCP probe
        (``probe_first``) or with one when no answer comes at once; its ReleaseAck's
        ``found``."""
        if self._closed:
            raise RuntimeError("SideChannelClient is closed")
        if not timeout > 0:
            raise ValueError(f"{what} timeout must be positive, got {timeout!r}")
        if not 0 < port < 65536:
            raise ValueError(f"{what} port must be in 1..65535, got {port!r}")
        address = endpoint(host, port)
        request = encode_message(message, compat=self.compat, hmac_key=self._key)
        probe_first = probe_first and address not in (self._kept or {})  # known to answer
        why_not = connect_error(host, port, min(timeout, PROBE_TIMEOUT_S)) if probe_first \
            else None
        if why_not is not None and "timed out" not in why_not:
            raise PeerUnreachable(f"cannot connect to {address}: {why_not}", peer=address,
                                  expected="a listening side channel", found=why_not)
        frames = self._exchange(host, address, request, timeout,
                                probe_port=None if probe_first else port)
        if frames is None:
            raise SideChannelTimeout(f"no answer from {address} to the {what} of lease "
                                   f"{lease_id!r} within {timeout:g} s", peer=address,
                                   expected=f"an answer within {timeout:g} s",
                                   found="no answer")
        return self._parse_ack(frames, address, lease_id, ReleaseAck, what).found

    def renew(self, host: str, port: int, lease_id: str, *,
              timeout: float = RELEASE_TIMEOUT_S, claim: bool = False,
              side_channel: tuple[str, int] = ("", 0)) -> RenewAck:
        """Ask the prefill at ``host:port`` to keep lease ``lease_id`` for another TTL
        (with ``claim``: to claim it for this engine first, see :class:`RenewLease`;
        a prefill claiming a decode's reservation names its own ``side_channel``).

        One attempt of at most ``timeout`` seconds; the ack says whether the lease was
        still held (and claimed by this engine) and for how long it now lasts. Raises
        a :class:`SideChannelError` naming the peer address on any failure; without an
        answer within :data:`PROBE_AFTER_S`, a refused TCP connect is reported at once
        (:class:`PeerUnreachable`), so a dead prefill costs no full timeout.
        """
        if self._closed:
            raise RuntimeError("SideChannelClient is closed")
        address = endpoint(host, port)
        request = encode_message(RenewLease(lease_id, self.engine_id, claim, *side_channel),
                                 compat=self.compat, hmac_key=self._key)
        frames = self._exchange(host, address, request, timeout, probe_port=port)
        if frames is None:
            raise SideChannelTimeout(f"no answer from {address} to the renewal of lease "
                                   f"{lease_id!r} within {timeout:g} s", peer=address)
        return self._parse_ack(frames, address, lease_id, RenewAck, "renewal")

    def who(self, host: str, port: int, *, timeout: float) -> str:
        """The engine id that answers a heartbeat at ``host:port``: who serves there now,
        asked without changing anything there. One attempt of at most ``timeout``
        seconds; raises as :meth:`renew` does (:class:`PeerUnreachable` at once when the
        TCP connect fails other than by timing out)."""
        if self._closed:
            raise RuntimeError("SideChannelClient is closed")
        address = endpoint(host, port)
        request = encode_message(Heartbeat(self.engine_id, 0), compat=self.compat,
                                 hmac_key=self._key)
        frames = self._exchange(host, address, request, timeout, probe_port=port)
        if frames is None:
            raise SideChannelTimeout(f"no answer from {address} to a heartbeat within "
                                   f"{timeout:g} s", peer=address)
        return self._parse_reply(frames, address, HeartbeatAck, "a heartbeat").engine_id

    def close(self) -> None:
        """Close the kept connections and the ZMQ context (idempotent)."""
        if not self._closed:
            self._closed = True
            for sock in (self._kept or {}).values():
                sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> SideChannelClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _exchange(self, host: str, address: str, request: bytes, timeout: float, *,
                  probe_port: int | None = None) -> list[bytes] | None:
        """One attempt on a fresh DEALER (or the kept one): the reply frames, or None after
        ``timeout``.

        With ``probe_port``, no answer within :data:`PROBE_AFTER_S` is explained by a TCP
        connect, and one that is refused raises :class:`PeerUnreachable` (free when the
        peer answers, unlike a probe before every request)."""
        sock = self._kept.pop(address, None) if self._kept is not None else None
        fresh = sock is None
        if sock is None:
            sock = new_socket(self._ctx, zmq.DEALER, host, MAX_RESPONSE_BYTES)
        frames: list[bytes] | None = None
        try:
            try:
                if fresh:
                    sock.connect(address)
                sock.send(request, zmq.NOBLOCK)  # queued until the connection is up
            except zmq.ZMQError as exc:
                raise SideChannelError(f"cannot send a handshake request to {address}: {exc}",
                                     peer=address) from exc
            wait_ms = max(1, round(timeout * 1000))
            if probe_port is not None and wait_ms > PROBE_AFTER_S * 1000:
                early = round(PROBE_AFTER_S * 1000)
                if sock.poll(early, zmq.POLLIN):
                    frames = sock.recv_multipart()
                    return frames
                wait_ms -= early
                why_not = connect_error(host, probe_port, PROBE_TIMEOUT_S)
                if why_not is not None and "timed out" not in why_not:
                    raise PeerUnreachable(f"cannot connect to {address}: {why_not}",
                                          peer=address, expected="a listening side channel",
                                          found=why_not)
            if sock.poll(wait_ms, zmq.POLLIN):
                frames = sock.recv_multipart()
            return frames
        finally:
            if self._kept is not None and frames is not None and not self._closed:
                self._kept[address] = sock  # answered: nothing more can arrive on it
            else:
                sock.close(linger=0)

    def _parse(self, frames: list[bytes], address: str,
               ranks: Sequence[int]) -> MetadataResponse:
        if len(frames) != 1:
            raise MalformedMessage("reply", f"{len(frames)} frames, expected 1", peer=address,
                                   expected=1, found=len(frames))
        envelope = decode_envelope(frames[0], expected_hash=self._hash, peer=address,
                                   hmac_key=self._key, local_compat=self.compat,
                                   replay=self._replay)
        if envelope.kind is MessageKind.ERROR_REPLY:
            raise PeerRefused(decode_payload(envelope, ErrorReply, peer=address), peer=address)
        response = decode_payload(envelope, MetadataResponse, peer=address)
        return check_response(response, ranks, peer=address)

    def _parse_reply(self, frames: list[bytes], address: str, kind: type[_Reply],
                     what: str) -> _Reply:
        """The ``kind`` answer in a reply; a refusal (naming ``what``) or anything else
        raises, naming the peer."""
        if len(frames) != 1:
            raise MalformedMessage("reply", f"{len(frames)} frames, expected 1", peer=address,
                                   expected=1, found=len(frames))
        envelope = decode_envelope(frames[0], expected_hash=None, peer=address,
                                   hmac_key=self._key, replay=self._replay)
        if envelope.kind is MessageKind.ERROR_REPLY:
            raise PeerRefused(decode_payload(envelope, ErrorReply, peer=address), peer=address,
                              what=what)
        return decode_payload(envelope, kind, peer=address)

    def _parse_ack(self, frames: list[bytes], address: str, lease_id: str,
                   kind: type[_Ack], what: str) -> _Ack:
        """The ``kind`` ack of lease ``lease_id`` in a reply; a refusal or anything else
        raises, naming ``what`` ("release", "renewal") and the peer."""
        ack = self._parse_reply(frames, address, kind, f"the {what} of lease {lease_id!r}")
        if ack.lease_id != lease_id:
            raise MalformedMessage(f"{what} ack", f"it acknowledges lease {ack.lease_id!r}, "
                                                  f"not {lease_id!r}", peer=address,
                                   expected=lease_id, found=ack.lease_id)
        return ack
