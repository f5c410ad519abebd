"""The ZMQ side channel over which a decode instance learns a prefill's NIXL metadata.

The only module that imports ZMQ. Wire format and validation live in
:mod:`kvxfer.wire.protocol`.

* Prefill side: one :class:`HandshakeListener` per instance, a ROUTER socket
  served by a background thread, answers a :class:`MetadataRequest` with the
  :class:`AgentMetadata` of the requested local TP ranks, and a
  :class:`ReleaseLease` with a :class:`ReleaseAck` after handing it to its
  ``on_release`` callback. Whatever a peer sends (garbage, wrong frame counts,
  another version or model, a bad signature, unknown ranks) is logged with the
  peer's address and identity and answered with an :class:`ErrorReply`; the
  listener keeps serving. A release from another model is served: it carries
  no KV metadata (see :data:`~kvxfer.wire.protocol.HASH_FREE_KINDS`).
* Decode side: :class:`HandshakeClient.fetch` sends one request over a fresh
  DEALER socket per attempt (so a late answer to an abandoned attempt can
  never be mistaken for the current one), waits up to ``timeout`` seconds per
  attempt, retries only timeouts, and raises a :class:`HandshakeError` naming
  the peer address on any failure. :meth:`HandshakeClient.release` sends one
  release the same way, with one attempt. :class:`ReleaseSender` sends releases
  from a background thread, best effort, so that no caller waits on a peer.

Frames: the client sends exactly one frame (the encoded envelope) and receives
exactly one. The listener also answers REQ sockets, whose empty delimiter
frame it echoes.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import zmq

from kvxfer.net.hosts import endpoint
from kvxfer.wire.protocol import (
    AUTH_FAILED,
    MAX_RELEASE_REASON_CHARS,
    AgentMetadata,
    BadSignature,
    CompatInfo,
    ErrorCode,
    ErrorReply,
    HandshakeError,
    HashMismatch,
    MalformedMessage,
    MessageKind,
    MetadataRequest,
    MetadataResponse,
    ProtocolError,
    ReleaseAck,
    ReleaseLease,
    RenewAck,
    RenewLease,
    ReplayGuard,
    VersionMismatch,
    check_response,
    compat_hash,
    decode_envelope,
    decode_payload,
    encode_message,
)

__all__ = ["FAILURE_REASONS", "HandshakeClient", "HandshakeError", "HandshakeListener",
           "HandshakeTimeout", "PeerRefused", "ReleaseSender", "failure_reason"]

log = logging.getLogger(__name__)
_Ack = TypeVar("_Ack", ReleaseAck, RenewAck)

POLL_INTERVAL_S = 0.05        # how long close() may wait for the serving thread to notice
MAX_BATCH = 64                # requests served per wake-up, so close() stays prompt under load
MAX_REQUEST_BYTES = 64 * 1024  # a request is ~100 bytes; larger inbound messages drop the peer
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
BACKOFF_S = 0.05              # first pause between attempts; doubles, capped at MAX_BACKOFF_S
MAX_BACKOFF_S = 0.5
JOIN_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 0.5         # the TCP probe that explains a timeout
PROBE_AFTER_S = 0.05          # a renewal unanswered this long: probe whether anyone listens
RELEASE_TIMEOUT_S = 1.0       # one release attempt; a lost release only costs the lease TTL
RELEASE_QUEUE = 1024          # releases waiting to be sent; more are dropped (and logged)
RELEASE_DRAIN_S = 1.0         # how long ReleaseSender.close() keeps sending what is queued


class HandshakeTimeout(HandshakeError):
    """No answer from the peer within the deadline on any attempt."""


class PeerUnreachable(HandshakeError):
    """Nothing listens at the peer's address (the TCP connect was refused)."""


class PeerRefused(HandshakeError):
    """The peer answered with an :class:`ErrorReply`; ``code`` says why."""

    def __init__(self, reply: ErrorReply, *, peer: str, what: str = "the handshake") -> None:
        super().__init__(f"peer {peer} refused {what} ({reply.code.value}): "
                         f"{reply.message}", peer=peer, found=reply.code)
        self.code = reply.code
        self.reason = reply.message


FAILURE_REASONS = ("timeout", "unreachable", "refused", "mismatch", "auth", "malformed",
                   "error")
"""What :func:`failure_reason` answers (the ``reason`` label of failed handshakes)."""

