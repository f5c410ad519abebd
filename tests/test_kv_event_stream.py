"""A sidecar's KV event stream, end to end: one real ``kvxfer serve`` (kvxfer-tiny, prefix
caching on, a small cache, a KV key) publishing on ``--kv-events-port 0``, read by this test
through real ZMQ SUB and DEALER sockets at the endpoints its /health names.

A completion stores its prompt's full blocks (their tokens, the byte tokenizer's); filling
the cache evicts idle blocks by the names they were stored under; sequences run 0, 1, 2...
without a gap and a replay gives the same messages; every message is signed; an idle stream
sends heartbeats; garbage on the replay socket changes none of that.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from sidecars import Sidecar, SidecarGroup, Spec

from kvxfer.net.kv_events import (
    END_SEQUENCE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    sequence_bytes,
    sequence_of,
    verify_mac,
)

pytestmark = pytest.mark.heavy  # a real sidecar and its stream's heartbeats

BLOCK = 16
NUM_BLOCKS = 12  # room for three of the prompts below (four blocks each): a fourth evicts
BOS = 256  # kvxfer-tiny's byte tokenizer: BOS, then the prompt's UTF-8 bytes
WAIT_S = 10.0  # longest wait for one expected message (polls end at the message)
BODY: dict[str, Any] = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}
PANGRAM = "the quick brown fox jumps over the lazy dog"
Event = BlockStored | BlockRemoved


class Message:
    """One message of the stream: its frames, its sequence, its batch."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.sequence = sequence_of(frames[1])
        self.batch: KVEventBatch = decode_batch(frames[2])


class Stream:
    """A SUB socket on a sidecar's KV event stream, and every message it has read."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], kv_events: dict[str, Any]) -> None:
        self.ctx, self.endpoint = ctx, kv_events["endpoint"]
        self.replay_endpoint = kv_events["replay_endpoint"]
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.endpoint)
        self.read: list[Message] = []

    def next(self, timeout: float = WAIT_S) -> Message:
        assert self.sub.poll(int(timeout * 1000)), f"no message within {timeout} s"
        message = Message(self.sub.recv_multipart())
        self.read.append(message)
        return message

    def until(self, found: Callable[[Message], bool], what: str, timeout: float = WAIT_S
              ) -> list[Message]:
        """Read until ``found(message)``; the messages read, that one last."""
        deadline, read = time.monotonic() + timeout, []
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{what}: not within {timeout} s"
            read.append(self.next(left))
            if found(read[-1]):
                return read

    def events_until(self, found: Callable[[Event], bool], what: str) -> list[Event]:
        """The events read until one for which ``found(event)``, that one last."""
        events: list[Event] = []

        def check(message: Message) -> bool:
            for event in message.batch.events:
                assert not isinstance(event, AllBlocksCleared), "the cache was cleared"
                events.append(event)
                if found(event):
                    return True
            return False

        self.until(check, what)
        return events

    def replay(self, start: int) -> list[list[bytes]]:
        """What the replay socket answers a request from ``start``: the messages' frames,
        then the end marker's."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", sequence_bytes(start)])
            return receive_replay(dealer)
        finally:
            dealer.close()


def receive_replay(dealer: zmq.Socket[bytes]) -> list[list[bytes]]:
    """A DEALER's replay answer up to and with the end marker, each without its b""."""
    answer: list[list[bytes]] = []
    while not answer or answer[-1][1:2] != [END_SEQUENCE]:
        assert dealer.poll(int(WAIT_S * 1000)), f"replay unfinished after {len(answer)}"
        frames = dealer.recv_multipart()
        assert frames[0] == b"", frames
        answer.append(frames[1:])
    assert answer[-1] == [b"", END_SEQUENCE, b""]
    return answer


def prompt(tag: str) -> str:
    """A prompt of its own from the first block on: BOS + 53 bytes, three full blocks."""
    return f"{tag:<10}{PANGRAM}"


def prompt_tokens(text: str) -> list[int]:
    return [BOS, *text.encode()]


