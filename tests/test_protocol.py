"""Tests for the wire protocol (``kvxfer.wire``: version, errors, compat, metadata, messages,
framing, envelope, notification): wire round trips, strict decoding, errors, hash, signatures.

Releases (``ReleaseLease`` / ``ReleaseAck``) follow every rule of the other
messages except the compatibility hash, which is not checked for them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.plan.layout import CacheSpec, allocate_kv_cache
from kvxfer.plan.regions import RegionPlan, plan_regions
from kvxfer.wire.compat import CompatInfo, compat_diff, compat_hash
from kvxfer.wire.envelope import ANONYMOUS_HASH, decode_envelope, decode_payload, encode_message
from kvxfer.wire.messages import (
    HASH_FREE_KINDS,
    MAX_LEASE_ID_CHARS,
    MAX_RELEASE_REASON_CHARS,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    MessageKind,
    MetadataRequest,
    MetadataResponse,
    ReleaseAck,
    ReleaseLease,
    RenewAck,
    RenewLease,
    check_response,
)
from kvxfer.wire.metadata import AgentMetadata
from kvxfer.wire.notification import ReadDone, decode_notif, encode_notif
from kvxfer.wire.protocol_errors import (
    BadMagic,
    BadSignature,
    ErrorCode,
    FieldDiff,
    HashMismatch,
    MalformedMessage,
    ProtocolError,
    SideChannelError,
    VersionMismatch,
)
from kvxfer.wire.version import KVXFER_PROTOCOL_VERSION, MAGIC

PEER = "tcp://10.0.0.7:5600"
COMPAT = CompatInfo(model="llama-3-8b", dtype="bfloat16", cache_dtype="bfloat16", head_size=64,
                    total_kv_heads=4, num_layers=4)
HASH = compat_hash(COMPAT)
KEY = b"shared secret"


def _plan(layout: str = "LBHNC", block_size: int = 16, kernel: int | None = None) -> RegionPlan:
    spec = CacheSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    _, views = allocate_kv_cache(spec, 8, 4, layout, block_size=kernel)
    return plan_regions({f"layers.{i}": v for i, v in enumerate(views)}, spec, 8)


PLAN = _plan()


def meta(rank: int = 0, tp_size: int = 2, engine_id: str = "prefill-a",
         plan: RegionPlan = PLAN) -> AgentMetadata:
    return AgentMetadata(engine_id=engine_id, tp_rank=rank, tp_size=tp_size,
                         agent_name=f"{engine_id}-rank{rank}", agent_blob=bytes(range(256)) * 4,
                         device_id=0, num_blocks=plan.num_blocks, block_size=plan.block_size,
                         layout=plan.layout, plan=plan, kernel_ratio=plan.kernel_ratio)


RESPONSE = MetadataResponse("prefill-a", 2, (meta(1), meta(0)))
REQUEST = MetadataRequest("decode-b", (1, 0))
RELEASE = ReleaseLease("req-7@3", "decode-b", "the decode refused the request: max_tokens")
ACK = ReleaseAck("req-7@3", found=True)
MESSAGES = [REQUEST, RESPONSE, RELEASE, ACK, RenewLease("req-7@3", "decode-b", claim=True),
            RenewAck("req-7@3", True, 0.5), Heartbeat("decode-b", 7), HeartbeatAck(7),
            ErrorReply(ErrorCode.UNKNOWN_RANK, "no rank 7")]
KIND_NAMES: dict[type[Any], str] = {
    MetadataRequest: "metadata_request", MetadataResponse: "metadata_response",
    ReleaseLease: "release", ReleaseAck: "release_ack", RenewLease: "renew",
    RenewAck: "renew_ack", Heartbeat: "heartbeat", HeartbeatAck: "heartbeat_ack",
    ErrorReply: "error_reply"}


def builtins(obj: Any) -> Any:
    """A struct as plain msgpack-able values, bytes kept as bytes (to forge messages)."""
    return msgspec.to_builtins(obj, builtin_types=(bytes,))


def forge(envelope: dict[str, Any], magic: bytes = MAGIC) -> bytes:
    return magic + msgspec.msgpack.encode(envelope)


def envelope_dict(message: Any = REQUEST, **changes: Any) -> dict[str, Any]:
    """The envelope of ``message`` as a dict, with ``changes`` applied (unsigned)."""
    kind = KIND_NAMES[type(message)]
    out = {"version": KVXFER_PROTOCOL_VERSION, "compat_hash": HASH, "kind": kind,
           "payload": msgspec.msgpack.encode(message), "signature": None,
           "sender": builtins(COMPAT)}
    out.update(changes)
    return out


def decode(raw: bytes, **kwargs: Any) -> Any:
    kwargs.setdefault("expected_hash", HASH)
    kwargs.setdefault("peer", PEER)
    return decode_envelope(raw, **kwargs)


# -- round trips ----------------------------------------------------------------------------

@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_round_trip(message: Any, key: bytes | None) -> None:
    raw = encode_message(message, compat=COMPAT, hmac_key=key)
    assert raw.startswith(MAGIC)
    envelope = decode(raw, hmac_key=key, local_compat=COMPAT)
    assert envelope.version == KVXFER_PROTOCOL_VERSION
    assert envelope.compat_hash == HASH
    assert envelope.sender == COMPAT
    assert (envelope.signature is None) == (key is None)
    assert decode_payload(envelope, type(message), peer=PEER) == message


def test_response_carries_the_plan_verbatim() -> None:
    envelope = decode(encode_message(RESPONSE, compat=COMPAT))
    response = decode_payload(envelope, MetadataResponse)
    assert response.ranks[0].plan == PLAN
    assert response.ranks[0].agent_blob == bytes(range(256)) * 4


def test_sender_compat_is_optional() -> None:
    envelope = decode(encode_message(REQUEST, compat=COMPAT, include_compat=False))
    assert envelope.sender is None
    assert decode_payload(envelope, MetadataRequest) == REQUEST


def test_a_signature_is_ignored_without_a_key() -> None:
    envelope = decode(encode_message(REQUEST, compat=COMPAT, hmac_key=KEY))
    assert decode_payload(envelope, MetadataRequest) == REQUEST


@pytest.mark.parametrize("ok", [True, False])
def test_notification_round_trip(ok: bool) -> None:
    note = ReadDone("req-1", "decode-b", 3, 2, ok)
    raw = encode_notif(note)
    assert raw.startswith(MAGIC)
    assert decode_notif(raw) == note


# -- phase one: magic, version, envelope ----------------------------------------------------

@pytest.mark.parametrize("raw", [b"", b"KVX", b"GET / HTTP/1.1\r\n", b"\x00" * 40,
                                 b"XKVF" + msgspec.msgpack.encode({"version": 1})])
def test_bad_magic_names_peer_and_bytes(raw: bytes) -> None:
    with pytest.raises(BadMagic) as info:
        decode(raw)
    message = str(info.value)
    assert PEER in message and repr(raw[:8]) in message and repr(MAGIC) in message
    assert info.value.found == raw[:8] and info.value.peer == PEER


def test_version_mismatch_states_both_versions() -> None:
    raw = forge(envelope_dict(version=KVXFER_PROTOCOL_VERSION + 1))
    with pytest.raises(VersionMismatch) as info:
        decode(raw)
    assert str(info.value) == (f"peer {PEER} speaks kvxfer protocol "
                               f"{KVXFER_PROTOCOL_VERSION + 1}, this side speaks "
                               f"{KVXFER_PROTOCOL_VERSION}")
    assert (info.value.expected, info.value.found) == (KVXFER_PROTOCOL_VERSION,
                                                       KVXFER_PROTOCOL_VERSION + 1)


def test_future_envelope_with_new_fields_reports_the_version() -> None:
    """A later version may reshape the envelope; the version must still be readable."""
    later = KVXFER_PROTOCOL_VERSION + 1
    raw = forge({"version": later, "routing": [1, 2], "payload": "anything"})
    with pytest.raises(VersionMismatch, match=f"speaks kvxfer protocol {later}"):
        decode(raw)


@pytest.mark.parametrize(("envelope", "named"), [
    (envelope_dict(extra=1), "extra"),
    (envelope_dict(kind="gossip"), "gossip"),
    (envelope_dict(payload="not bytes"), "payload"),
    (envelope_dict(compat_hash=5), "compat_hash"),
    ({k: v for k, v in envelope_dict().items() if k != "payload"}, "payload"),
    ({"compat_hash": HASH}, "version"),
    ({"version": "1"}, "version"),
], ids=["unknown-field", "unknown-kind", "payload-type", "hash-type", "no-payload",
        "no-version", "version-type"])
def test_malformed_envelope_names_the_problem(envelope: dict[str, Any], named: str) -> None:
    with pytest.raises(MalformedMessage) as info:
        decode(forge(envelope))
    assert named in str(info.value) and PEER in str(info.value)


@pytest.mark.parametrize("body", [b"", b"\xc1", msgspec.msgpack.encode([1, 2]),
                                  msgspec.msgpack.encode(envelope_dict())[:-3]],
                         ids=["empty", "reserved-byte", "array", "truncated"])
def test_undecodable_body_after_magic_is_malformed(body: bytes) -> None:
    with pytest.raises(MalformedMessage, match="malformed envelope"):
        decode(MAGIC + body)


# -- phase one: hash ------------------------------------------------------------------------

OTHER = msgspec.structs.replace(COMPAT, num_layers=32, dtype="float16")


def test_hash_mismatch_names_both_hashes_and_differing_fields() -> None:
    raw = encode_message(REQUEST, compat=OTHER)
    with pytest.raises(HashMismatch) as info:
        decode(raw, local_compat=COMPAT)
    message = str(info.value)
    assert HASH in message and compat_hash(OTHER) in message and PEER in message
    assert "dtype: peer 'float16', here 'bfloat16'" in message
    assert "num_layers: peer 32, here 4" in message
    assert info.value.differing == (FieldDiff("dtype", "bfloat16", "float16"),
                                    FieldDiff("num_layers", 4, 32))
    assert (info.value.expected, info.value.found) == (HASH, compat_hash(OTHER))


def test_hash_mismatch_without_sender_compat_says_so() -> None:
    raw = encode_message(REQUEST, compat=OTHER, include_compat=False)
    with pytest.raises(HashMismatch, match="did not send its CompatInfo") as info:
        decode(raw, local_compat=COMPAT)
    assert compat_hash(OTHER) in str(info.value) and info.value.differing is None


def test_hash_mismatch_with_identical_fields_blames_the_hash() -> None:
    raw = encode_message(REQUEST, compat=COMPAT)
    with pytest.raises(HashMismatch, match="no CompatInfo field differs") as info:
        decode(raw, expected_hash="ab" * 32, local_compat=COMPAT)
    assert "ab" * 32 in str(info.value) and info.value.differing == ()


def test_sender_compat_must_match_the_hash_it_travels_with() -> None:
    raw = forge(envelope_dict(sender=builtins(OTHER)))
    with pytest.raises(MalformedMessage, match=f"compat_hash {HASH} is not the hash"):
        decode(raw)


# -- phase one: signatures ------------------------------------------------------------------

def test_unsigned_message_is_refused_when_a_key_is_set() -> None:
    with pytest.raises(BadSignature, match="unsigned message") as info:
        decode(encode_message(REQUEST, compat=COMPAT), hmac_key=KEY)
    assert PEER in str(info.value) and info.value.found == "no signature"


def test_wrong_key_is_refused() -> None:
    raw = encode_message(REQUEST, compat=COMPAT, hmac_key=b"another key")
    with pytest.raises(BadSignature, match="does not verify") as info:
        decode(raw, hmac_key=KEY)
    assert len(str(info.value.found)) == 64 and PEER in str(info.value)


@pytest.mark.parametrize("field", ["payload", "kind", "compat_hash", "sender"])
def test_tampering_with_any_signed_field_is_refused(field: str) -> None:
    good = msgspec.msgpack.decode(encode_message(REQUEST, compat=COMPAT, hmac_key=KEY)[4:])
    tampered = {
        "payload": msgspec.msgpack.encode(MetadataRequest("decode-b", (5,))),
        "kind": "error_reply",
        "compat_hash": compat_hash(OTHER),
        "sender": None,
    }[field]
    with pytest.raises(BadSignature, match="does not verify"):
        decode(forge({**good, field: tampered}), hmac_key=KEY)


def test_signature_is_checked_before_the_hash() -> None:
    """An unauthenticated peer learns nothing about this side's model."""
    with pytest.raises(BadSignature):
        decode(encode_message(REQUEST, compat=OTHER), hmac_key=KEY, local_compat=COMPAT)


