"""The instances' KV event streams, read into one :class:`~proxy.kv_index.InstanceIndex`
each, and what the proxy may believe of them.

A kvxfer sidecar says where its stream is in ``GET /health`` (``kv_events``: endpoint,
replay endpoint, block size, whether it is signed); a vLLM instance's is given by flag
(``--kv-events URL=ENDPOINT[,REPLAY]``). The health checker hands every answer here
(:meth:`KVEvents.observe`). One asyncio task per instance reads its PUB socket. An index is
believed (:meth:`KVEvents.cached_tokens` answers) only while its instance is healthy and,
for a stream that beats (a sidecar sends an empty batch every second when idle), while a
message arrived within ``stale_after`` seconds; vLLM's streams do not beat, so theirs is
believed between health checks. A gap in sequence numbers is replayed from the instance's
replay socket; a replay that cannot fill it (the batches are gone, no answer in time)
empties the index, which then fills again from the events that follow. An instance that
restarted (a new engine id in /health, or sequence numbers starting over) or left starts
from an empty index at once. With a KV key every message must carry a valid MAC: others
are refused and counted, and change nothing.

Design: docs/design/kv-events.md#the-proxy-side
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvxfer.net.kv_events import (
    END_SEQUENCE,
    decode_batch,
    sequence_bytes,
    sequence_of,
    verify_mac,
)
from proxy.kv_index import InstanceIndex, prefix_keys

log = logging.getLogger(__name__)

STALE_AFTER_S = 3.0    # a stream silent this long is not believed (sidecars beat every 1 s)
REPLAY_TIMEOUT_S = 1.0  # a replay's answer, all of it


@dataclass(frozen=True)
class Stream:
    """Where an instance publishes its events, as its /health says."""

    endpoint: str
    replay_endpoint: str | None
    block_size: int | None  # None: learned from the first stored block
    signed: bool
    engine_id: str = ""  # a new one after a restart: the stream starts over
    beats: bool = True  # an empty batch every second when idle (kvxfer's, not vLLM's)

    @classmethod
    def from_health(cls, body: dict[str, Any]) -> Stream | None:
        """The stream a /health body announces; None when it announces none or garbage."""
        info = body.get("kv_events")
        if not isinstance(info, dict):
            return None
        endpoint, replay = info.get("endpoint"), info.get("replay_endpoint")
        size = info.get("block_size")
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or \
                not isinstance(size, int) or isinstance(size, bool) or size <= 0 or \
                (replay is not None and not isinstance(replay, str)):
            return None
        return cls(endpoint, replay, size, info.get("signed") is True,
                   str(body.get("engine_id", "")))


class Subscription:
    """One instance's stream feeding its index; :meth:`run` until cancelled."""

    def __init__(self, url: str, stream: Stream, key: bytes | None,
                 context: zmq.asyncio.Context, count: Callable[[str, str], None]) -> None:
        self.url, self.stream, self.key = url, stream, key
        self.index = InstanceIndex(stream.block_size)
        self.next_sequence: int | None = None
        self.heard = float("-inf")  # monotonic time of the last message applied
        self._context = context
        self._count = count  # (instance url, outcome) -> a metric

    def current(self, now: float, stale_after: float) -> bool:
        return not self.stream.beats or now - self.heard <= stale_after

    async def run(self) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.stream.endpoint)
        try:
            while True:  # cancelled by KVEvents.forget / close
                await self._message(await socket.recv_multipart())
        finally:
            socket.close()

    async def _message(self, frames: list[bytes]) -> None:
        checked = self._checked(frames)
        if checked is None:
            return
        sequence, batch = checked
        # the first message: batches before it are caught up from the replay socket
        expected = 0 if self.next_sequence is None else self.next_sequence
        if sequence < expected:  # it started over: a restart
            log.info("KV events of %s start over (sequence %d after %d): index emptied",
                     self.url, sequence, expected - 1)
            self.index.clear()
            expected = 0
        if sequence > expected:
            await self._fill_gap(expected, sequence)
        self._apply(sequence, batch)

    def _checked(self, frames: list[bytes]) -> tuple[int, Any] | None:
        """A message's sequence number and batch; None (counted) when it is refused."""
        if self.key is not None and not verify_mac(self.key, frames):
            self._count(self.url, "bad_mac" if len(frames) == 4 else "unsigned")
            return None
        if len(frames) not in (3, 4):
            self._count(self.url, "malformed")
            return None
        try:
            return sequence_of(frames[1]), decode_batch(frames[2])
        except (ValueError, msgspec.DecodeError):
            self._count(self.url, "malformed")
            return None

    def _apply(self, sequence: int, batch: Any) -> None:
        for event in batch.events:
            self.index.apply(event)
        self.next_sequence = sequence + 1
        self.heard = time.monotonic()
        self._count(self.url, "applied")

    async def _fill_gap(self, start: int, end: int) -> None:
        """Apply the batches ``start`` .. ``end - 1`` from the replay socket; empty the
        index when they cannot all be had."""
        replayed = await self._replay(start) if self.stream.replay_endpoint else None
        wanted = [b for b in (replayed or []) if start <= b[0] < end]
        if [s for s, _ in wanted] != list(range(start, end)):
            log.warning("KV events of %s: batches %d..%d missed and not replayed: index "
                        "emptied", self.url, start, end - 1)
            self._count(self.url, "gap_unfilled")
            self.index.clear()
            return
        self._count(self.url, "gap_replayed")
        for sequence, batch in wanted:
            self._apply(sequence, batch)

    async def _replay(self, start: int) -> list[tuple[int, Any]] | None:
        assert self.stream.replay_endpoint is not None
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.stream.replay_endpoint)
        out: list[tuple[int, Any]] = []
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        try:
            await socket.send_multipart([b"", sequence_bytes(start)])
            while (left := deadline - time.monotonic()) > 0:
                if not await socket.poll(int(left * 1000) + 1):
                    return None
                frames = (await socket.recv_multipart())[1:]  # the empty delimiter
                if len(frames) >= 2 and frames[1] == END_SEQUENCE:
                    return out
                checked = self._checked(frames)
                if checked is None:
                    return None
                out.append(checked)
            return None
        finally:
            socket.close()