def full_blocks(text: str) -> list[int]:
    tokens = prompt_tokens(text)
    return tokens[:len(tokens) // BLOCK * BLOCK]


def complete(sidecar: Sidecar, text: str) -> None:
    answer = sidecar.post("/v1/completions", {**BODY, "prompt": text})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(prompt_tokens(text))


def stored_as(text: str) -> Callable[[Event], bool]:
    """Whether an event stores ``text``'s full blocks."""
    return lambda e: isinstance(e, BlockStored) and e.token_ids == full_blocks(text)


def assert_no_gap(stream: Stream) -> None:
    read = [m.sequence for m in stream.read]
    assert read == list(range(read[0], read[0] + len(read))), read


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[Sidecar]:
    with SidecarGroup(tmp_path_factory.mktemp("kv-events")) as group:
        yield group.start_one(Spec("both", num_blocks=NUM_BLOCKS, block_size=BLOCK, extra=(
            "--enable-prefix-caching", "--kv-events-port", "0",
            "--kv-key-file", str(key_file))))


@pytest.fixture(scope="module")
def stream(sidecar: Sidecar) -> Iterator[Stream]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    subscribed = Stream(ctx, sidecar.health()["kv_events"])
    try:
        subscribed.next()  # a heartbeat at the latest: the subscription is in place
        yield subscribed
    finally:
        subscribed.sub.close()
        ctx.term()


def test_health_names_the_stream(sidecar: Sidecar) -> None:
    kv_events = sidecar.health()["kv_events"]
    assert kv_events.pop("endpoint").startswith("tcp://127.0.0.1:")
    assert kv_events.pop("replay_endpoint").startswith("tcp://127.0.0.1:")
    assert kv_events == {"block_size": BLOCK, "signed": True}


def test_a_completion_stores_its_prompt_s_full_blocks(sidecar: Sidecar, stream: Stream) -> None:
    text = prompt("stored")
    complete(sidecar, text)
    stored = stream.events_until(stored_as(text), "the prompt's blocks stored")[-1]
    assert isinstance(stored, BlockStored)
    assert stored.block_size == BLOCK and stored.parent_block_hash is None
    assert len(stored.block_hashes) == 3


def test_filling_the_cache_removes_blocks_by_the_names_they_were_stored_under(
        sidecar: Sidecar, stream: Stream) -> None:
    tags = ("first", "second", "third", "fourth", "fifth")  # the fifth evicts the first
    for tag in tags:
        complete(sidecar, prompt(tag))
    stream.events_until(stored_as(prompt(tags[-1])), "the last prompt stored")
    cached: dict[bytes | int, list[int]] = {}  # what a subscriber holds: name -> tokens
    removed = []
    for event in (e for m in stream.read for e in m.batch.events):
        if isinstance(event, BlockStored):
            for index, name in enumerate(event.block_hashes):
                assert name not in cached, "stored twice"
                cached[name] = event.token_ids[index * BLOCK:(index + 1) * BLOCK]
        elif isinstance(event, BlockRemoved):
            for name in event.block_hashes:
                assert name in cached, "removed but never stored"
                removed.append(cached.pop(name))
    first = full_blocks(prompt(tags[0]))
    assert all(first[i:i + BLOCK] in removed for i in range(0, len(first), BLOCK))
    assert len(cached) == sidecar.metric("kvxfer_prefix_cache_blocks") <= NUM_BLOCKS


def test_sequences_have_no_gap_and_a_replay_repeats_them(stream: Stream) -> None:
    assert_no_gap(stream)
    replayed = stream.replay(0)[:-1]
    sequences = [sequence_of(frames[1]) for frames in replayed]
    assert sequences == list(range(len(sequences)))
    assert sequences[-1] >= stream.read[-1].sequence
    for message in stream.read:
        assert replayed[message.sequence] == message.frames
    assert decode_batch(replayed[0][2]).events == [AllBlocksCleared()]
    middle = stream.read[len(stream.read) // 2].sequence
    assert stream.replay(middle)[0] == replayed[middle]


def test_every_message_is_signed_with_the_kv_key(stream: Stream, key: bytes) -> None:
    other = secrets.token_bytes(32)
    for frames in [m.frames for m in stream.read] + stream.replay(0)[:-1]:
        assert len(frames) == 4 and verify_mac(key, frames), frames[:2]
        assert not verify_mac(other, frames)
        payload = bytearray(frames[2])
        payload[len(payload) // 2] ^= 1
        assert not verify_mac(key, [frames[0], frames[1], bytes(payload), frames[3]])
        assert not verify_mac(key, frames[:3])


def test_an_idle_stream_sends_heartbeats(stream: Stream) -> None:
    stream.until(lambda m: not m.batch.events and not stream.read[-2].batch.events,
                 "two heartbeats in a row")
    assert_no_gap(stream)


def test_garbage_on_the_replay_socket_leaves_stream_and_sidecar_serving(
        sidecar: Sidecar, stream: Stream) -> None:
    dealer = stream.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(stream.replay_endpoint)
        for garbage in ([b"", b"seven!!"], [b"", b"x" * 9], [b"not a sequence"],
                        [sequence_bytes(0)], [b"", b"", sequence_bytes(0)],
                        [b"x" * 300, b"", sequence_bytes(0)]):
            dealer.send_multipart(garbage)
            assert receive_replay(dealer) == [[b"", END_SEQUENCE, b""]], garbage
        dealer.send_multipart([b"", b"z" * 100_000])  # over the size limit: dropped
    finally:
        dealer.close()
    for address in (stream.replay_endpoint, stream.endpoint):  # not even ZMQ
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + secrets.token_bytes(512))
    assert stream.replay(10**12) == [[b"", END_SEQUENCE, b""]]
    text = prompt("after")
    complete(sidecar, text)
    stream.events_until(stored_as(text), "a prompt stored after the garbage")
    stream.until(lambda m: not m.batch.events, "a heartbeat after the garbage")
    assert_no_gap(stream)
    assert sidecar.health()["status"] == "ok"