# -- phase two: payloads --------------------------------------------------------------------

def test_payload_of_the_wrong_kind_names_both_kinds() -> None:
    envelope = decode(encode_message(REQUEST, compat=COMPAT))
    with pytest.raises(MalformedMessage) as info:
        decode_payload(envelope, MetadataResponse, peer=PEER)
    assert "expected a metadata_response, found a metadata_request" in str(info.value)
    assert info.value.found is MessageKind.METADATA_REQUEST


def _bad_response_rank(**changes: Any) -> dict[str, Any]:
    response = builtins(RESPONSE)
    response["ranks"][0].update(changes)
    return response


@pytest.mark.parametrize(("kind", "payload", "named"), [
    (MetadataRequest, {"requester_engine_id": "d", "ranks": [0], "priority": 1}, "priority"),
    (MetadataRequest, {"requester_engine_id": "d", "ranks": "01"}, "ranks"),
    (MetadataRequest, {"requester_engine_id": "d", "ranks": [0.5]}, "ranks"),
    (MetadataRequest, {"requester_engine_id": "d", "ranks": [1, 1]}, "[1, 1]"),
    (MetadataRequest, {"requester_engine_id": "d", "ranks": [-2]}, "[-2]"),
    (MetadataRequest, {"requester_engine_id": "d", "ranks": []}, "ranks must not be empty"),
    (MetadataRequest, {"requester_engine_id": "", "ranks": [0]}, "requester_engine_id"),
    (MetadataRequest, {"ranks": [0]}, "requester_engine_id"),
    (ErrorReply, {"code": "teapot", "message": "x"}, "teapot"),
    (MetadataResponse, _bad_response_rank(agent_blob="text"), "agent_blob"),
    (MetadataResponse, _bad_response_rank(tp_rank=9), "tp_rank 9"),
    (MetadataResponse, _bad_response_rank(layout="BLHNC"), "'BLHNC'"),
    (MetadataResponse, _bad_response_rank(block_size=32), "32"),
    (MetadataResponse, _bad_response_rank(engine_id="prefill-z"), "prefill-z"),
    (MetadataResponse, _bad_response_rank(tp_size=4), "TP size 4"),
    (MetadataResponse, _bad_response_rank(tp_rank=0), "[0, 0]"),
    (MetadataResponse, _bad_response_rank(device_id=-1), "-1"),
    (MetadataResponse, _bad_response_rank(agent_name=""), "agent_name must not be empty"),
    (MetadataResponse, _bad_response_rank(engine_id=""), "engine_id must not be empty"),
    (MetadataResponse, _bad_response_rank(backends=[]), "backends must name at least one"),
    (MetadataResponse, {**builtins(RESPONSE), "ranks": []}, "ranks must not be empty"),
    (ReleaseLease, {**builtins(RELEASE), "lease_id": ""}, "lease_id must not be empty"),
    (ReleaseLease, {**builtins(RELEASE), "lease_id": "x" * (MAX_LEASE_ID_CHARS + 1)},
     f"lease_id has {MAX_LEASE_ID_CHARS + 1} characters"),
    (ReleaseLease, {**builtins(RELEASE), "requester_engine_id": ""},
     "requester_engine_id must not be empty"),
    (ReleaseLease, {**builtins(RELEASE), "reason": "r" * (MAX_RELEASE_REASON_CHARS + 1)},
     f"reason has {MAX_RELEASE_REASON_CHARS + 1} characters"),
    (ReleaseLease, {**builtins(RELEASE), "reason": 7}, "reason"),
    (ReleaseLease, {**builtins(RELEASE), "blocks": [1, 2]}, "blocks"),
    (ReleaseLease, {"lease_id": "req-7@3", "reason": "x"}, "requester_engine_id"),
    (ReleaseAck, {"lease_id": "req-7@3", "found": "yes"}, "found"),
    (ReleaseAck, {"lease_id": "", "found": False}, "ReleaseAck.lease_id must not be empty"),
    (Heartbeat, {"requester_engine_id": "", "seq": 0}, "requester_engine_id must not be empty"),
    (Heartbeat, {"requester_engine_id": "d", "seq": -1}, "Heartbeat.seq must not be negative"),
    (Heartbeat, {"requester_engine_id": "d", "seq": "1"}, "seq"),
    (HeartbeatAck, {"seq": -3}, "HeartbeatAck.seq must not be negative"),
    (HeartbeatAck, {"seq": 1, "lease_id": "x"}, "lease_id"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 60 else None)
def test_strict_payload_decoding_names_the_offender(kind: type[Any], payload: dict[str, Any],
                                                    named: str) -> None:
    kind_name = KIND_NAMES[kind]
    raw = forge(envelope_dict(kind=kind_name, payload=msgspec.msgpack.encode(payload)))
    envelope = decode(raw)
    with pytest.raises(MalformedMessage) as info:
        decode_payload(envelope, kind, peer=PEER)
    assert named in str(info.value) and PEER in str(info.value)


def test_a_host_read_offer_round_trips_and_a_malformed_one_is_refused() -> None:
    """AgentMetadata.host_reads (protocol 9, its shared buffers 10, taken over a handover
    socket 13): absent means NIXL only; an offer arrives verbatim; a bad one fails decoding
    with the field named, like any other."""
    from kvxfer.wire.metadata import HostReads, SharedRegion

    offer = HostReads(host="boot/pid:[4026531836]", pid=4242, canary_addr=0x7F0000001000,
                      canary=bytes(range(16)),
                      memory=(SharedRegion(id=7, addr=0x7F1000000000, size=1 << 30),),
                      proof_addr=0x7F0000002000, handover="\0kvxfer-handover-4242-5f1e")
    with_offer = msgspec.structs.replace(meta(0), host_reads=offer)
    response = MetadataResponse("prefill-a", 2, (meta(1), with_offer))
    got = decode_payload(decode(encode_message(response, compat=COMPAT)), MetadataResponse)
    assert got == response and got.ranks[1].host_reads == offer
    assert got.ranks[0].host_reads is None
    as_dict = msgspec.to_builtins(with_offer)
    as_dict["host_reads"]["pid"] = 0
    with pytest.raises(msgspec.ValidationError, match=r"HostReads\.pid must be positive"):
        msgspec.convert(as_dict, AgentMetadata)
    as_dict["host_reads"]["pid"] = 4242
    as_dict["host_reads"]["memory"][0]["size"] = 0
    with pytest.raises(msgspec.ValidationError, match=r"SharedRegion\.size must be positive"):
        msgspec.convert(as_dict, AgentMetadata)
    as_dict["host_reads"]["memory"] = [{"id": 7, "addr": 4096, "size": 4096}] * 65
    with pytest.raises(msgspec.ValidationError, match=r"at most 64 buffers, got 65"):
        msgspec.convert(as_dict, AgentMetadata)
    as_dict["host_reads"]["memory"] = [{"fd": 7, "addr": 4096, "size": 4096}]  # protocol 12
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `fd`"):
        msgspec.convert(as_dict, AgentMetadata)
    as_dict["host_reads"]["memory"] = [{"id": 7, "addr": 4096, "size": 4096}]
    for name in ("/tmp/handover", "\0" + "x" * 108):  # a path, or too long a name
        as_dict["host_reads"]["handover"] = name
        with pytest.raises(msgspec.ValidationError, match=r"must name an abstract Unix socket"):
            msgspec.convert(as_dict, AgentMetadata)
    # buffers come with the socket and the proof that hand them over, and only with them
    for changes in ({"handover": ""}, {"proof_addr": 0}, {"memory": []}):
        changed = {**as_dict["host_reads"], "handover": offer.handover, **changes}
        with pytest.raises(msgspec.ValidationError, match=r"come together"):
            msgspec.convert({**as_dict, "host_reads": changed}, AgentMetadata)


@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
def test_a_kernel_block_plan_round_trips_with_its_logical_and_kernel_sizes(layout: str) -> None:
    """A rank whose views see each 16-token block as four 4-token kernel blocks: the
    metadata says the logical block size and the ratio, the plan arrives verbatim, and
    the reader's geometry counts logical blocks of kernel chunks."""
    from kvxfer.plan.descriptors import SideGeometry

    plan = _plan(layout, 16, kernel=4)
    response = MetadataResponse("prefill-a", 2, (meta(1, plan=plan), meta(0, plan=plan)))
    got = decode_payload(decode(encode_message(response, compat=COMPAT)), MetadataResponse)
    assert got == response
    first = got.ranks[0]
    assert (first.block_size, first.kernel_ratio, first.num_blocks) == (16, 4, 8)
    assert (first.plan.kernel_ratio, first.plan.kernel_block_size) == (4, 4)
    geometry = SideGeometry.from_plan(first.plan)
    assert (geometry.block_size, geometry.kernel_ratio, geometry.num_blocks) == (16, 4, 8)
    assert (meta(plan=PLAN).kernel_ratio, PLAN.kernel_ratio) == (1, 1)  # no split


def test_metadata_must_agree_with_its_plans_kernel_ratio() -> None:
    plan = _plan(kernel=4)
    fields = {name: getattr(meta(plan=plan), name) for name in AgentMetadata.__struct_fields__}
    with pytest.raises(ValueError, match=r"AgentMetadata\.kernel_ratio is 1 but its plan says 4"):
        AgentMetadata(**{**fields, "kernel_ratio": 1})
    with pytest.raises(ValueError, match="kernel_ratio 3 does not divide its block_size 16"):
        AgentMetadata(**{**fields, "kernel_ratio": 3,
                         "plan": msgspec.structs.replace(plan, kernel_ratio=3)})
    with pytest.raises(ValueError, match="rank 1 splits each block into 4 kernel blocks, rank 0 "
                                         "into 1"):
        MetadataResponse("prefill-a", 2, (meta(0), meta(1, plan=plan)))


def test_ranks_of_one_engine_share_block_size_and_layout() -> None:
    with pytest.raises(ValueError, match="block size 32 and layout LBHNC, rank 0 has 16"):
        MetadataResponse("prefill-a", 2, (meta(0), meta(1, plan=_plan(block_size=32))))


@pytest.mark.parametrize(("changes", "named"), [
    ({"model": ""}, "CompatInfo.model"),
    ({"dtype": ""}, "CompatInfo.dtype"),
    ({"cache_dtype": ""}, "CompatInfo.cache_dtype"),
    ({"protocol_version": 0}, "protocol_version must be positive, got 0"),
    ({"head_size": 0}, "head_size must be positive, got 0"),
    ({"total_kv_heads": -8}, "got -8"),
    ({"num_layers": 0}, "num_layers"),
])
def test_compat_info_validates_on_construction(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        msgspec.structs.replace(COMPAT, **changes)


def test_check_response_names_missing_and_extra_ranks() -> None:
    assert check_response(RESPONSE, [0, 1], peer=PEER) is RESPONSE
    with pytest.raises(MalformedMessage, match=r"holds ranks \[1, 0\] but ranks \[0\] were"):
        check_response(RESPONSE, [0], peer=PEER)
    with pytest.raises(MalformedMessage, match=r"ranks \[0, 1, 2\] were requested") as info:
        check_response(RESPONSE, [0, 1, 2], peer=PEER)
    assert PEER in str(info.value) and info.value.expected == (0, 1, 2)


# -- notifications --------------------------------------------------------------------------

GOOD_NOTE = {"request_id": "r", "reader_engine_id": "d", "reader_rank": 0,
             "expected_readers": 1, "ok": True}
V = KVXFER_PROTOCOL_VERSION


@pytest.mark.parametrize(("raw", "error", "named"), [
    (b"", BadMagic, "0 bytes"),
    (b"done:req-1", BadMagic, "b'done:req"),
    (MAGIC + b"\x92\x01", MalformedMessage, "notification"),
    (encode_notif(ReadDone("r", "d", 0, 1, True))[:-2], MalformedMessage, "truncated"),
    (MAGIC + msgspec.msgpack.encode({"version": V + 1, "done": GOOD_NOTE}), VersionMismatch,
     f"protocol {V + 1}"),
    (MAGIC + msgspec.msgpack.encode({"version": V, "done": {**GOOD_NOTE, "x": 1}}),
     MalformedMessage, "`x`"),
    (MAGIC + msgspec.msgpack.encode({"version": V, "done": {**GOOD_NOTE, "ok": "yes"}}),
     MalformedMessage, "ok"),
    (MAGIC + msgspec.msgpack.encode({"version": V, "done": {**GOOD_NOTE,
                                                            "expected_readers": 0}}),
     MalformedMessage, "expected_readers must be positive, got 0"),
    (MAGIC + msgspec.msgpack.encode({"version": V, "done": {**GOOD_NOTE, "request_id": ""}}),
     MalformedMessage, "request_id"),
    (MAGIC + msgspec.msgpack.encode({"version": V, "done": {**GOOD_NOTE, "reader_rank": -3}}),
     MalformedMessage, "reader_rank must not be negative, got -3"),
    (MAGIC + msgspec.msgpack.encode({"version": V, "done": {**GOOD_NOTE,
                                                            "reader_engine_id": ""}}),
     MalformedMessage, "reader_engine_id"),
], ids=["empty", "text", "array", "truncated", "version", "extra-field", "bool-type",
        "zero-readers", "empty-request-id", "negative-rank", "empty-reader"])
def test_garbage_notifications_raise_protocol_errors(raw: bytes, error: type[ProtocolError],
                                                     named: str) -> None:
    with pytest.raises(error) as info:
        decode_notif(raw, peer="agent decode-b-rank0")
    assert named in str(info.value) and "agent decode-b-rank0" in str(info.value)


# -- fuzzing: nothing but ProtocolError escapes ---------------------------------------------

GOOD_WIRE = encode_message(RESPONSE, compat=COMPAT, hmac_key=KEY)


def _decode_all_the_way(raw: bytes) -> None:
    envelope = decode(raw, hmac_key=KEY, local_compat=COMPAT)
    decode_payload(envelope, MetadataResponse, peer=PEER)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256) | st.binary(max_size=64).map(lambda b: MAGIC + b))
def test_arbitrary_bytes_raise_only_protocol_errors(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        _decode_all_the_way(raw)
    with pytest.raises(ProtocolError):
        decode_notif(raw)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(GOOD_WIRE) - 1), st.integers(1, 255))
