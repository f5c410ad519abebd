"""Tests for the side channel (``kvxfer.transfer.side_channel``) over real ZMQ sockets on 127.0.0.1.

Most listeners run in this process; one runs in a separate OS process (this
file, run as a script with ``serve``). Every bad input is followed by a good
fetch to prove the listener is still serving.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from kvxfer.plan.layout import CacheSpec, allocate_kv_cache
from kvxfer.plan.regions import plan_regions
from kvxfer.transfer.side_channel import sockets as sockets_module
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.failures import PeerRefused, PeerUnreachable, SideChannelTimeout
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.transfer.side_channel.sender import SideChannelSender
from kvxfer.transfer.side_channel.sockets import MAX_REQUEST_BYTES
from kvxfer.wire.compat import CompatInfo, compat_hash
from kvxfer.wire.envelope import ANONYMOUS_HASH, decode_envelope, decode_payload, encode_message
from kvxfer.wire.messages import (
    ErrorReply,
    MetadataRequest,
    MetadataResponse,
    ReleaseAck,
    ReleaseLease,
    RenewRefused,
)
from kvxfer.wire.metadata import AgentMetadata
from kvxfer.wire.protocol_errors import (
    BadMagic,
    BadSignature,
    ErrorCode,
    HashMismatch,
    MalformedMessage,
    SideChannelError,
    VersionMismatch,
)
from kvxfer.wire.version import KVXFER_PROTOCOL_VERSION, MAGIC

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
ENGINE = "prefill-a"
COMPAT = CompatInfo(model="llama-3-8b", dtype="bfloat16", cache_dtype="bfloat16", head_size=64,
                    total_kv_heads=4, num_layers=4)
KEY = b"shared secret"
ANSWER_S = 5.0  # hang guard for raw exchanges that must be answered


def rank_metadata(engine_id: str = ENGINE, tp_size: int = 2) -> list[AgentMetadata]:
    """A realistic ~2 KB answer per rank: a 4-layer region plan and a 1 KiB agent blob."""
    spec = CacheSpec(block_size=16, num_kv_heads=4 // tp_size, head_size=64,
                     dtype=torch.bfloat16)
    out = []
    for rank in range(tp_size):
        _, views = allocate_kv_cache(spec, 8, 4, "LBHNC")
        plan = plan_regions({f"layers.{i}": v for i, v in enumerate(views)}, spec, 8)
        out.append(AgentMetadata(engine_id=engine_id, tp_rank=rank, tp_size=tp_size,
                                 agent_name=f"{engine_id}-rank{rank}",
                                 agent_blob=bytes([rank]) * 1024, device_id=0,
                                 num_blocks=8, block_size=16, layout=plan.layout, plan=plan))
    return out


RANKS = rank_metadata()


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


@pytest.fixture(scope="module")
def requesters() -> list[str]:
    return []


@pytest.fixture(scope="module")
def listener(requesters: list[str]) -> Iterator[SideChannelListener]:
    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS,
                           on_request=requesters.append) as served:
        yield served


@pytest.fixture(scope="module")
def keyed_listener() -> Iterator[SideChannelListener]:
    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS,
                           hmac_key=KEY) as served:
        yield served


@pytest.fixture(scope="module")
def client() -> Iterator[SideChannelClient]:
    with SideChannelClient("decode-b", COMPAT) as made:
        yield made


def good_fetch(client: SideChannelClient, listener: SideChannelListener) -> None:
    """The listener still serves: a normal fetch returns exactly what it serves."""
    answer = client.fetch(HOST, listener.port, (1, 0), timeout=ANSWER_S, retries=0)
    assert answer == MetadataResponse(ENGINE, 2, (RANKS[1], RANKS[0]))


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` for up to ANSWER_S seconds (bounded)."""
    for _ in range(int(ANSWER_S / 0.01)):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what}: not seen within {ANSWER_S} s")