_MISMATCH_CODES = (ErrorCode.HASH_MISMATCH, ErrorCode.VERSION_MISMATCH)


def failure_reason(exc: HandshakeError) -> str:
    """Why talking to a peer failed, in one word of :data:`FAILURE_REASONS`: no answer
    (timeout), nothing listening (unreachable), another model or protocol on either side
    (mismatch), a key that differs (auth), bytes that broke the protocol (malformed), an
    error reply for anything else (refused), or a local error sending (error)."""
    if isinstance(exc, HandshakeTimeout):
        return "timeout"
    if isinstance(exc, PeerUnreachable):
        return "unreachable"
    if isinstance(exc, PeerRefused):
        if exc.code in _MISMATCH_CODES:
            return "mismatch"
        return "auth" if exc.code is ErrorCode.BAD_SIGNATURE else "refused"
    if isinstance(exc, HashMismatch | VersionMismatch):
        return "mismatch"
    if isinstance(exc, BadSignature):
        return "auth"
    return "malformed" if isinstance(exc, ProtocolError) else "error"


def _new_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, host: str,
                max_bytes: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


class HandshakeListener:
    """Prefill side: serves every local TP rank's metadata on one ROUTER socket.

    The socket is bound in the constructor (``port=0`` picks a free port; see
    :attr:`port`), and served by a daemon thread from :meth:`start` until
    :meth:`close`. ``metadata()`` is called for each request, on the serving
    thread, and returns this instance's ranks; ``on_request(requester_engine_id)``
    is called on that thread after each successful answer.
    ``on_release(lease_id, requester_engine_id, reason)`` is called on that
    thread for each :class:`ReleaseLease` and returns whether the lease is held
    (the :class:`ReleaseAck` says so); it must only hand the release over to the
    thread that owns the leases. Without it releases are refused as
    ``unavailable``. ``on_renew(lease_id, requester_engine_id, claim)`` claims
    (``claim``) or extends a held lease and returns the seconds it now has left,
    or why not (a str; None: it is not held), which the :class:`RenewAck` says.
    All must not block for long: requests are served one at a time.

    With ``hmac_key`` every request must be signed with it and fresh (timestamp
    and nonce, see :class:`~kvxfer.wire.protocol.ReplayGuard`); an unauthenticated peer
    is answered only "authentication failed", without this side's CompatInfo, so
    it gets neither metadata (the NIXL agent blob) nor a release nor a renewal,
    and learns nothing about the model.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, engine_id: str,
                 compat: CompatInfo, metadata: Callable[[], Sequence[AgentMetadata]],
                 hmac_key: bytes | None = None,
                 on_request: Callable[[str], None] | None = None,
                 on_release: Callable[[str, str, str], bool] | None = None,
                 on_renew: Callable[[str, str, bool], float | str | None] | None = None
                 ) -> None:
        self.engine_id = engine_id
        self.host = host
        self._compat, self._hash = compat, compat_hash(compat)
        self._metadata, self._on_request = metadata, on_request
        self._on_release, self._on_renew = on_release, on_renew
        self._key = hmac_key
        self._replay = ReplayGuard()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = _new_socket(self._ctx, zmq.ROUTER, host, MAX_REQUEST_BYTES)
        try:
            if port == 0:
                self._sock.bind(endpoint(host, 0).rsplit(":", 1)[0] + ":*")
            else:
                self._sock.bind(endpoint(host, port))
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise OSError(f"handshake listener cannot bind {endpoint(host, port)}: {exc}") \
                from exc
        bound = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(bound, bytes)
        self._port = int(bound.decode().rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return endpoint(self.host, self._port)

    def start(self) -> HandshakeListener:
        """Start serving on a daemon thread (idempotent)."""
        if self._closed:
            raise RuntimeError(f"handshake listener at {self.address} is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True,
                                            name=f"kvxfer-handshake-{self._port}")
            self._thread.start()
            log.info("handshake listener for engine %s serving at %s", self.engine_id,
                     self.address)
        return self

    def close(self) -> None:
        """Stop serving within about POLL_INTERVAL_S and close the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is None:
            self._sock.close(linger=0)
        else:
            self._thread.join(timeout=JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                # the socket belongs to the stuck thread; leave it and the context alone
                log.error("handshake listener at %s: serving thread did not stop within "
                          "%.0f s", self.address, JOIN_TIMEOUT_S)
                return
        self._ctx.term()

    def __enter__(self) -> HandshakeListener:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the serving thread -------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(int(POLL_INTERVAL_S * 1000), zmq.POLLIN):
                    continue
                for _ in range(MAX_BATCH):
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._handle(frames)
                    except Exception:  # one bad exchange must never stop the listener
                        log.exception("handshake listener at %s: unexpected error",
                                      self.address)
        finally:
            self._sock.close(linger=0)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """Answer one ROUTER message: ``[identity, (b"" if REQ), envelope]``."""
        identity, body = frames[0].bytes, [f.bytes for f in frames[1:]]
        peer = _describe(frames[0])
        delimiter = [b""] if len(body) == 2 and not body[0] else []
        body = body[len(delimiter):]
        requester: str | None = None
        include_compat = True
        try:
            if len(body) != 1:
                raise MalformedMessage("request", f"{len(body)} frames after the identity, "
                                                  f"expected 1", peer=peer,
                                       expected=1, found=len(body))
            reply, requester = self._answer(body[0], peer)
        except ProtocolError as exc:
            log.warning("handshake listener at %s: %s", self.address, exc)
            reply = ErrorReply(exc.code, AUTH_FAILED if isinstance(exc, BadSignature)
                               else str(exc))
            # An unauthenticated peer is not told which model this instance serves; with
            # a key, only a signed request that failed the hash check is authenticated.
            include_compat = (not isinstance(exc, BadSignature)
                              and (self._key is None or isinstance(exc, HashMismatch)))
        try:
            raw = encode_message(reply, compat=self._compat, hmac_key=self._key,
                                 include_compat=include_compat)
        except (TypeError, ValueError, OverflowError) as exc:  # metadata() returned bad values
            log.error("handshake listener at %s: cannot encode the answer: %s", self.address,
                      exc)
            requester = None
            raw = encode_message(ErrorReply(ErrorCode.UNAVAILABLE,
                                            f"engine {self.engine_id} cannot encode its "
                                            f"metadata: {exc}"),
                                 compat=self._compat, hmac_key=self._key)
        # ROUTER drops a message for a peer that went away instead of raising
        self._sock.send_multipart([identity, *delimiter, raw], zmq.NOBLOCK)
        if requester is not None and self._on_request is not None:
            try:
                self._on_request(requester)
            except Exception:
                log.exception("handshake listener at %s: on_request(%r) failed", self.address,
                              requester)

    def _answer(self, raw: bytes, peer: str
                ) -> tuple[MetadataResponse | ReleaseAck | RenewAck | ErrorReply, str | None]:
        """The reply to one envelope, and the requester's engine id when a metadata
        request succeeded (None otherwise: no ``on_request`` call)."""
        envelope = decode_envelope(raw, expected_hash=self._hash, peer=peer,
                                   hmac_key=self._key, local_compat=self._compat,
                                   replay=self._replay)
        if envelope.kind is MessageKind.RELEASE:
            return self._release(decode_payload(envelope, ReleaseLease, peer=peer), peer), None
        if envelope.kind is MessageKind.RENEW:
            return self._renew(decode_payload(envelope, RenewLease, peer=peer), peer), None
        request = decode_payload(envelope, MetadataRequest, peer=peer)
        try:
            served = {m.tp_rank: m for m in self._metadata()}
            if not served:
                raise ValueError("no TP rank has registered its KV caches yet")
            unknown = [r for r in request.ranks if r not in served]
            if unknown:
                why = f"engine {self.engine_id} serves ranks {sorted(served)}, not {unknown}"
                log.warning("handshake listener at %s: refused %s (engine %s): %s",
                            self.address, peer, request.requester_engine_id, why)
                return ErrorReply(ErrorCode.UNKNOWN_RANK, why), None
            first = next(iter(served.values()))
            response = MetadataResponse(self.engine_id, first.tp_size,
                                        tuple(served[r] for r in request.ranks))
        except Exception as exc:  # metadata() failed or is inconsistent: our fault, not theirs
            log.error("handshake listener at %s: cannot serve metadata: %s", self.address, exc)
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} cannot serve "
                                                     f"its metadata: {exc}"), None
        return response, request.requester_engine_id

    def _release(self, release: ReleaseLease, peer: str) -> ReleaseAck | ErrorReply:
        """Hand a release to ``on_release``; the ack says whether the lease was held."""
        if self._on_release is None:
            why = f"engine {self.engine_id} holds no leases"
            log.warning("handshake listener at %s: refused a release of lease %s from %s "
                        "(engine %s): %s", self.address, release.lease_id, peer,
                        release.requester_engine_id, why)
            return ErrorReply(ErrorCode.UNAVAILABLE, why)
        try:
            found = self._on_release(release.lease_id, release.requester_engine_id,
                                     release.reason)
        except Exception as exc:
            log.exception("handshake listener at %s: on_release(%r) failed", self.address,
                          release.lease_id)
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} could not "
                                                     f"release lease {release.lease_id!r}: "
                                                     f"{exc}")
        return ReleaseAck(release.lease_id, bool(found))

    def _renew(self, renew: RenewLease, peer: str) -> RenewAck | ErrorReply:
        """Hand a renewal to ``on_renew``; the ack says whether and for how long."""
        if self._on_renew is None:
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} holds no leases")
        try:
            ttl = self._on_renew(renew.lease_id, renew.requester_engine_id, renew.claim)
        except Exception as exc:
            log.exception("handshake listener at %s: on_renew(%r) failed", self.address,
                          renew.lease_id)
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} could not "
                                                     f"renew lease {renew.lease_id!r}: {exc}")
        if ttl is None or isinstance(ttl, str):
            why = ttl or "the prefill does not hold it"
            log.info("handshake listener at %s: refused to %s (engine %s) %s lease %s: %s",
                     self.address, peer, renew.requester_engine_id,
                     "the claim of" if renew.claim else "the renewal of", renew.lease_id, why)
            return RenewAck(renew.lease_id, False, 0.0, why[:MAX_RELEASE_REASON_CHARS])
        return RenewAck(renew.lease_id, True, float(ttl))