def test_corrupted_messages_raise_only_protocol_errors(position: int, flip: int) -> None:
    raw = bytearray(GOOD_WIRE)
    raw[position] ^= flip
    with pytest.raises(ProtocolError):  # signed: every change is caught somewhere
        _decode_all_the_way(bytes(raw))


def test_every_truncation_raises_a_protocol_error() -> None:
    for cut in range(len(GOOD_WIRE)):
        with pytest.raises(ProtocolError):
            _decode_all_the_way(GOOD_WIRE[:cut])


def test_protocol_errors_are_handshake_errors() -> None:
    assert issubclass(ProtocolError, SideChannelError)
    for error in (BadMagic, VersionMismatch, HashMismatch, BadSignature, MalformedMessage):
        assert issubclass(error, ProtocolError)


# -- the compatibility hash -----------------------------------------------------------------

def test_hash_is_stable() -> None:
    again = CompatInfo(model="llama-3-8b", dtype="bfloat16", cache_dtype="bfloat16",
                       head_size=64, total_kv_heads=4, num_layers=4)
    assert compat_hash(again) == HASH
    assert len(HASH) == 64 and int(HASH, 16) >= 0
    # Pinned (protocol 15): a change here changes the wire, so it needs a version bump.
    assert HASH == "80f1c82a648200c96ab808a8e83235b206b56d22e7ab63c27b1e5b7f18ced781"