def exchange(ctx: zmq.Context[Any], address: str, frames: list[bytes], *,
             kind: int = zmq.DEALER, timeout: float = ANSWER_S) -> list[bytes] | None:
    """Send raw ``frames`` on a fresh socket; the reply frames, or None after ``timeout``."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000)):
            return None
        return sock.recv_multipart()
    finally:
        sock.close()


def refusal(reply: list[bytes] | None, key: bytes | None = None) -> ErrorReply:
    """Decode a listener's ErrorReply (one frame, this side's hash)."""
    assert reply is not None, "the listener did not answer"
    assert len(reply) == 1
    envelope = decode_envelope(reply[0], expected_hash=compat_hash(COMPAT), peer="listener",
                               hmac_key=key)
    return decode_payload(envelope, ErrorReply)


def request(message: Any = None, **kwargs: Any) -> bytes:
    kwargs.setdefault("compat", COMPAT)
    return encode_message(message or MetadataRequest("decode-b", (0,)), **kwargs)


def forged(**changes: Any) -> bytes:
    """A request envelope with ``changes`` to its fields, re-encoded without validation."""
    fields = msgspec.msgpack.decode(request()[len(MAGIC):])
    fields.update(changes)
    return MAGIC + msgspec.msgpack.encode(fields)


# -- the good path --------------------------------------------------------------------------

def test_fetch_returns_the_requested_ranks_in_order(client: SideChannelClient,
                                                    listener: SideChannelListener,
                                                    requesters: list[str]) -> None:
    assert listener.address == f"tcp://{HOST}:{listener.port}" and listener.port > 0
    assert client.fetch(HOST, listener.port, [1]).ranks == (RANKS[1],)
    good_fetch(client, listener)
    # on_request runs on the listener's thread just after the answer is sent
    wait_for(lambda: requesters[-2:] == ["decode-b", "decode-b"], "on_request calls")


def test_a_req_socket_is_answered_too(ctx: zmq.Context[Any],
                                      listener: SideChannelListener) -> None:
    reply = exchange(ctx, listener.address, [request()], kind=zmq.REQ)
    assert reply is not None
    envelope = decode_envelope(reply[0], expected_hash=compat_hash(COMPAT), peer="listener")
    assert decode_payload(envelope, MetadataResponse).ranks == (RANKS[0],)


def test_signed_fetch(keyed_listener: SideChannelListener) -> None:
    with SideChannelClient("decode-b", COMPAT, hmac_key=KEY) as keyed:
        answer = keyed.fetch(HOST, keyed_listener.port, [0, 1])
    assert answer.ranks == tuple(RANKS)


# -- bad inputs: each answered with an ErrorReply, and the listener keeps serving -----------

BAD_REQUESTS: dict[str, tuple[list[bytes], ErrorCode, str]] = {
    "garbage": ([b"\x17\xfe garbage \x00"], ErrorCode.BAD_MAGIC, r"b'\x17\xfe garba'"),
    "http": ([b"GET / HTTP/1.1\r\n\r\n"], ErrorCode.BAD_MAGIC, "b'GET / HT'"),
    "empty-frame": ([b""], ErrorCode.BAD_MAGIC, "sent 0 bytes"),
    "truncated": ([request()[:30]], ErrorCode.MALFORMED, "truncated"),
    "many-frames": ([request(), b"x", b"y"], ErrorCode.MALFORMED, "3 frames"),
    "wrong-version": ([forged(version=KVXFER_PROTOCOL_VERSION + 1)],
                      ErrorCode.VERSION_MISMATCH,
                      f"speaks kvxfer protocol {KVXFER_PROTOCOL_VERSION + 1}, this side "
                      f"speaks {KVXFER_PROTOCOL_VERSION}"),
    "wrong-hash": ([request(compat=msgspec.structs.replace(COMPAT, num_layers=32))],
                   ErrorCode.HASH_MISMATCH, "num_layers: peer 32, here 4"),
    "unknown-field": ([forged(route="x")], ErrorCode.MALFORMED, "route"),
    "wrong-kind": ([request(ErrorReply(ErrorCode.MALFORMED, "hi"))], ErrorCode.MALFORMED,
                   "expected a metadata_request, found a error_reply"),
    "bad-payload": ([forged(payload=b"\x93\x01\x02\x03")], ErrorCode.MALFORMED,
                    "metadata_request"),
    "unknown-rank": ([request(MetadataRequest("decode-b", (0, 5, 7)))], ErrorCode.UNKNOWN_RANK,
                     "serves ranks [0, 1], not [5, 7]"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_listener_keeps_serving(
        case: str, ctx: zmq.Context[Any], client: SideChannelClient,
        listener: SideChannelListener, caplog: pytest.LogCaptureFixture) -> None:
    frames, code, named = BAD_REQUESTS[case]
    with caplog.at_level(logging.WARNING, logger="kvxfer.transfer.side_channel.listener"):
        reply = refusal(exchange(ctx, listener.address, frames))
    assert reply.code is code
    assert named in reply.message
    assert any(named in r.getMessage() and HOST in r.getMessage() and "[id " in r.getMessage()
               for r in caplog.records), "the refusal is logged with the peer's identity"
    good_fetch(client, listener)


@pytest.mark.parametrize("case", ["unsigned", "wrong-key"])
def test_bad_signature_is_refused(case: str, ctx: zmq.Context[Any],
                                  keyed_listener: SideChannelListener) -> None:
    raw = request(hmac_key=None if case == "unsigned" else b"guess")
    answer = exchange(ctx, keyed_listener.address, [raw])
    assert answer is not None
    envelope = decode_envelope(answer[0], expected_hash=compat_hash(COMPAT), peer="listener")
    assert envelope.sender is None, "an unauthenticated peer is not told the model"
    assert envelope.compat_hash == ANONYMOUS_HASH, "nor its hash, which would confirm it"
    assert compat_hash(COMPAT).encode() not in answer[0]
    reply = refusal(answer, key=KEY)
    assert reply.code is ErrorCode.BAD_SIGNATURE
    assert reply.message == "authentication failed", "nothing else is told"
    assert RANKS[0].agent_blob not in answer[0], "no NIXL metadata without the key"
    with SideChannelClient("decode-b", COMPAT, hmac_key=KEY) as keyed:
        assert keyed.fetch(HOST, keyed_listener.port, [0]).ranks == (RANKS[0],)


def test_a_replayed_signed_request_is_refused(ctx: zmq.Context[Any],
                                              keyed_listener: SideChannelListener) -> None:
    raw = request(hmac_key=KEY)
    first = exchange(ctx, keyed_listener.address, [raw])
    assert first is not None and RANKS[0].agent_blob in first[0]
    again = exchange(ctx, keyed_listener.address, [raw])
    assert again is not None and RANKS[0].agent_blob not in again[0]
    reply = refusal(again, key=KEY)
    assert (reply.code, reply.message) == (ErrorCode.BAD_SIGNATURE, "authentication failed")
    assert compat_hash(COMPAT).encode() not in again[0], "a replayer is not told the model"


def test_oversized_message_drops_the_peer_and_listener_keeps_serving(
        ctx: zmq.Context[Any], client: SideChannelClient, listener: SideChannelListener) -> None:
    huge = MAGIC + b"\x00" * (MAX_REQUEST_BYTES + 1)
    assert exchange(ctx, listener.address, [huge], timeout=0.5) is None
    good_fetch(client, listener)


def test_unreachable_metadata_is_refused_as_unavailable(client: SideChannelClient) -> None:
    broken = {"now": True}

    def metadata() -> list[AgentMetadata]:
        if broken["now"]:
            raise RuntimeError("NIXL agent not created yet")
        return RANKS

    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=metadata) as served:
        with pytest.raises(PeerRefused) as info:
            client.fetch(HOST, served.port, [0], timeout=ANSWER_S)
        assert info.value.code is ErrorCode.UNAVAILABLE
        assert "NIXL agent not created yet" in str(info.value)
        assert served.address in str(info.value)
        broken["now"] = False
        good_fetch(client, served)


def test_inconsistent_local_metadata_is_refused(client: SideChannelClient) -> None:
    mixed = [RANKS[0], rank_metadata(engine_id="prefill-z")[1]]
    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT,
                           metadata=lambda: mixed) as served, \
            pytest.raises(PeerRefused, match="belongs to engine 'prefill-z'") as info:
        client.fetch(HOST, served.port, [0, 1], timeout=ANSWER_S)
    assert info.value.code is ErrorCode.UNAVAILABLE


def test_unencodable_local_metadata_is_refused(client: SideChannelClient,
                                               requesters: list[str]) -> None:
    """msgspec does not type-check at construction, so a numpy int can reach the encoder."""
    odd = [msgspec.structs.replace(RANKS[0], device_id=np.int64(0))]
    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: odd,
                           on_request=requesters.append) as served:
        before = len(requesters)
        with pytest.raises(PeerRefused, match=r"numpy\.int64") as info:
            client.fetch(HOST, served.port, [0], timeout=ANSWER_S)
    assert info.value.code is ErrorCode.UNAVAILABLE
    # the listener's thread has been joined, so any on_request call has happened
    assert len(requesters) == before, "on_request only follows a successful answer"


def test_failing_on_request_callback_does_not_stop_the_listener(
        client: SideChannelClient, caplog: pytest.LogCaptureFixture) -> None:
    def on_request(engine_id: str) -> None:
        raise RuntimeError(f"cannot progress for {engine_id}")

    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS,
                           on_request=on_request) as served, \
            caplog.at_level(logging.ERROR, logger="kvxfer.transfer.side_channel.listener"):
        good_fetch(client, served)
        good_fetch(client, served)
    assert any("on_request('decode-b')" in r.getMessage() for r in caplog.records)


# -- the client's errors --------------------------------------------------------------------

def test_client_with_another_model_gets_a_hash_mismatch_naming_fields(
        listener: SideChannelListener) -> None:
    other = msgspec.structs.replace(COMPAT, dtype="float16")
    with SideChannelClient("decode-b", other) as mismatched, pytest.raises(HashMismatch) as info:
        mismatched.fetch(HOST, listener.port, [0], timeout=ANSWER_S)
    assert listener.address in str(info.value)
    assert "dtype: peer 'bfloat16', here 'float16'" in str(info.value)


def test_client_refused_for_an_unknown_rank(client: SideChannelClient,
                                            listener: SideChannelListener) -> None:
    with pytest.raises(PeerRefused) as info:
        client.fetch(HOST, listener.port, [3], timeout=ANSWER_S)
    assert info.value.code is ErrorCode.UNKNOWN_RANK
    assert str(info.value).startswith(f"peer {listener.address} refused the handshake "
                                      f"(unknown_rank)")
    assert "not [3]" in str(info.value)


def test_unsigned_client_is_refused_by_a_keyed_listener(
        client: SideChannelClient, keyed_listener: SideChannelListener) -> None:
    with pytest.raises(PeerRefused, match="authentication failed") as info:
        client.fetch(HOST, keyed_listener.port, [0], timeout=ANSWER_S)
    assert info.value.code is ErrorCode.BAD_SIGNATURE


def test_client_with_the_wrong_key_rejects_the_reply(keyed_listener: SideChannelListener) -> None:
    with SideChannelClient("decode-b", COMPAT, hmac_key=b"guess") as wrong, \
            pytest.raises(BadSignature, match="does not verify") as info:
        wrong.fetch(HOST, keyed_listener.port, [0], timeout=ANSWER_S)
    assert keyed_listener.address in str(info.value)


def test_keyed_client_rejects_an_unsigned_listener(listener: SideChannelListener) -> None:
    with SideChannelClient("decode-b", COMPAT, hmac_key=KEY) as keyed, \
            pytest.raises(BadSignature, match="unsigned message") as info:
        keyed.fetch(HOST, listener.port, [0], timeout=ANSWER_S)
    assert listener.address in str(info.value)


class ScriptedPeer:
    """A ROUTER on its own thread that answers every request with ``reply(request)``
    frames, or stays silent when ``reply`` is None; counts what it received."""

    def __init__(self, ctx: zmq.Context[Any],
                 reply: Callable[[bytes], list[bytes]] | None) -> None:
        self.reply, self.received = reply, 0
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{HOST}:*")
        self.port = int(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, *body = self._sock.recv_multipart()
            self.received += 1
            if self.reply is not None:
                self._sock.send_multipart([identity, *self.reply(body[-1])])
        self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=ANSWER_S)
        assert not self._thread.is_alive()


@pytest.fixture
def scripted(ctx: zmq.Context[Any]) -> Iterator[Callable[..., ScriptedPeer]]:
    made: list[ScriptedPeer] = []

    def make(reply: Callable[[bytes], list[bytes]] | None) -> ScriptedPeer:
        made.append(ScriptedPeer(ctx, reply))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def _response(*ranks: AgentMetadata, tp_size: int = 2) -> list[bytes]:
    return [encode_message(MetadataResponse(ENGINE, tp_size, ranks), compat=COMPAT)]


def _forged_response(**changes: Any) -> list[bytes]:
    """A response whose second rank has ``changes``, encoded without validation."""
    payload = msgspec.to_builtins(MetadataResponse(ENGINE, 2, tuple(RANKS)),
                                  builtin_types=(bytes,))
    payload["ranks"][1].update(changes)
    fields = msgspec.msgpack.decode(_response(*RANKS)[0][len(MAGIC):])
    fields["payload"] = msgspec.msgpack.encode(payload)
    return [MAGIC + msgspec.msgpack.encode(fields)]


BAD_REPLIES: dict[str, tuple[list[bytes], type[SideChannelError], str]] = {
    "missing-rank": (_response(RANKS[0]), MalformedMessage,
                     "holds ranks [0] but ranks [0, 1] were requested"),
    "two-frames": (_response(*RANKS) * 2, MalformedMessage, "2 frames, expected 1"),
    "garbage": ([b"\xde\xad\xbe\xef"], BadMagic, r"b'\xde\xad\xbe\xef'"),
    "version": ([MAGIC + msgspec.msgpack.encode({"version": 99})], VersionMismatch,
                f"speaks kvxfer protocol 99, this side speaks {KVXFER_PROTOCOL_VERSION}"),
    "a-request": ([request(MetadataRequest("x", (0,)))], MalformedMessage,
                  "expected a metadata_response, found a metadata_request"),
    "inconsistent-tp": (_forged_response(tp_size=4), MalformedMessage,
                        "rank 1 says TP size 4, the response says 2"),
}


@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_bad_reply_raises_naming_the_peer_and_is_not_retried(
        case: str, client: SideChannelClient, scripted: Callable[..., ScriptedPeer]) -> None:
    frames, error, named = BAD_REPLIES[case]
    peer = scripted(lambda _: frames)
    with pytest.raises(error) as info:
        client.fetch(HOST, peer.port, [0, 1], timeout=ANSWER_S, retries=2)
    assert f"tcp://{HOST}:{peer.port}" in str(info.value) and named in str(info.value)
    assert isinstance(info.value, SideChannelError)
    assert peer.received == 1, "a protocol error is deterministic, so it is not retried"


@pytest.mark.parametrize("retries", [0, 2])
def test_silent_peer_times_out_after_each_attempt(
        retries: int, client: SideChannelClient, scripted: Callable[..., ScriptedPeer]) -> None:
    peer = scripted(None)
    timeout = 0.2
    started = time.monotonic()
    with pytest.raises(SideChannelTimeout) as info:
        client.fetch(HOST, peer.port, [0], timeout=timeout, retries=retries)
    elapsed = time.monotonic() - started
    assert str(info.value) == (f"no answer from tcp://{HOST}:{peer.port} within 0.2 s on any "
                               f"of {retries + 1} attempts (something accepts connections "
                               f"there but did not answer)")
    wait_for(lambda: peer.received >= retries + 1, "the last attempt's request")
    assert peer.received == retries + 1
    assert elapsed >= (retries + 1) * timeout
    assert elapsed < (retries + 1) * timeout + 5.0, "hang guard: each attempt has a deadline"


def test_nothing_listening_fails_at_once_naming_the_address(client: SideChannelClient) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(PeerUnreachable) as info:
        client.fetch(HOST, port, [0], timeout=30, retries=5)
    # A refused connect is definitive: no attempt waits for its 30 s deadline.
    assert time.monotonic() - started < 5
    assert str(info.value) == f"cannot connect to tcp://{HOST}:{port}: Connection refused"
    assert info.value.peer == f"tcp://{HOST}:{port}"


def test_fetch_accepts_numpy_ranks(client: SideChannelClient,
                                   listener: SideChannelListener) -> None:
    answer = client.fetch(HOST, listener.port, np.array([1, 0]), timeout=ANSWER_S)
    assert [m.tp_rank for m in answer.ranks] == [1, 0]


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"ranks": []}, "ranks must not be empty"),
    ({"ranks": [1, 1]}, "duplicates: [1, 1]"),
    ({"ranks": [-1]}, "[-1]"),
    ({"ranks": [0.5]}, "'float' object cannot be interpreted as an integer"),
    ({"port": 0}, "got 0"),
    ({"port": 70000}, "got 70000"),
    ({"timeout": 0}, "timeout must be positive, got 0"),
    ({"retries": -1}, "retries must not be negative, got -1"),
])
def test_fetch_arguments_are_validated(kwargs: dict[str, Any], named: str,
                                       client: SideChannelClient) -> None:
    args: dict[str, Any] = {"host": HOST, "port": 5555, "ranks": [0], **kwargs}
    with pytest.raises((ValueError, TypeError)) as info:
        client.fetch(**args)
    assert named in str(info.value)


def test_invalid_host_is_reported_with_the_address(client: SideChannelClient) -> None:
    with pytest.raises(PeerUnreachable) as info:
        client.fetch("no such host", 5555, [0], timeout=0.2, retries=0)
    assert str(info.value).startswith("cannot connect to tcp://no such host:5555: ")


def test_closed_client_refuses_to_fetch() -> None:
    made = SideChannelClient("decode-b", COMPAT)
    made.close()
    made.close()
    with pytest.raises(RuntimeError, match="closed"):
        made.fetch(HOST, 5555, [0])


# -- lifecycle ------------------------------------------------------------------------------

def test_close_while_idle_is_prompt_and_frees_the_port() -> None:
    served = SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS)
    served.start()
    time.sleep(0.1)  # let the thread settle into its poll
    started = time.monotonic()
    served.close()
    took = time.monotonic() - started
    served.close()  # idempotent
    assert took < 2.0, f"close() took {took:.3f} s; the serving thread polls every 50 ms"
    again = SideChannelListener(HOST, served.port, engine_id=ENGINE, compat=COMPAT,
                              metadata=lambda: RANKS)
    again.close()
    with pytest.raises(RuntimeError, match=re.escape(f"{served.address} is closed")):
        served.start()


def test_close_gives_up_on_a_stuck_thread_and_says_so(
        client: SideChannelClient, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """metadata() must not block; if it does, close() returns instead of hanging."""
    entered, release = threading.Event(), threading.Event()

    def stuck() -> list[AgentMetadata]:
        entered.set()
        release.wait(ANSWER_S)
        return RANKS

    monkeypatch.setattr(sockets_module, "JOIN_TIMEOUT_S", 0.1)
    served = SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=stuck).start()
    with pytest.raises(SideChannelTimeout):
        client.fetch(HOST, served.port, [0], timeout=0.1, retries=0)
    assert entered.wait(ANSWER_S)
    with caplog.at_level(logging.ERROR, logger="kvxfer.transfer.side_channel.sockets"):
        served.close()
    release.set()
    assert any(served.address in r.getMessage() and "did not stop within" in r.getMessage()
               for r in caplog.records)
    assert served._thread is not None
    served._thread.join(ANSWER_S)  # it finishes the request, then closes its socket
    assert not served._thread.is_alive()


def test_close_without_start() -> None:
    SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS).close()


def test_binding_a_taken_port_names_the_address(listener: SideChannelListener) -> None:
    with pytest.raises(OSError, match=re.escape(f"cannot bind tcp://{HOST}:{listener.port}")):
        SideChannelListener(HOST, listener.port, engine_id=ENGINE, compat=COMPAT,
                          metadata=lambda: RANKS)


# -- releases -------------------------------------------------------------------------------

HELD = "req-1@1"  # the one lease the release listener holds


@pytest.fixture(scope="module")
def releases() -> list[tuple[str, str, str]]:
    return []


@pytest.fixture(scope="module")
def release_listener(releases: list[tuple[str, str, str]]) -> Iterator[SideChannelListener]:
    def on_release(lease_id: str, requester: str, reason: str, _outcome: str) -> bool:
        releases.append((lease_id, requester, reason))
        return lease_id == HELD

    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS,
                           hmac_key=None, on_release=on_release) as served:
        yield served


def test_release_calls_back_once_and_the_listener_keeps_serving(
        client: SideChannelClient, release_listener: SideChannelListener,
        releases: list[tuple[str, str, str]]) -> None:
    before = len(releases)
    assert client.release(HOST, release_listener.port, HELD, "refused: max_tokens") is True
    assert releases[before:] == [(HELD, "decode-b", "refused: max_tokens")]
    assert client.release(HOST, release_listener.port, "req-1@2", "aborted") is False
    assert releases[before + 1:] == [("req-1@2", "decode-b", "aborted")]
    good_fetch(client, release_listener)


def test_a_release_from_another_model_is_served(release_listener: SideChannelListener,
                                                releases: list[tuple[str, str, str]]) -> None:
    other = msgspec.structs.replace(COMPAT, num_layers=32)
    with SideChannelClient("decode-other", other) as mismatched:
        with pytest.raises(HashMismatch):  # its handshake is refused...
            mismatched.fetch(HOST, release_listener.port, [0], timeout=ANSWER_S)
        # ...but it can still release what it will not read
        assert mismatched.release(HOST, release_listener.port, HELD, "handshake refused")
    assert releases[-1] == (HELD, "decode-other", "handshake refused")


def test_a_long_reason_is_truncated(client: SideChannelClient,
                                    release_listener: SideChannelListener,
                                    releases: list[tuple[str, str, str]]) -> None:
    client.release(HOST, release_listener.port, HELD, "x" * 5000)
    assert releases[-1][2] == "x" * 1024


@pytest.mark.parametrize("case", ["wrong-version", "garbage", "wrong-kind-payload"])
def test_a_bad_release_is_refused_without_a_callback(
        case: str, ctx: zmq.Context[Any], client: SideChannelClient,
        release_listener: SideChannelListener, releases: list[tuple[str, str, str]]) -> None:
    release = request(ReleaseLease(HELD, "decode-b", "x"))
    frames, code, named = {
        "wrong-version": ([MAGIC + msgspec.msgpack.encode(
            {**msgspec.msgpack.decode(release[len(MAGIC):]),
             "version": KVXFER_PROTOCOL_VERSION + 1})], ErrorCode.VERSION_MISMATCH,
            f"speaks kvxfer protocol {KVXFER_PROTOCOL_VERSION + 1}"),
        "garbage": ([b"RELEASE " + HELD.encode()], ErrorCode.BAD_MAGIC, "b'RELEASE '"),
        "wrong-kind-payload": ([forged(kind="release")], ErrorCode.MALFORMED,
                               "malformed release"),
    }[case]
    before = len(releases)
    reply = refusal(exchange(ctx, release_listener.address, frames))
    assert reply.code is code and named in reply.message
    assert len(releases) == before, "a refused release must not reach on_release"
    good_fetch(client, release_listener)


@pytest.mark.parametrize("key", [None, b"guess"], ids=["unsigned", "wrong-key"])
def test_a_badly_signed_release_is_refused(key: bytes | None, ctx: zmq.Context[Any]) -> None:
    calls: list[str] = []

    def on_release(lease_id: str, _requester: str, _reason: str, _outcome: str) -> bool:
        calls.append(lease_id)
        return True

    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS,
                           hmac_key=KEY, on_release=on_release) as served:
        with SideChannelClient("decode-b", COMPAT, hmac_key=key) as unsigned, \
                pytest.raises((PeerRefused, BadSignature)) as info:
            unsigned.release(HOST, served.port, HELD, "x", timeout=ANSWER_S)
        if key is None:
            assert isinstance(info.value, PeerRefused)
            assert info.value.code is ErrorCode.BAD_SIGNATURE
            assert str(info.value).startswith(f"peer {served.address} refused the release of "
                                              f"lease '{HELD}' (bad_signature)")
        else:  # the listener refuses, and the reply's signature does not verify for it
            assert served.address in str(info.value) and "does not verify" in str(info.value)
        assert calls == []
        with SideChannelClient("decode-b", COMPAT, hmac_key=KEY) as keyed:
            assert keyed.release(HOST, served.port, HELD, "x", timeout=ANSWER_S) is True
        assert calls == [HELD]


def test_a_listener_without_leases_refuses_releases(client: SideChannelClient,
                                                    listener: SideChannelListener) -> None:
    with pytest.raises(PeerRefused) as info:
        client.release(HOST, listener.port, HELD, "x", timeout=ANSWER_S)
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert f"engine {ENGINE} holds no leases" in str(info.value)
    good_fetch(client, listener)


def test_a_failing_on_release_is_answered_as_unavailable(client: SideChannelClient) -> None:
    def on_release(lease_id: str, _requester: str, _reason: str, _outcome: str) -> bool:
        raise RuntimeError(f"queue closed for {lease_id}")

    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS,
                           on_release=on_release) as served:
        with pytest.raises(PeerRefused, match=f"queue closed for {HELD}") as info:
            client.release(HOST, served.port, HELD, "x", timeout=ANSWER_S)
        assert info.value.code is ErrorCode.UNAVAILABLE
        good_fetch(client, served)


def test_release_client_errors_name_the_peer(client: SideChannelClient,
                                             scripted: Callable[..., ScriptedPeer]) -> None:
    silent = scripted(None)
    with pytest.raises(SideChannelTimeout) as info:
        client.release(HOST, silent.port, HELD, "x", timeout=0.2)
    assert str(info.value) == (f"no answer from tcp://{HOST}:{silent.port} to the release of "
                               f"lease '{HELD}' within 0.2 s")
    wait_for(lambda: silent.received == 1, "the release")
    assert silent.received == 1, "a release is sent once, never retried"
    other_ack = scripted(lambda _: [encode_message(ReleaseAck("req-9@9", True), compat=COMPAT)])
    with pytest.raises(MalformedMessage, match="acknowledges lease 'req-9@9', not 'req-1@1'"):
        client.release(HOST, other_ack.port, HELD, "x", timeout=ANSWER_S)
    metadata = scripted(lambda _: _response(*RANKS))
    with pytest.raises(MalformedMessage, match="expected a release_ack, found a "
                                               "metadata_response"):
        client.release(HOST, metadata.port, HELD, "x", timeout=ANSWER_S)
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    with pytest.raises(PeerUnreachable, match=f"cannot connect to tcp://{HOST}:{port}"):
        client.release(HOST, port, HELD, "x", timeout=ANSWER_S)
    with pytest.raises(ValueError, match="got 0"):
        client.release(HOST, 0, HELD, "x")
    with pytest.raises(ValueError, match="lease_id must not be empty"):
        client.release(HOST, silent.port, "", "x")


def test_side_channel_sender_sends_in_the_background_and_drains_on_close(
        release_listener: SideChannelListener, releases: list[tuple[str, str, str]]) -> None:
    sender = SideChannelSender(SideChannelClient("decode-s", COMPAT))
    before = len(releases)
    try:
        assert sender.submit(HOST, release_listener.port, HELD, "one")
        assert sender.submit(HOST, release_listener.port, "req-2@5", "two")
    finally:
        sender.close()
    assert releases[before:] == [(HELD, "decode-s", "one"), ("req-2@5", "decode-s", "two")]
    assert (sender.sent, sender.failed, sender.dropped) == (2, 0, 0)
    assert not sender.submit(HOST, release_listener.port, HELD, "late")
    sender.close()  # idempotent


def test_side_channel_sender_survives_failures_and_bounds_its_queue_and_close(
        scripted: Callable[..., ScriptedPeer]) -> None:
    """A silent prefill: each send times out; extra releases are dropped, not queued
    without bound, and close() gives up on what is left after drain_s."""
    silent = scripted(None)
    sender = SideChannelSender(SideChannelClient("decode-s", COMPAT), timeout=0.2, max_queued=2,
                           drain_s=0.3)
    try:
        accepted = [sender.submit(HOST, silent.port, f"req-{i}@{i}", "x") for i in range(6)]
        assert accepted.count(False) >= 3, "at most 2 wait, and one may be sending"
        wait_for(lambda: sender.failed >= 1, "a failed send")
    finally:
        sender.close()
    assert not sender._thread.is_alive(), "close() gave up on the rest and stopped the thread"
    assert sender.dropped == accepted.count(False) + (6 - accepted.count(False)
                                                      - sender.failed - sender.sent)
    assert sender.sent == 0 and sender.failed >= 1
    wait_for(lambda: silent.received == sender.failed, "every attempted release")


# -- a listener in another OS process -------------------------------------------------------

def serve_until_stdin_closes() -> None:
    """Child side: serve RANKS; print the port and RANKS (their addresses are this
    process's), stop when the parent closes stdin."""
    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT,
                           metadata=lambda: RANKS) as served:
        print(served.port, msgspec.msgpack.encode(tuple(RANKS)).hex(), flush=True)
        sys.stdin.read()


