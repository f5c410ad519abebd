"""Decode side: :class:`Heartbeats` asks every prefill side channel that READs are in flight
from whether it still answers, so that a cut link or a frozen host fails them within a bound.

One daemon thread per decode instance, which never waits on one peer. An answer counts only
when it verifies and echoes a heartbeat still unanswered on its connection.

Design: docs/design/side-channel.md#heartbeats-the-thread
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from kvxfer.net.hosts import endpoint
from kvxfer.transfer.liveness import Channel, Liveness
from kvxfer.transfer.side_channel.sockets import IDLE_WAIT_S, JOIN_TIMEOUT_S, Wakeup, new_socket
from kvxfer.wire.compat import CompatInfo, compat_hash
from kvxfer.wire.envelope import decode_envelope, decode_payload, encode_message
from kvxfer.wire.messages import Heartbeat, HeartbeatAck
from kvxfer.wire.protocol_errors import SideChannelError
from kvxfer.wire.replay import ReplayGuard

log = logging.getLogger(__name__)

MAX_ACK_BYTES = 4096  # an ack is ~100 bytes (a signed one ~200)


class Heartbeats:
    """The decode instance's heartbeat thread for ``liveness``, sending as
    ``engine_id`` with ``compat`` (signed with ``hmac_key`` when given). Started at once;
    :meth:`close` stops it."""

    def __init__(self, liveness: Liveness, engine_id: str, compat: CompatInfo,
                 hmac_key: bytes | None = None) -> None:
        self.liveness, self.engine_id = liveness, engine_id
        self._compat, self._hash, self._key = compat, compat_hash(compat), hmac_key
        self._replay = ReplayGuard()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sockets: dict[Channel, zmq.Socket[bytes]] = {}  # the thread's alone
        self._stop = threading.Event()
        self._wakeup = Wakeup()  # a newly watched channel, or close(): poll no longer
        liveness.on_new_channel(self._wakeup.set)
        self.sent = self.answered = 0  # heartbeats sent, answers that counted
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvxfer-heartbeats-{engine_id}")
        self._thread.start()

    def close(self) -> None:
        """Stop the thread at once, close every connection (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wakeup.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # its sockets are still in use: leave the context
            log.error("the heartbeat thread of %s did not stop", self.engine_id)
            return
        self._wakeup.close()
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        woken = self._wakeup.fileno()  # a plain fd: the poller reports it as such
        poller.register(woken, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._connect(poller, now)
                for channel, seq in self.liveness.beats_due(now):
                    self._send(channel, seq)
                due = self.liveness.next_due()
                wait = IDLE_WAIT_S if due is None else min(IDLE_WAIT_S, max(0.0, due - now))
                for sock, _ in poller.poll(round(wait * 1000)):
                    if sock == woken:
                        self._wakeup.clear()
                    else:
                        self._receive(sock)
        except Exception:  # the decode reads on without heartbeats: its read timeout holds
            log.exception("the heartbeat thread of %s failed; silent prefills are noticed "
                          "at the read timeout only", self.engine_id)
        finally:
            self.liveness.stop()  # what is unanswered now never will be: it fails nothing
            for sock in self._sockets.values():
                sock.close(linger=0)
            self._sockets.clear()

    def _connect(self, poller: zmq.Poller, now: float) -> None:
        """Open a connection to every channel watched, close those forgotten."""
        for channel in self.liveness.forget_idle(now):
            sock = self._sockets.pop(channel, None)
            if sock is not None:
                poller.unregister(sock)
                sock.close(linger=0)
        for channel in self.liveness.channels():
            if channel not in self._sockets:
                host, port = channel
                sock = new_socket(self._ctx, zmq.DEALER, host, MAX_ACK_BYTES)
                sock.connect(endpoint(host, port))  # queues heartbeats until it is up
                self._sockets[channel] = sock
                poller.register(sock, zmq.POLLIN)

    def _send(self, channel: Channel, seq: int) -> None:
        sock = self._sockets.get(channel)
        if sock is None:  # forgotten meanwhile
            return
        try:
            sock.send(encode_message(Heartbeat(self.engine_id, seq), compat=self._compat,
                                     hmac_key=self._key), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:  # ZMQ's queue is full: the heartbeat stays unanswered
            log.debug("heartbeat %d to %s not queued: the connection's queue is full", seq,
                      endpoint(*channel))

    def _receive(self, sock: zmq.Socket[bytes]) -> None:
        channel = next((c for c, s in self._sockets.items() if s is sock), None)
        if channel is None:
            return
        address = endpoint(*channel)
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) != 1:
                    raise SideChannelError(f"{len(frames)} frames, expected 1", peer=address)
                envelope = decode_envelope(frames[0], expected_hash=self._hash, peer=address,
                                           hmac_key=self._key, replay=self._replay)
                ack = decode_payload(envelope, HeartbeatAck, peer=address)
            except SideChannelError as exc:  # a refusal, garbage, another key: no answer
                log.warning("the answer of %s to a heartbeat does not count: %s", address, exc)
                continue
            if self.liveness.answered(channel, ack.seq):
                self.answered += 1
            else:
                log.debug("%s acknowledged heartbeat %d, which waits for no answer", address,
                          ack.seq)