@pytest.mark.parametrize(("field", "value"), [
    ("model", "llama-3-70b"), ("dtype", "float16"), ("cache_dtype", "fp8_e4m3"),
    ("head_size", 128), ("total_kv_heads", 8), ("num_layers", 32),
    ("protocol_version", KVXFER_PROTOCOL_VERSION + 1),
])
def test_every_field_changes_the_hash(field: str, value: object) -> None:
    changed = msgspec.structs.replace(COMPAT, **{field: value})
    assert compat_hash(changed) != HASH
    assert compat_diff(COMPAT, changed) == (FieldDiff(field, getattr(COMPAT, field), value),)


def test_the_kv_packing_is_negotiated_not_hashed() -> None:
    """Peers that pack K and V differently still talk: the decode converts."""
    changed = msgspec.structs.replace(COMPAT, kv_packing="vllm-cpu-vec")
    assert compat_hash(changed) == HASH and compat_diff(COMPAT, changed) == ()
    assert meta().kv_packing == "token"


@pytest.mark.parametrize("name", ["tp_size", "block_size", "layout"])
def test_tp_size_block_size_and_layout_are_not_hashed(name: str) -> None:
    assert name not in CompatInfo.__struct_fields__
    with pytest.raises(TypeError, match=name):
        CompatInfo(model="m", dtype="bfloat16", cache_dtype="bfloat16", head_size=64,
                   total_kv_heads=4, num_layers=4, **{name: 2})  # type: ignore[call-arg]