def _describe(identity: zmq.Frame) -> str:
    """``<ip> [id <hex identity>]`` for logs and error messages."""
    try:
        address = identity.get("Peer-Address")
    except zmq.ZMQError:
        address = "unknown address"
    return f"{address} [id {identity.bytes.hex()}]"


class HandshakeClient:
    """Decode side: fetches a prefill instance's metadata. Cheap to call repeatedly.

    One ZMQ context per client; each :meth:`fetch` attempt opens and closes its
    own DEALER socket. Safe to call from several threads at once. Caching the
    answer per remote engine is the caller's job.
    """

    def __init__(self, engine_id: str, compat: CompatInfo,
                 hmac_key: bytes | None = None) -> None:
        self.engine_id = engine_id
        self.compat, self._hash = compat, compat_hash(compat)
        self._key = hmac_key
        self._replay = ReplayGuard()  # replies, too, are refused when replayed
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._closed = False

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
            raise RuntimeError("HandshakeClient is closed")
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
        why_not = _connect_error(host, port, min(timeout, PROBE_TIMEOUT_S))
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
               if _connect_error(host, port, min(timeout, PROBE_TIMEOUT_S)) is None
               else "nothing accepts connections there")
        raise HandshakeTimeout(f"no answer from {address} within {timeout:g} s on any of "
                               f"{retries + 1} attempts ({why})", peer=address,
                               expected=f"an answer within {timeout:g} s", found=why)

    def release(self, host: str, port: int, lease_id: str, reason: str, *,
                timeout: float = RELEASE_TIMEOUT_S) -> bool:
        """Tell the prefill listening at ``host:port`` that lease ``lease_id`` will not
        be read; True when it held that lease, False when it did not (nothing changed).

        One attempt of at most ``timeout`` seconds (a lost release only means the
        lease runs until its TTL, so it is not worth retrying). ``reason`` is
        truncated to MAX_RELEASE_REASON_CHARS. The reply's compatibility hash is
        not checked: the prefill may serve another model. Raises a
        :class:`HandshakeError` naming the peer address on any failure
        (:class:`PeerRefused` for an :class:`ErrorReply`).
        """
        if self._closed:
            raise RuntimeError("HandshakeClient is closed")
        if not timeout > 0:
            raise ValueError(f"release timeout must be positive, got {timeout!r}")
        if not 0 < port < 65536:
            raise ValueError(f"release port must be in 1..65535, got {port!r}")
        address = endpoint(host, port)
        message = ReleaseLease(lease_id, self.engine_id, reason[:MAX_RELEASE_REASON_CHARS])
        request = encode_message(message, compat=self.compat, hmac_key=self._key)
        why_not = _connect_error(host, port, min(timeout, PROBE_TIMEOUT_S))
        if why_not is not None and "timed out" not in why_not:
            raise PeerUnreachable(f"cannot connect to {address}: {why_not}", peer=address,
                                  expected="a listening side channel", found=why_not)
        frames = self._exchange(host, address, request, timeout)
        if frames is None:
            raise HandshakeTimeout(f"no answer from {address} to the release of lease "
                                   f"{lease_id!r} within {timeout:g} s", peer=address,
                                   expected=f"an answer within {timeout:g} s",
                                   found="no answer")
        return self._parse_ack(frames, address, lease_id, ReleaseAck, "release").found

    def renew(self, host: str, port: int, lease_id: str, *,
              timeout: float = RELEASE_TIMEOUT_S, claim: bool = False) -> RenewAck:
        """Ask the prefill at ``host:port`` to keep lease ``lease_id`` for another TTL
        (with ``claim``: to claim it for this engine first, see :class:`RenewLease`).

        One attempt of at most ``timeout`` seconds; the ack says whether the lease was
        still held (and claimed by this engine) and for how long it now lasts. Raises
        a :class:`HandshakeError` naming the peer address on any failure; without an
        answer within :data:`PROBE_AFTER_S`, a refused TCP connect is reported at once
        (:class:`PeerUnreachable`), so a dead prefill costs no full timeout.
        """
        if self._closed:
            raise RuntimeError("HandshakeClient is closed")
        address = endpoint(host, port)
        request = encode_message(RenewLease(lease_id, self.engine_id, claim),
                                 compat=self.compat, hmac_key=self._key)
        frames = self._exchange(host, address, request, timeout, probe_port=port)
        if frames is None:
            raise HandshakeTimeout(f"no answer from {address} to the renewal of lease "
                                   f"{lease_id!r} within {timeout:g} s", peer=address)
        return self._parse_ack(frames, address, lease_id, RenewAck, "renewal")

    def close(self) -> None:
        """Release the ZMQ context (idempotent)."""
        if not self._closed:
            self._closed = True
            self._ctx.term()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _exchange(self, host: str, address: str, request: bytes, timeout: float, *,
                  probe_port: int | None = None) -> list[bytes] | None:
        """One attempt on a fresh DEALER: the reply frames, or None after ``timeout``.

        With ``probe_port``, no answer within :data:`PROBE_AFTER_S` is explained by a TCP
        connect, and one that is refused raises :class:`PeerUnreachable` (free when the
        peer answers, unlike a probe before every request)."""
        sock = _new_socket(self._ctx, zmq.DEALER, host, MAX_RESPONSE_BYTES)
        try:
            try:
                sock.connect(address)
                sock.send(request, zmq.NOBLOCK)  # queued until the connection is up
            except zmq.ZMQError as exc:
                raise HandshakeError(f"cannot send a handshake request to {address}: {exc}",
                                     peer=address) from exc
            wait_ms = max(1, round(timeout * 1000))
            if probe_port is not None and wait_ms > PROBE_AFTER_S * 1000:
                early = round(PROBE_AFTER_S * 1000)
                if sock.poll(early, zmq.POLLIN):
                    return sock.recv_multipart()
                wait_ms -= early
                why_not = _connect_error(host, probe_port, PROBE_TIMEOUT_S)
                if why_not is not None and "timed out" not in why_not:
                    raise PeerUnreachable(f"cannot connect to {address}: {why_not}",
                                          peer=address, expected="a listening side channel",
                                          found=why_not)
            if not sock.poll(wait_ms, zmq.POLLIN):
                return None
            return sock.recv_multipart()
        finally:
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

    def _parse_ack(self, frames: list[bytes], address: str, lease_id: str,
                   kind: type[_Ack], what: str) -> _Ack:
        """The ``kind`` ack of lease ``lease_id`` in a reply; a refusal or anything else
        raises, naming ``what`` ("release", "renewal") and the peer."""
        if len(frames) != 1:
            raise MalformedMessage("reply", f"{len(frames)} frames, expected 1", peer=address,
                                   expected=1, found=len(frames))
        envelope = decode_envelope(frames[0], expected_hash=None, peer=address,
                                   hmac_key=self._key, replay=self._replay)
        if envelope.kind is MessageKind.ERROR_REPLY:
            raise PeerRefused(decode_payload(envelope, ErrorReply, peer=address), peer=address,
                              what=f"the {what} of lease {lease_id!r}")
        ack = decode_payload(envelope, kind, peer=address)
        if ack.lease_id != lease_id:
            raise MalformedMessage(f"{what} ack", f"it acknowledges lease {ack.lease_id!r}, "
                                                  f"not {lease_id!r}", peer=address,
                                   expected=lease_id, found=ack.lease_id)
        return ack


