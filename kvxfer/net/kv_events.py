"""The KV event stream: what an instance's prefix cache holds, as it changes, in the format
vLLM's own KV events use, so that one subscriber reads kvxfer sidecars and vLLM instances
(``--kv-events-config``) alike.

A publisher sends ZMQ multipart messages ``(topic, sequence, payload)`` on a PUB socket: the
sequence an 8-byte big-endian count from 0, the payload a msgpack :class:`KVEventBatch` of
:class:`BlockStored`, :class:`BlockRemoved` and :class:`AllBlocksCleared`. A ROUTER socket
replays: a subscriber sends the first sequence it lacks (8 bytes) and gets every batch still
buffered from there, each as ``(topic, sequence, payload)``, then ``(b"", END_SEQUENCE, b"")``.

With a KV key a kvxfer sidecar appends a fourth frame, :func:`event_mac`, to every message,
published or replayed, and a subscriber that holds the key refuses a message without a valid
one: a forged event would steer traffic. vLLM's events carry no MAC.

Pure: msgspec and the standard library.

Design: docs/design/kv-events.md
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay."""
MAC_BYTES = 32
_DOMAIN = b"kvxfer kv events v1"  # keeps an event MAC apart from the side channel's

BlockHash = bytes | int  # vLLM's ExternalBlockHash


class KVCacheEvent(msgspec.Struct, tag=True):
    """One change to an instance's cache (tagged by class name in ``"type"``, as vLLM's)."""


class BlockStored(KVCacheEvent):
    """Full blocks now cached, in order: ``block_hashes[i]`` holds
    ``token_ids[i * block_size:(i + 1) * block_size]``, after ``parent_block_hash`` (None:
    from the start of a sequence). The hashes are the engine's own names for its blocks; a
    reader keys the blocks by the tokens."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached (by the names :class:`BlockStored` gave them)."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole cache is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    """One message's events; ``ts`` is seconds since the epoch on the publisher's clock."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in ``payload``; msgspec.DecodeError (a ValueError) when it is none."""
    return _decoder.decode(payload)


def sequence_bytes(sequence: int) -> bytes:
    return sequence.to_bytes(8, "big", signed=True)


def sequence_of(frame: bytes) -> int:
    """The sequence number in an 8-byte frame; ValueError for any other length."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def event_mac(key: bytes, topic: bytes, sequence: bytes, payload: bytes) -> bytes:
    """The fourth frame of a signed message: HMAC-SHA256 over its other three."""
    framed = b"".join(len(part).to_bytes(4, "big") + part for part in (topic, sequence, payload))
    return hmac.new(key, _DOMAIN + framed, hashlib.sha256).digest()


def verify_mac(key: bytes, frames: list[bytes]) -> bool:
    """Whether ``frames`` (topic, sequence, payload, MAC) carry a valid MAC for ``key``."""
    if len(frames) != 4 or len(frames[3]) != MAC_BYTES:
        return False
    return hmac.compare_digest(event_mac(key, *frames[:3]), frames[3])
