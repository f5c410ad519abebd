"""The proxy's reading of KV event streams (proxy.event_streams) against a sidecar's real
publisher (kvxfer.sidecar.kv_event_publisher) over real ZMQ sockets on 127.0.0.1, in one
process: what it believes, and what it refuses.

Faults: unsigned and forged messages with a key set, garbage, a subscriber that joins late
(caught up from the replay socket), a gap the replay cannot fill, a publisher that restarts
on the same port, and one that goes silent."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
import zmq

from kvxfer.net.kv_events import BlockStored, event_mac
from kvxfer.sidecar.kv_event_publisher import KVEventPublisher
from proxy.event_streams import KVEvents

pytestmark = pytest.mark.heavy  # waits on the streams' one-second heartbeats

URL = "http://127.0.0.1:1"  # the instance, as the proxy names it; never called here
SIZE = 4
KEY = secrets.token_bytes(32)
WAIT_S = 10.0


def stored(names: Sequence[int], tokens: Sequence[int], parent: int | None = None
           ) -> BlockStored:
    return BlockStored(list(names), parent, list(tokens), SIZE)


def health(publisher: KVEventPublisher, engine_id: str = "e1", **changes: Any
           ) -> dict[str, Any]:
    info = {**publisher.discovery("127.0.0.1", SIZE), **changes}
    return {"engine_id": engine_id, "kv_events": info}


class Reading:
    """A KVEvents as the proxy has it, and what it counted."""

    def __init__(self, key: bytes | None, stale_after: float = 3.0) -> None:
        self.counts: Counter[str] = Counter()
        self.kv = KVEvents(key, lambda url, outcome: self.counts.update([outcome]),
                           stale_after=stale_after)

    def cached(self, tokens: Sequence[int]) -> int | None:
        return self.kv.cached_tokens(URL, tokens, {})


async def until(what: str, check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


@pytest.fixture
def publishers() -> Any:
    made: list[KVEventPublisher] = []

    def make(key: bytes | None = KEY, port: int = 0) -> KVEventPublisher:
        publisher = KVEventPublisher("127.0.0.1", port, key)
        publisher.start()
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


def test_a_signed_stream_is_read_into_the_index(publishers: Any) -> None:
    async def test() -> None:
        publisher, reading = publishers(), Reading(KEY)
        reading.kv.observe(URL, True, health(publisher))
        tokens = list(range(12))
        await until("the index to hold the blocks", lambda: reading.counts["applied"] > 0)
        publisher.publish([stored([1, 2], tokens[:8]), stored([3], tokens[8:], parent=2)])
        await until("three blocks", lambda: reading.cached(tokens) == 12)
        assert reading.cached([0, 1, 2, 3, 9, 9, 9, 9]) == 4
        await reading.kv.close()
    run(test)


@pytest.mark.parametrize(("publisher_key", "outcome"), [(None, "unsigned"),
                                                         (b"x" * 32, "bad_mac")])
def test_unsigned_or_forged_events_are_refused_with_a_key_set(
        publishers: Any, publisher_key: bytes | None, outcome: str) -> None:
    async def test() -> None:
        publisher, reading = publishers(publisher_key), Reading(KEY)
        reading.kv.observe(URL, True, health(publisher, signed=True))
        publisher.publish([stored([1], range(4))])
        await until(f"{outcome} messages counted", lambda: reading.counts[outcome] >= 2)
        assert reading.counts["applied"] == 0
        assert reading.cached(range(4)) is None  # never heard: not believed
        await reading.kv.close()
    run(test)


def test_an_unsigned_stream_is_not_read_by_a_keyed_proxy_nor_a_signed_one_without_key(
        publishers: Any) -> None:
    async def test() -> None:
        for key, announced in ((KEY, False), (None, True)):
            publisher, reading = publishers(), Reading(key)
            reading.kv.observe(URL, True, health(publisher, signed=announced))
            assert reading.kv.state(URL) is None
            await reading.kv.close()
    run(test)


def test_garbage_on_the_stream_is_counted_and_changes_nothing() -> None:
    async def test() -> None:
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        reading = Reading(None)
        reading.kv.observe(URL, True, {"kv_events": {"endpoint": f"tcp://127.0.0.1:{port}",
                                                     "block_size": SIZE, "signed": False}})
        try:
            await until("garbage counted", lambda: _send_garbage(pub) and
                        reading.counts["malformed"] >= 3)
            assert reading.counts["applied"] == 0 and reading.cached(range(4)) is None
        finally:
            await reading.kv.close()
            pub.close()
            context.term()
    run(test)


def _send_garbage(pub: zmq.Socket[bytes]) -> bool:
    pub.send_multipart([b"", b"\x00" * 8, b"\xc1 not msgpack"])
    pub.send_multipart([b"", b"short", b""])
    pub.send_multipart([b"only one frame"])
    return True


def test_a_subscriber_that_joins_late_catches_up_from_the_replay_socket(
        publishers: Any) -> None:
    async def test() -> None:
        publisher = publishers()
        tokens = list(range(8))
        publisher.publish([stored([1, 2], tokens)])
        await until("both batches sent before anybody listens",
                    lambda: len(publisher._sent) == 2)
        reading = Reading(KEY)
        reading.kv.observe(URL, True, health(publisher))
        await until("the early blocks replayed", lambda: reading.cached(tokens) == 8)
        assert reading.counts["gap_replayed"] == 1
        await reading.kv.close()
    run(test)


def test_a_gap_without_a_replay_socket_empties_the_index_then_it_fills_again(
        publishers: Any) -> None:
    async def test() -> None:
        publisher = publishers()
        publisher.publish([stored([1], range(4))])
        await until("both batches sent before anybody listens",
                    lambda: len(publisher._sent) == 2)
        reading = Reading(KEY)
        reading.kv.observe(URL, True, health(publisher, replay_endpoint=None))
        await until("the gap noticed", lambda: reading.counts["gap_unfilled"] == 1)
        assert reading.cached(range(4)) == 0  # what came before the gap is not believed
        publisher.publish([stored([5], range(10, 14))])
        await until("later blocks read", lambda: reading.cached(range(10, 14)) == 4)
        await reading.kv.close()
    run(test)


def test_a_publisher_restarted_on_the_same_port_starts_from_an_empty_index(
        publishers: Any) -> None:
    async def test() -> None:
        first = publishers()
        reading = Reading(KEY)
        reading.kv.observe(URL, True, health(first))
        first.publish([stored([1], range(4))])
        await until("the first stream's block", lambda: reading.cached(range(4)) == 4)
        port = first.port
        first.close()
        second = publishers(port=port)
        second.publish([stored([9], range(20, 24))])
        # before /health tells of it, the sequence starting over does
        await until("the old stream's block dropped", lambda: reading.cached(range(4)) == 0)
        reading.kv.observe(URL, True, health(second, engine_id="e2"))
        await until("the second stream's block", lambda: reading.cached(range(20, 24)) == 4)
        assert reading.cached(range(4)) == 0, "a block of the old stream is still believed"
        await reading.kv.close()
    run(test)


def test_a_silent_stream_is_not_believed_after_the_bound_nor_an_unhealthy_instance(
        publishers: Any) -> None:
    async def test() -> None:
        publisher = publishers()
        reading = Reading(KEY, stale_after=1.5)
        reading.kv.observe(URL, True, health(publisher))
        publisher.publish([stored([1], range(4))])
        await until("believed", lambda: reading.cached(range(4)) == 4)
        await asyncio.sleep(2.0)  # heartbeats every second keep it believed
        assert reading.cached(range(4)) == 4
        publisher.close()
        await until("not believed", lambda: reading.cached(range(4)) is None, timeout=3.0)
        reading.kv.observe(URL, False, None)  # its health check failed: dropped at once
        assert reading.kv.state(URL) is None
        await reading.kv.close()
    run(test)


def test_the_mac_covers_every_frame() -> None:
    mac = event_mac(KEY, b"", b"\x00" * 8, b"payload")
    for frames in ([b"x", b"\x00" * 8, b"payload"], [b"", b"\x00" * 7 + b"\x01", b"payload"],
                   [b"", b"\x00" * 8, b"payloaD"]):
        assert event_mac(KEY, *frames) != mac
