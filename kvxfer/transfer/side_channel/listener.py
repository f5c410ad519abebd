"""Prefill side of the side channel: :class:`SideChannelListener` serves every local TP
rank's metadata, hands releases, renewals and "done" reports of its leases to its owner,
and answers heartbeats."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import TracebackType

import zmq

from kvxfer.net.hosts import endpoint
from kvxfer.transfer.faults import LOSS
from kvxfer.transfer.side_channel.sockets import (
    MAX_REQUEST_BYTES,
    ServingThread,
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
    RenewRefused,
)
from kvxfer.wire.metadata import AgentMetadata
from kvxfer.wire.protocol_errors import (
    AUTH_FAILED,
    BadSignature,
    ErrorCode,
    HashMismatch,
    MalformedMessage,
    ProtocolError,
)
from kvxfer.wire.replay import ReplayGuard

log = logging.getLogger(__name__)

MAX_BATCH = 64                # requests served per wake-up, so close() stays prompt under load


class SideChannelListener(ServingThread):
    """Prefill side: serves every local TP rank's metadata on one ROUTER socket.

    The socket is bound in the constructor (``port=0`` picks a free port; see
    :attr:`port`), and served by a daemon thread from :meth:`start` until
    :meth:`close`. ``metadata()`` is called for each request, on the serving
    thread, and returns this instance's ranks; ``on_request(requester_engine_id)``
    is called on that thread after each successful answer.
    ``on_release(lease_id, requester_engine_id, reason, outcome)`` is called on that
    thread for each :class:`ReleaseLease` and returns whether the lease is held
    (the :class:`ReleaseAck` says so); it must only hand the release over to the
    thread that owns the leases. Without it releases are refused as
    ``unavailable``. ``on_renew(lease_id, requester_engine_id, claim)`` claims
    (``claim``) or extends a held lease and returns the seconds it now has left, or
    raises :class:`RenewRefused` saying why not; the :class:`RenewAck` says which.
    ``on_claimer(requester_engine_id, (host, port))`` is called after a claim granted
    to a requester that named its own side channel (a prefill claiming a reservation).
    ``on_done(report, requester_engine_id)`` counts a reader's :class:`DoneReport` and
    returns whether the lease was held (a :class:`ReleaseAck` says so), or raises
    ValueError for a rank this instance does not serve (``unknown_rank``).
    A :class:`Heartbeat` is answered at once with its :class:`HeartbeatAck` (a decode
    reading from this instance asks so whether it is still there).
    All must not block for long: requests are served one at a time.

    With ``hmac_key`` every request must be signed with it and fresh (timestamp
    and nonce, see :class:`~kvxfer.wire.replay.ReplayGuard`); an unauthenticated peer
    is answered only "authentication failed", without this side's CompatInfo, so
    it gets neither metadata (the NIXL agent blob) nor a release nor a renewal,
    and learns nothing about the model.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, engine_id: str,
                 compat: CompatInfo, metadata: Callable[[], Sequence[AgentMetadata]],
                 hmac_key: bytes | None = None,
                 on_request: Callable[[str], None] | None = None,
                 on_release: Callable[[str, str, str, ReleaseOutcome], bool] | None = None,
                 on_renew: Callable[[str, str, bool], float] | None = None,
                 on_done: Callable[[DoneReport, str], bool] | None = None,
                 on_claimer: Callable[[str, tuple[str, int]], None] | None = None
                 ) -> None:
        self.engine_id = engine_id
        self.host = host
        self._compat, self._hash = compat, compat_hash(compat)
        self._metadata, self._on_request = metadata, on_request
        self._on_release, self._on_renew, self._on_done = on_release, on_renew, on_done
        self._on_claimer = on_claimer
        self._key = hmac_key
        self._replay = ReplayGuard()
        super().__init__()
        self._sock = new_socket(self._ctx, zmq.ROUTER, host, MAX_REQUEST_BYTES)
        try:
            if port == 0:
                self._sock.bind(endpoint(host, 0).rsplit(":", 1)[0] + ":*")
            else:
                self._sock.bind(endpoint(host, port))
        except zmq.ZMQError as exc:
            self._close_unbound()
            raise OSError(f"handshake listener cannot bind {endpoint(host, port)}: {exc}") \
                from exc
        bound = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(bound, bytes)
        self._port = int(bound.decode().rsplit(":", 1)[1])

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return endpoint(self.host, self._port)

    def start(self) -> SideChannelListener:
        """Start serving on a daemon thread (idempotent)."""
        first = self._thread is None
        self._start_thread(f"kvxfer-handshake-{self._port}",
                           f"handshake listener at {self.address}")
        if first:
            log.info("handshake listener for engine %s serving at %s", self.engine_id,
                     self.address)
        return self

    def close(self) -> None:
        """Stop serving at once and close the socket (idempotent)."""
        self._close(f"handshake listener at {self.address}")

    def _sockets(self) -> list[zmq.Socket[bytes]]:
        return [self._sock]

    def __enter__(self) -> SideChannelListener:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the serving thread -------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if self._sock not in dict(poller.poll()):
                    continue  # woken: stopping
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
        anonymous = False
        try:
            if len(body) != 1:
                raise MalformedMessage("request", f"{len(body)} frames after the identity, "
                                                  f"expected 1", peer=peer,
                                       expected=1, found=len(body))
            answer = self._answer(body[0], peer)
            if answer is None:  # lost on purpose (kvxfer.transfer.faults): no reply
                return
            reply, requester = answer
        except ProtocolError as exc:
            log.warning("handshake listener at %s: %s", self.address, exc)
            reply = ErrorReply(exc.code, AUTH_FAILED if isinstance(exc, BadSignature)
                               else str(exc))
            # An unauthenticated peer is not told which model this instance serves, not
            # even its hash; with a key, only a signed request that failed the hash check
            # is authenticated.
            anonymous = (isinstance(exc, BadSignature)
                         or (self._key is not None and not isinstance(exc, HashMismatch)))
        try:
            raw = encode_message(reply, compat=self._compat, hmac_key=self._key,
                                 anonymous=anonymous)
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
                ) -> tuple[MetadataResponse | ReleaseAck | RenewAck | HeartbeatAck
                           | ErrorReply, str | None] | None:
        """The reply to one envelope, and the requester's engine id when a metadata
        request succeeded (None otherwise: no ``on_request`` call); None for a message
        this process loses on purpose (:data:`kvxfer.transfer.faults.LOSS`)."""
        envelope = decode_envelope(raw, expected_hash=self._hash, peer=peer,
                                   hmac_key=self._key, local_compat=self._compat,
                                   replay=self._replay)
        if LOSS.drop(envelope.kind.value):
            log.debug("handshake listener at %s: lost a %s from %s on purpose",
                      self.address, envelope.kind.value, peer)
            return None
        if envelope.kind is MessageKind.RELEASE:
            return self._release(decode_payload(envelope, ReleaseLease, peer=peer), peer), None
        if envelope.kind is MessageKind.RENEW:
            return self._renew(decode_payload(envelope, RenewLease, peer=peer), peer), None
        if envelope.kind is MessageKind.DONE:
            return self._done(decode_payload(envelope, DoneReport, peer=peer), peer), None
        if envelope.kind is MessageKind.HEARTBEAT:
            return HeartbeatAck(decode_payload(envelope, Heartbeat, peer=peer).seq,
                                self.engine_id), None
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
                                     release.reason, release.outcome)
        except Exception as exc:
            log.exception("handshake listener at %s: on_release(%r) failed", self.address,
                          release.lease_id)
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} could not "
                                                     f"release lease {release.lease_id!r}: "
                                                     f"{exc}")
        return ReleaseAck(release.lease_id, bool(found))

    def _done(self, report: DoneReport, peer: str) -> ReleaseAck | ErrorReply:
        """Hand a reader's "done" to ``on_done``; the ack says whether the lease was held."""
        lease_id, reader = report.done.request_id, report.done.reader_engine_id
        if self._on_done is None:
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} holds no leases")
        try:
            found = self._on_done(report, reader)
        except ValueError as exc:
            log.warning("handshake listener at %s: refused a done for lease %s from %s "
                        "(engine %s): %s", self.address, lease_id, peer, reader, exc)
            return ErrorReply(ErrorCode.UNKNOWN_RANK, str(exc))
        except Exception as exc:
            log.exception("handshake listener at %s: on_done(%r) failed", self.address,
                          lease_id)
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} could not "
                                                     f"count the done of lease {lease_id!r}: "
                                                     f"{exc}")
        return ReleaseAck(lease_id, bool(found))

    def _renew(self, renew: RenewLease, peer: str) -> RenewAck | ErrorReply:
        """Hand a renewal to ``on_renew``; the ack says whether and for how long."""
        if self._on_renew is None:
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} holds no leases")
        try:
            ttl = self._on_renew(renew.lease_id, renew.requester_engine_id, renew.claim)
        except RenewRefused as refused:
            log.info("handshake listener at %s: refused to %s (engine %s) %s lease %s: %s",
                     self.address, peer, renew.requester_engine_id,
                     "the claim of" if renew.claim else "the renewal of", renew.lease_id, refused)
            return RenewAck(renew.lease_id, False, 0.0, str(refused)[:MAX_RELEASE_REASON_CHARS])
        except Exception as exc:
            log.exception("handshake listener at %s: on_renew(%r) failed", self.address,
                          renew.lease_id)
            return ErrorReply(ErrorCode.UNAVAILABLE, f"engine {self.engine_id} could not "
                                                     f"renew lease {renew.lease_id!r}: {exc}")
        if renew.claim and renew.claimer_port and self._on_claimer is not None:
            self._on_claimer(renew.requester_engine_id, (renew.claimer_host, renew.claimer_port))
        return RenewAck(renew.lease_id, True, float(ttl))


def _describe(identity: zmq.Frame) -> str:
    """``<ip> [id <hex identity>]`` for logs and error messages."""
    try:
        address = identity.get("Peer-Address")
    except zmq.ZMQError:
        address = "unknown address"
    return f"{address} [id {identity.bytes.hex()}]"