@pytest.fixture(scope="module")
def remote() -> Iterator[tuple[int, tuple[AgentMetadata, ...]]]:
    child = subprocess.Popen([sys.executable, __file__, "serve"], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def stop() -> None:
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=10)

    try:
        assert child.stdout is not None
        port, served = child.stdout.readline().split()
        yield int(port), msgspec.msgpack.decode(bytes.fromhex(served),
                                                type=tuple[AgentMetadata, ...])
    finally:
        stop()
    assert child.returncode == 0, f"the listener process exited with {child.returncode}"


def test_listener_in_another_process(remote: tuple[int, tuple[AgentMetadata, ...]],
                                     ctx: zmq.Context[Any], client: SideChannelClient) -> None:
    port, served = remote
    answer = client.fetch(HOST, port, [0, 1], timeout=ANSWER_S)
    assert answer == MetadataResponse(ENGINE, 2, served)
    reply = refusal(exchange(ctx, f"tcp://{HOST}:{port}", [b"junk"]))
    assert reply.code is ErrorCode.BAD_MAGIC and "b'junk'" in reply.message
    assert client.fetch(HOST, port, [1], timeout=ANSWER_S).ranks == (served[1],)


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve_until_stdin_closes()


# -- renewals --------------------------------------------------------------------------------

