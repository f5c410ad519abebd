"""The sidecar's KV event stream: what its prefix cache stores and evicts, published over ZMQ
in vLLM's KV event format (:mod:`kvxfer.net.kv_events`), so that one subscriber reads kvxfer
sidecars and vLLM instances alike.

:class:`KVEventPublisher` owns a PUB socket (the stream) and a ROUTER socket (replay), both
served by one thread, since ZMQ sockets are not thread-safe. The engine loop hands it each
iteration's events without waiting; the thread numbers the batches 0, 1, 2..., signs them
with the KV key when there is one, keeps the last :data:`REPLAY_BUFFER` for replay, and sends
an empty batch after :data:`HEARTBEAT_S` of silence, so that a subscriber can tell a live
stream from a silent one. Batch 0 is :class:`AllBlocksCleared`: a stream starts from an
empty cache, also when a restarted instance starts it again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from kvxfer.net.hosts import endpoint
from kvxfer.net.kv_events import (
    END_SEQUENCE,
    AllBlocksCleared,
    KVEvent,
    KVEventBatch,
    encode_batch,
    event_mac,
    sequence_bytes,
    sequence_of,
)
from kvxfer.transfer.side_channel.sockets import ServingThread, new_socket

log = logging.getLogger(__name__)

TOPIC = b""              # vLLM's default topic: a subscription to b"" gets every message
REPLAY_BUFFER = 10_000   # messages kept for replay (vLLM's buffer_steps)
HEARTBEAT_S = 1.0        # an empty batch goes out after this long without a message
MAX_INBOUND_BYTES = 1024  # a replay request is 8 bytes, a subscription a short topic
REPLAYS_PER_WAKE = 16    # so that a flood of replay requests never stalls the stream
ERROR_PAUSE_S = 0.1      # after an unexpected error, so that it cannot spin



class KVEventPublisher(ServingThread):
    """A PUB socket on ``host:port`` (0: a free port) and a ROUTER replay socket on a free
    port of ``host``, bound in the constructor; served by a daemon thread from
    :meth:`start` until :meth:`close`. With ``key``, every message, published or replayed,
    carries :func:`~kvxfer.net.kv_events.event_mac` as a fourth frame.

    Build it before the cache holds anything: its first batch says the cache is empty.
    :meth:`publish` may be called from any thread and never blocks.
    """

    def __init__(self, host: str, port: int = 0, key: bytes | None = None) -> None:
        self.host, self.key = host, key
        super().__init__()
        self._pub = new_socket(self._ctx, zmq.PUB, host, MAX_INBOUND_BYTES)
        self._replay = new_socket(self._ctx, zmq.ROUTER, host, MAX_INBOUND_BYTES)
        for sock in (self._pub, self._replay):  # a whole buffer fits a subscriber's queue
            sock.setsockopt(zmq.SNDHWM, REPLAY_BUFFER + 1)
        try:
            self.port = _bind(self._pub, host, port)
            self.replay_port = _bind(self._replay, host, 0)
        except zmq.ZMQError as exc:
            self._close_unbound()
            raise OSError(f"KV events cannot bind {endpoint(host, port)}: {exc}") from exc
        self._batches: queue.SimpleQueue[tuple[float, list[KVEvent]]] = queue.SimpleQueue()
        self._sent: deque[tuple[int, list[bytes]]] = deque(maxlen=REPLAY_BUFFER)
        self._sequence = itertools.count()
        self._last_sent = time.monotonic()
        self.publish([AllBlocksCleared()])

    def discovery(self, host: str, block_size: int) -> dict[str, Any]:
        """What ``/health`` says of the stream: its endpoints at ``host`` (the address
        subscribers dial), the block size of its events, whether they are signed."""
        return {"endpoint": endpoint(host, self.port),
                "replay_endpoint": endpoint(host, self.replay_port),
                "block_size": block_size, "signed": self.key is not None}

    def start(self) -> None:
        """Start serving on a daemon thread (idempotent)."""
        self._start_thread(f"kvxfer-kv-events-{self.port}", self._what)

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue ``events`` as one batch (nothing for none)."""
        if events:
            self._batches.put((time.time(), list(events)))
            self._wakeup.set()

    def close(self) -> None:
        """Stop serving at once and close both sockets (idempotent)."""
        self._close(self._what)

    @property
    def _what(self) -> str:
        return f"the KV event publisher at {endpoint(self.host, self.port)}"

    def _sockets(self) -> list[zmq.Socket[bytes]]:
        return [self._pub, self._replay]

    # -- the serving thread -------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        poller.register(self._wakeup.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                due = self._last_sent + HEARTBEAT_S - time.monotonic()
                ready = dict(poller.poll(max(0, math.ceil(due * 1000))))
                self._wakeup.clear()
                try:
                    self._send_queued()
                    if self._replay in ready:
                        self._serve_replays()
                    if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                        self._send(time.time(), [])
                except Exception:  # nothing a subscriber sends may stop the stream
                    log.exception("KV event publisher on port %d: unexpected error", self.port)
                    self._stop.wait(ERROR_PAUSE_S)
        finally:
            for sock in self._sockets():
                sock.close(linger=0)

    def _send_queued(self) -> None:
        while True:
            try:
                ts, events = self._batches.get_nowait()
            except queue.Empty:
                return
            self._send(ts, events)

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        """Publish one batch under the next sequence number and keep it for replay."""
        sequence = next(self._sequence)
        frames = [TOPIC, sequence_bytes(sequence),
                  encode_batch(KVEventBatch(ts=ts, events=events))]
        if self.key is not None:
            frames.append(event_mac(self.key, frames[0], frames[1], frames[2]))
        self._pub.send_multipart(frames)  # a PUB socket drops, never blocks, at its HWM
        self._sent.append((sequence, frames))
        self._last_sent = time.monotonic()

    def _serve_replays(self) -> None:
        for _ in range(REPLAYS_PER_WAKE):
            try:
                request = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._answer(request)

    def _answer(self, request: list[bytes]) -> None:
        """Answer a replay request ``[client id, b"", start]`` (vLLM's form: a DEALER sends
        ``b"", start``): every buffered message from sequence ``start`` on, then the end
        marker. Any other request gets the end marker alone."""
        client, start = request[0], None
        if len(request) == 3 and not request[1]:
            with contextlib.suppress(ValueError):  # not 8 bytes
                start = sequence_of(request[2])
        if start is None:
            log.debug("KV event publisher: a replay request of %d frames names no sequence",
                      len(request))
        else:
            first = self._sent[0][0] if self._sent else 0
            for _, frames in itertools.islice(self._sent, max(0, start - first), None):
                self._replay.send_multipart([client, b"", *frames], zmq.NOBLOCK)
        self._replay.send_multipart([client, b"", b"", END_SEQUENCE, b""], zmq.NOBLOCK)


def _bind(sock: zmq.Socket[bytes], host: str, port: int) -> int:
    """Bind ``sock`` to ``host:port`` (0: a free port); the port it got."""
    sock.bind(endpoint(host, 0).rsplit(":", 1)[0] + ":*" if port == 0 else endpoint(host, port))
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(bound, bytes)
    return int(bound.decode().rsplit(":", 1)[1])