def test_protocol_version_defaults_to_the_current_one() -> None:
    assert COMPAT.protocol_version == KVXFER_PROTOCOL_VERSION == 15


@pytest.mark.parametrize("packing", ["rows", "", "vllm-cpu-", "tile"])
def test_kv_packing_is_token_or_a_vllm_cpu_isa(packing: str) -> None:
    assert COMPAT.kv_packing == "token"
    assert msgspec.structs.replace(COMPAT, kv_packing="vllm-cpu-amx").kv_packing == "vllm-cpu-amx"
    with pytest.raises(ValueError, match="kv_packing must be 'token' or 'vllm-cpu-<isa>'"):
        msgspec.structs.replace(COMPAT, kv_packing=packing)


# -- releases: no hash check, every other check -----------------------------------------------

def test_release_kinds_are_the_hash_free_ones() -> None:
    assert {MessageKind.RELEASE, MessageKind.RELEASE_ACK, MessageKind.RENEW,
            MessageKind.RENEW_ACK, MessageKind.DONE} == HASH_FREE_KINDS


@pytest.mark.parametrize("message", [RELEASE, ACK], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_a_release_from_another_model_is_accepted(message: Any, key: bytes | None) -> None:
    """The decode whose handshake was refused for a model mismatch must still release."""
    raw = encode_message(message, compat=OTHER, hmac_key=key)
    envelope = decode(raw, hmac_key=key, local_compat=COMPAT)
    assert envelope.compat_hash == compat_hash(OTHER) != HASH
    assert decode_payload(envelope, type(message), peer=PEER) == message


def test_a_metadata_message_labelled_as_a_release_is_still_malformed() -> None:
    """The exemption follows the kind, so a request disguised as a release gets nowhere."""
    raw = forge(envelope_dict(REQUEST, kind="release", compat_hash=compat_hash(OTHER),
                              sender=builtins(OTHER)))
    envelope = decode(raw)
    with pytest.raises(MalformedMessage, match="malformed release") as info:
        decode_payload(envelope, ReleaseLease, peer=PEER)
    assert PEER in str(info.value)
    with pytest.raises(MalformedMessage, match="expected a metadata_request, found a release"):
        decode_payload(envelope, MetadataRequest, peer=PEER)


def test_without_an_expected_hash_no_kind_is_hash_checked() -> None:
    """A release's client reads the reply (an ack or a refusal) from any model."""
    refusal = ErrorReply(ErrorCode.BAD_SIGNATURE, "unsigned")
    envelope = decode(encode_message(refusal, compat=OTHER), expected_hash=None)
    assert decode_payload(envelope, ErrorReply) == refusal
    with pytest.raises(HashMismatch):
        decode(encode_message(refusal, compat=OTHER))


def test_a_release_of_another_version_is_refused() -> None:
    raw = forge(envelope_dict(RELEASE, version=KVXFER_PROTOCOL_VERSION + 1))
    with pytest.raises(VersionMismatch) as info:
        decode(raw)
    assert f"speaks kvxfer protocol {KVXFER_PROTOCOL_VERSION + 1}" in str(info.value)
    assert PEER in str(info.value)


def test_a_garbled_release_is_refused() -> None:
    raw = encode_message(RELEASE, compat=COMPAT)
    with pytest.raises(BadMagic, match="XKVF"):
        decode(b"XKVF" + raw[4:])
    with pytest.raises(MalformedMessage, match="malformed envelope"):
        decode(raw[:-5])


@pytest.mark.parametrize("compat", [COMPAT, OTHER], ids=["same-model", "other-model"])
def test_an_unsigned_or_wrongly_signed_release_is_refused_when_a_key_is_set(
        compat: CompatInfo) -> None:
    with pytest.raises(BadSignature, match="unsigned message") as info:
        decode(encode_message(RELEASE, compat=compat), hmac_key=KEY)
    assert PEER in str(info.value)
    with pytest.raises(BadSignature, match="does not verify"):
        decode(encode_message(RELEASE, compat=compat, hmac_key=b"guess"), hmac_key=KEY)


def test_tampering_with_a_signed_release_is_refused() -> None:
    good = msgspec.msgpack.decode(encode_message(RELEASE, compat=OTHER, hmac_key=KEY)[4:])
    other_lease = msgspec.msgpack.encode(ReleaseLease("req-8@4", "decode-b", "x"))
    with pytest.raises(BadSignature, match="does not verify"):
        decode(forge({**good, "payload": other_lease}), hmac_key=KEY)


GOOD_RELEASE_WIRE = encode_message(RELEASE, compat=OTHER, hmac_key=KEY)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(GOOD_RELEASE_WIRE) - 1), st.integers(1, 255))
def test_corrupted_releases_raise_only_protocol_errors(position: int, flip: int) -> None:
    raw = bytearray(GOOD_RELEASE_WIRE)
    raw[position] ^= flip
    with pytest.raises(ProtocolError):  # signed: every change is caught somewhere
        envelope = decode(bytes(raw), hmac_key=KEY, local_compat=COMPAT)
        decode_payload(envelope, ReleaseLease, peer=PEER)


def test_an_anonymous_error_reply_names_no_model_and_only_an_error_may_be_one() -> None:
    raw = encode_message(ErrorReply(ErrorCode.BAD_SIGNATURE, "authentication failed"),
                         compat=COMPAT, hmac_key=b"k" * 32, anonymous=True)
    assert HASH.encode() not in raw and COMPAT.model.encode() not in raw
    envelope = decode(raw, hmac_key=b"k" * 32, local_compat=OTHER)  # no hash is checked
    assert (envelope.compat_hash, envelope.sender) == (ANONYMOUS_HASH, None)
    assert decode_payload(envelope, ErrorReply).message == "authentication failed"
    with pytest.raises(ValueError, match="only an error reply may be anonymous"):
        encode_message(REQUEST, compat=COMPAT, anonymous=True)
    blank = forge(envelope_dict(compat_hash=ANONYMOUS_HASH, sender=None))
    with pytest.raises(HashMismatch):  # a request without a hash is not anonymous
        decode(blank)