def _connect_error(host: str, port: int, timeout: float) -> str | None:
    """Why a plain TCP connect to host:port fails (refused, unknown host...), or None if it
    succeeds. Used once before a handshake and again to explain a timeout; a ZMQ monitor
    on every attempt would say the same but costs ~0.2 ms per fetch."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


@dataclass(frozen=True)
class _Renewal:
    """A queued renewal (or claim) and whom to tell how it went."""

    done: Callable[[RenewAck | None, float, str], None]
    claim: bool


class ReleaseSender:
    """Decode side: sends releases (:meth:`HandshakeClient.release`) from one daemon thread.

    :meth:`submit` only queues (thread-safe, never blocks), so the engine-loop
    thread and HTTP handlers can call it. Releases are best effort: at most
    ``max_queued`` wait (further ones are dropped), each gets one attempt of
    ``timeout`` seconds, and failures are only logged; a lost release means the
    prefill frees the blocks at lease expiry instead. :meth:`close` keeps
    sending what is queued for at most ``drain_s`` seconds, then drops the rest
    and stops the thread. ``sent``, ``dropped`` and ``failed`` count outcomes
    (``sent``: the prefill answered, whether or not it held the lease). The
    sender owns ``client`` and closes it in :meth:`close`.
    """

    _STOP = object()

    def __init__(self, client: HandshakeClient, *, timeout: float = RELEASE_TIMEOUT_S,
                 max_queued: int = RELEASE_QUEUE, drain_s: float = RELEASE_DRAIN_S) -> None:
        self._client, self._timeout, self._drain_s = client, timeout, drain_s
        self._queue: queue.Queue[object] = queue.Queue(max_queued)
        self._give_up_at: float | None = None  # set by close(): drop what is still queued then
        self._closed = False
        self.sent = self.dropped = self.failed = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvxfer-release-{client.engine_id}")
        self._thread.start()

    def submit(self, host: str, port: int, lease_id: str, reason: str) -> bool:
        """Queue one release; False (logged) when closed or the queue is full."""
        if self._closed:
            log.info("release of lease %s at %s not sent: the sender is closed", lease_id,
                     endpoint(host, port))
            return False
        try:
            self._queue.put_nowait((host, port, lease_id, reason))
        except queue.Full:
            self.dropped += 1
            log.warning("release of lease %s at %s dropped: %d releases already wait; the "
                        "prefill frees it at lease expiry", lease_id, endpoint(host, port),
                        self._queue.maxsize)
            return False
        return True

    def submit_renew(self, host: str, port: int, lease_id: str,
                     done: Callable[[RenewAck | None, float, str], None], *,
                     claim: bool = False) -> bool:
        """Queue one renewal or claim (:meth:`HandshakeClient.renew`); ``done(ack,
        sent_at, why)`` is called on the sender's thread with the ack (None on failure),
        the monotonic time it was sent and, unless renewed, why not. False (and no call)
        when closed or the queue is full."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait((host, port, lease_id, _Renewal(done, claim)))
        except queue.Full:
            self.dropped += 1
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
            log.error("release sender of %s did not stop", self._client.engine_id)
            return
        self._client.close()

    def _run(self) -> None:
        while True:
            try:  # the timeout only matters when close() found the queue full
                item = self._queue.get(timeout=POLL_INTERVAL_S if self._closed else None)
            except queue.Empty:
                return
            if item is self._STOP:
                return
            assert isinstance(item, tuple)
            host, port, lease_id, reason = item
            if self._give_up_at is not None and time.monotonic() > self._give_up_at:
                self.dropped += 1
                log.info("release of lease %s at %s dropped: shutting down", lease_id,
                         endpoint(host, port))
                continue
            if isinstance(reason, _Renewal):
                self._send_renew(host, port, lease_id, reason)
            else:
                self._send(host, port, lease_id, reason)

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

    def _send(self, host: str, port: int, lease_id: str, reason: str) -> None:
        try:
            found = self._client.release(host, port, lease_id, reason, timeout=self._timeout)
        except (HandshakeError, ValueError, RuntimeError) as exc:
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