@pytest.mark.parametrize("held", [True, False])
def test_a_renewal_is_answered_with_the_ttl(held: bool) -> None:
    calls: list[tuple[str, str, bool]] = []

    def on_renew(lease_id: str, requester: str, claim: bool) -> float:
        calls.append((lease_id, requester, claim))
        if not held:
            raise RenewRefused("another decode claimed it first")
        return 0.5

    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS,
                           hmac_key=KEY, on_renew=on_renew) as served, \
            SideChannelClient("decode-b", COMPAT, hmac_key=KEY) as keyed:
        ack = keyed.renew(HOST, served.port, HELD, timeout=ANSWER_S, claim=True)
        renewal = keyed.renew(HOST, served.port, HELD, timeout=ANSWER_S)
    assert (ack.lease_id, ack.found, ack.expires_in) == (HELD, held, 0.5 if held else 0.0)
    assert ack.reason == ("" if held else "another decode claimed it first")
    assert renewal.found is held
    assert calls == [(HELD, "decode-b", True), (HELD, "decode-b", False)]


def test_an_unauthenticated_renewal_is_refused() -> None:
    calls: list[str] = []

    def on_renew(lease_id: str, _requester: str, _claim: bool) -> float:
        calls.append(lease_id)
        return 0.5

    with SideChannelListener(HOST, engine_id=ENGINE, compat=COMPAT, metadata=lambda: RANKS,
                           hmac_key=KEY, on_renew=on_renew) as served, \
            SideChannelClient("decode-b", COMPAT) as unsigned, \
            pytest.raises(PeerRefused, match="authentication failed"):
        unsigned.renew(HOST, served.port, HELD, timeout=ANSWER_S)
    assert calls == []