class KVEvents:
    """Every instance's subscription, on the app's event loop."""

    def __init__(self, key: bytes | None, count: Callable[[str, str], None],
                 static: dict[str, Stream] | None = None,
                 stale_after: float = STALE_AFTER_S) -> None:
        self.key = key
        self.static = static or {}  # streams given by flag, by instance URL (vLLM's)
        self.stale_after = stale_after
        self._count = count
        self._context = zmq.asyncio.Context()
        self._subscriptions: dict[str, tuple[Subscription, asyncio.Task[None]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # every reading task until it ended

    def observe(self, url: str, healthy: bool, body: dict[str, Any] | None) -> None:
        """An instance's health check (``body``: its /health JSON object, if any): read
        the stream it announces or the flag gave, start over when that changed, stop when
        it is unhealthy or announces none. A signed stream cannot be read without the
        key, nor an unsigned one believed with it."""
        stream = None
        if healthy:
            stream = (None if body is None else Stream.from_health(body)) or \
                self.static.get(url)
        if stream is not None and stream.signed != (self.key is not None):
            log.warning("instance %s publishes %s KV events but the proxy %s: not read",
                        url, "signed" if stream.signed else "unsigned",
                        "has no --kv-key-file" if self.key is None else "has a KV key")
            stream = None
        held = self._subscriptions.get(url)
        if held is not None and held[0].stream == stream:
            return
        self.forget(url)
        if stream is not None:
            subscription = Subscription(url, stream, self.key, self._context, self._count)
            task = asyncio.get_running_loop().create_task(subscription.run())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self._subscriptions[url] = (subscription, task)
            log.info("reading the KV events of %s from %s", url, stream.endpoint)

    def forget(self, url: str) -> None:
        """Stop reading ``url``'s stream and drop its index (it left, or restarted)."""
        held = self._subscriptions.pop(url, None)
        if held is not None:
            held[1].cancel()

    def cached_tokens(self, url: str, prompt: Sequence[int], keys: dict[int, list[bytes]]
                      ) -> int | None:
        """Leading tokens of ``prompt`` that ``url`` holds, in whole blocks; None when its
        index is not believed (no stream, stale). ``keys`` caches the prompt's
        :func:`~proxy.kv_index.prefix_keys` by block size across instances."""
        held = self._subscriptions.get(url)
        if held is None or not held[0].current(time.monotonic(), self.stale_after):
            return None
        index = held[0].index
        size = index.block_size
        if size is None:
            return 0
        if size not in keys:
            keys[size] = prefix_keys(prompt, size)
        return index.cached_blocks(keys[size]) * size

    def blocks(self) -> dict[str, int]:
        """Blocks indexed per instance."""
        return {url: len(s.index) for url, (s, _) in self._subscriptions.items()}

    def state(self, url: str) -> dict[str, Any] | None:
        """What /health shows of ``url``'s stream and index (None: no stream read)."""
        held = self._subscriptions.get(url)
        if held is None:
            return None
        subscription = held[0]
        now = time.monotonic()
        return {"endpoint": subscription.stream.endpoint, "blocks": len(subscription.index),
                "believed": subscription.current(now, self.stale_after),
                "next_sequence": subscription.next_sequence,
                "silent_s": None if subscription.heard == float("-inf")
                else round(now - subscription.heard, 3)}

    async def close(self) -> None:
        """Stop every reading task (each closes its sockets as it ends), then ZMQ."""
        self._subscriptions.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._context.destroy(linger=0)


def static_streams(specs: Sequence[str]) -> dict[str, Stream]:
    """``--kv-events URL=ENDPOINT[,REPLAY_ENDPOINT]`` values by instance URL; ValueError
    naming the bad one."""
    out: dict[str, Stream] = {}
    for spec in specs:
        url, _, endpoints = spec.partition("=")
        parts = endpoints.split(",")
        if not url.startswith("http") or not 1 <= len(parts) <= 2 or \
                not all(part.startswith("tcp://") for part in parts):
            raise ValueError(f"--kv-events {spec!r}: give INSTANCE_URL=tcp://HOST:PORT, "
                             f"optionally followed by ,tcp://HOST:REPLAY_PORT")
        out[url.rstrip("/")] = Stream(parts[0], parts[1] if len(parts) == 2 else None, None,
                                      signed=False, beats=False)
    return out
