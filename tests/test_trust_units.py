"""Unit tests of the pure trust parts: replay refusal, signed notifications, lease
tickets, the decode's lease book and renewal arithmetic, and key files."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import msgspec
import pytest

from kvxfer.net.kv_key import MIN_KEY_BYTES, KvKeyError, key_file_from, load_kv_key, mode_problem
from kvxfer.wire import replay
from kvxfer.wire.compat import CompatInfo, compat_hash
from kvxfer.wire.envelope import decode_envelope, encode_message
from kvxfer.wire.lease_book import HeldLease, LeaseBook, LeaseRefused
from kvxfer.wire.messages import MetadataRequest
from kvxfer.wire.notification import ReadDone, decode_notif, encode_notif
from kvxfer.wire.params import RemoteParams
from kvxfer.wire.protocol_errors import BadSignature
from kvxfer.wire.replay import ReplayedMessage, ReplayGuard
from kvxfer.wire.tickets import TICKET_PREFIX, LeaseClaims, TicketError, sign_ticket, verify_ticket
from kvxfer.wire.version import MAGIC

KEY = b"k" * 32
COMPAT = CompatInfo(model="m", dtype="float32", cache_dtype="float32", head_size=8,
                    total_kv_heads=2, num_layers=2)
PEER = "tcp://10.0.0.9:1"
NOW = 1_800_000_000.0
CLAIMS = LeaseClaims("prefill-abc", "127.0.0.1", 5600, "Zq3-lease", (4, 9, 2), 40, 1, NOW + 60)


def decode(raw: bytes, **kw: object) -> object:
    return decode_envelope(raw, expected_hash=compat_hash(COMPAT), peer=PEER, hmac_key=KEY,
                           **kw)  # type: ignore[arg-type]


# -- replays of side-channel messages --------------------------------------------------------

def test_a_replayed_signed_message_is_refused() -> None:
    guard = ReplayGuard()
    raw = encode_message(MetadataRequest("decode-b", (0,)), compat=COMPAT, hmac_key=KEY)
    decode(raw, replay=guard)
    with pytest.raises(ReplayedMessage, match="nonce was seen already") as info:
        decode(raw, replay=guard)
    assert isinstance(info.value, BadSignature), "a listener answers it as any auth failure"


def test_two_messages_have_different_nonces() -> None:
    guard = ReplayGuard()
    for _ in range(3):
        decode(encode_message(MetadataRequest("decode-b", (0,)), compat=COMPAT, hmac_key=KEY),
               replay=guard)


@pytest.mark.parametrize("offset", [-31.0, 31.0, float("nan")])
def test_a_stale_or_future_message_is_refused(offset: float) -> None:
    guard = ReplayGuard()
    with pytest.raises(ReplayedMessage, match="timestamp"):
        guard.check(os.urandom(16), NOW + offset, peer=PEER, now=NOW)


def test_a_stale_message_is_refused_even_without_a_guard(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that passes no ReplayGuard still refuses a message older than the
    freshness window: the receiver's clock moves 31 s past the message's signed time."""
    raw = encode_message(MetadataRequest("decode-b", (0,)), compat=COMPAT, hmac_key=KEY)
    sent = msgspec.msgpack.decode(raw[len(MAGIC):])["timestamp"]
    decode(raw)  # fresh: accepted (no guard, so nothing is remembered)
    monkeypatch.setattr(replay.time, "time", lambda: sent + 31.0)
    with pytest.raises(ReplayedMessage, match="timestamp"):
        decode(raw)


def test_the_timestamp_and_nonce_are_signed() -> None:
    raw = encode_message(MetadataRequest("decode-b", (0,)), compat=COMPAT, hmac_key=KEY)
    good = msgspec.msgpack.decode(raw[len(MAGIC):])
    for field, value in (("timestamp", good["timestamp"] + 1), ("nonce", b"\0" * 16)):
        with pytest.raises(BadSignature, match="does not verify"):
            decode(MAGIC + msgspec.msgpack.encode({**good, field: value}))


def test_unsigned_messages_carry_no_nonce() -> None:
    raw = encode_message(MetadataRequest("decode-b", (0,)), compat=COMPAT)
    body = msgspec.msgpack.decode(raw[len(MAGIC):])
    assert body["signature"] is None and body["nonce"] == b""


def test_the_guard_forgets_old_nonces() -> None:
    guard = ReplayGuard(max_age=1.0)
    nonce = os.urandom(16)
    guard.check(nonce, NOW, peer=PEER, now=NOW)
    guard.check(os.urandom(16), NOW + 5, peer=PEER, now=NOW + 5)  # purges
    assert nonce not in guard._seen


# -- notifications ---------------------------------------------------------------------------

DONE = ReadDone("Zq3-lease", "decode-b", 0, 1, ok=True)


def test_a_signed_notification_round_trips() -> None:
    assert decode_notif(encode_notif(DONE, KEY), hmac_key=KEY) == DONE
    assert decode_notif(encode_notif(DONE, KEY)) == DONE  # no key: signature ignored


@pytest.mark.parametrize("key", [None, b"guess" * 8], ids=["unsigned", "wrong-key"])
def test_a_forged_notification_is_refused(key: bytes | None) -> None:
    with pytest.raises(BadSignature):
        decode_notif(encode_notif(DONE, key), hmac_key=KEY, peer="agent x")


def test_an_altered_notification_is_refused() -> None:
    frame = msgspec.msgpack.decode(encode_notif(DONE, KEY)[len(MAGIC):])
    frame["done"]["request_id"] = "victim-lease"
    with pytest.raises(BadSignature, match="does not verify"):
        decode_notif(MAGIC + msgspec.msgpack.encode(frame), hmac_key=KEY)


# -- tickets ---------------------------------------------------------------------------------

def test_a_ticket_verifies() -> None:
    ticket = sign_ticket(KEY, CLAIMS)
    assert ticket.startswith(TICKET_PREFIX)
    verify_ticket(KEY, CLAIMS, ticket)


ALTERED = {"engine_id": "prefill-other", "host": "10.0.0.1", "port": 5601,
           "lease_id": "made-up", "block_ids": (4, 9, 3), "num_tokens": 41, "tp_size": 2,
           "expires_at": NOW + 61}


@pytest.mark.parametrize("field", list(ALTERED))
def test_an_altered_claim_does_not_verify(field: str) -> None:
    ticket = sign_ticket(KEY, CLAIMS)
    with pytest.raises(TicketError, match="does not verify"):
        verify_ticket(KEY, dataclasses.replace(CLAIMS, **{field: ALTERED[field]}), ticket)


@pytest.mark.parametrize("ticket, match", [(None, "missing"), (7, "not a kvxfer"),
                                           ("abc", "not a kvxfer"),
                                           (TICKET_PREFIX + "AAAA", "does not verify"),
                                           (TICKET_PREFIX + "\udcff", "does not verify")])
def test_a_bad_ticket_is_refused(ticket: object, match: str) -> None:
    with pytest.raises(TicketError, match=match):
        verify_ticket(KEY, CLAIMS, ticket)


def test_another_key_does_not_verify() -> None:
    with pytest.raises(TicketError):
        verify_ticket(b"x" * 32, CLAIMS, sign_ticket(KEY, CLAIMS))


def test_a_ticket_survives_json() -> None:
    params = {"remote_engine_id": CLAIMS.engine_id, "remote_host": CLAIMS.host,
              "remote_port": CLAIMS.port, "remote_request_id": CLAIMS.lease_id,
              "remote_block_ids": list(CLAIMS.block_ids), "remote_num_tokens": 40,
              "tp_size": 1, "lease_expires_at": CLAIMS.expires_at + 0.123456789,
              "lease_ticket": ""}
    claims = dataclasses.replace(CLAIMS, expires_at=params["lease_expires_at"])
    params["lease_ticket"] = sign_ticket(KEY, claims)
    remote = RemoteParams.parse(msgspec.json.decode(msgspec.json.encode(params)))
    verify_ticket(KEY, remote.claims(), remote.lease_ticket)


# -- the decode's lease book -----------------------------------------------------------------

@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "key"])
def test_a_lease_is_claimed_once(key: bytes | None) -> None:
    book = LeaseBook(key)
    ticket = sign_ticket(KEY, CLAIMS)
    held = book.claim(CLAIMS, ticket, now=NOW)
    assert held.ttl == pytest.approx(60)
    with pytest.raises(LeaseRefused, match="already used"):
        book.claim(CLAIMS, ticket, now=NOW + 1)


@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "key"])
@pytest.mark.parametrize("expires", [0.0, NOW - 1, NOW, float("nan"), float("inf")])
def test_an_expired_lease_is_refused(key: bytes | None, expires: float) -> None:
    claims = dataclasses.replace(CLAIMS, expires_at=expires)
    with pytest.raises(LeaseRefused, match="lease_expires_at"):
        LeaseBook(key).claim(claims, sign_ticket(KEY, claims), now=NOW)


def test_with_a_key_a_forged_lease_is_refused_and_not_remembered() -> None:
    book = LeaseBook(KEY)
    with pytest.raises(LeaseRefused, match="lease_ticket is missing"):
        book.claim(CLAIMS, None, now=NOW)
    with pytest.raises(LeaseRefused, match="does not verify"):
        book.claim(CLAIMS, sign_ticket(b"y" * 32, CLAIMS), now=NOW)
    assert book.num_remembered == 0
    book.claim(CLAIMS, sign_ticket(KEY, CLAIMS), now=NOW)  # the real owner still reads it


def test_without_a_key_a_ticket_is_not_needed() -> None:
    LeaseBook(None).claim(CLAIMS, None, now=NOW)


def test_consumed_leases_are_forgotten_after_their_expiry() -> None:
    book = LeaseBook(None)
    book.claim(CLAIMS, None, now=NOW)
    book.claim(dataclasses.replace(CLAIMS, lease_id="other", expires_at=NOW + 120), None,
               now=NOW + 62)
    assert not book.was_claimed(CLAIMS.engine_id, CLAIMS.lease_id)


@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "key"])
@pytest.mark.parametrize("ahead", [1e300, 481.0 + 1.5])
def test_a_lease_beyond_the_maximum_age_is_refused_and_not_remembered(
        key: bytes | None, ahead: float) -> None:
    book = LeaseBook(key, max_age=480.0)
    claims = dataclasses.replace(CLAIMS, expires_at=NOW + ahead)
    with pytest.raises(LeaseRefused, match="maximum lease age"):
        book.claim(claims, sign_ticket(KEY, claims), now=NOW)
    assert book.num_remembered == 0
    book.claim(dataclasses.replace(CLAIMS, expires_at=NOW + 480), None if key is None else
               sign_ticket(KEY, dataclasses.replace(CLAIMS, expires_at=NOW + 480)), now=NOW)


def test_the_lease_book_remembers_a_bounded_number_of_leases() -> None:
    book = LeaseBook(None, max_remembered=2)
    for lease_id in ("a", "b"):
        book.claim(dataclasses.replace(CLAIMS, lease_id=lease_id), None, now=NOW)
    with pytest.raises(LeaseRefused, match="remembers 2"):
        book.claim(dataclasses.replace(CLAIMS, lease_id="c"), None, now=NOW)
    assert book.num_remembered == 2
    book.claim(dataclasses.replace(CLAIMS, lease_id="c", expires_at=NOW + 200), None,
               now=NOW + 62)  # the first two expired: forgotten, room again
    assert book.num_remembered == 1


def test_the_claim_answer_replaces_the_wall_clock_deadline() -> None:
    """The ticket's expiry is 60 s on the prefill's clock, but this decode's clock runs
    50 s ahead: the claim's answer (30 s left) is what counts, measured from its send."""
    lease = HeldLease.from_expiry(NOW + 60, now_wall=NOW + 50, now=0.0)
    assert lease.deadline == pytest.approx(10.0)
    lease.renewed(1.0, 30.0, claim=True)
    assert lease.claimed and lease.deadline == pytest.approx(31.0)


def test_a_read_starts_only_with_enough_of_the_lease_left() -> None:
    lease = HeldLease.from_expiry(NOW + 120, now_wall=NOW, now=0.0)
    assert not lease.readable_for(0.0, 10.0), "not before the claim"
    lease.renewed(0.0, 120.0, claim=True)
    assert lease.readable_for(109.0, 10.0)
    assert not lease.readable_for(110.0, 10.0), "less than the read timeout + margin left"
    short = HeldLease.from_expiry(NOW + 0.5, now_wall=NOW, now=0.0)
    short.renewed(0.0, 0.5, claim=True)
    assert short.readable_for(0.2, 10.0) and not short.readable_for(0.3, 10.0), \
        "a short lease needs what is left at its renewal point (renewed while it reads)"
    short.lost = "refused"
    assert not short.readable_for(0.0, 10.0)


def test_params_without_an_expiry_have_no_claims() -> None:
    remote = RemoteParams("p", "127.0.0.1", 1, (1,), "l", 1)
    with pytest.raises(ValueError, match="lease_expires_at is missing"):
        remote.claims()


# -- renewal arithmetic ----------------------------------------------------------------------

def test_a_held_lease_renews_at_half_its_ttl() -> None:
    lease = HeldLease.from_expiry(NOW + 0.5, now_wall=NOW, now=100.0)
    assert lease.deadline == pytest.approx(100.5)
    assert lease.needs_claim() and not lease.needs_renewal(100.3), "claimed first"
    lease.renewed(100.0, 0.5, claim=True)
    assert not lease.needs_claim()
    assert not lease.needs_renewal(100.2)
    assert lease.needs_renewal(100.3)
    lease.renewing = True
    assert not lease.needs_renewal(100.3), "one renewal at a time"
    lease.renewed(100.3, 0.5)
    assert lease.deadline == pytest.approx(100.8) and not lease.renewing
    assert lease.why_unusable(100.65) is None
    assert "expired" in (lease.why_unusable(100.79) or "")


def test_a_lost_lease_is_never_usable() -> None:
    lease = HeldLease.from_expiry(NOW + 60, now_wall=NOW, now=0.0)
    lease.lost = "the prefill no longer holds it"
    assert lease.why_unusable(1.0) == "the prefill no longer holds it"
    assert not lease.needs_renewal(59.0)


# -- key files -------------------------------------------------------------------------------

def write_key(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "kv.key"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_a_key_file_is_read_without_surrounding_whitespace(tmp_path: Path) -> None:
    assert load_kv_key(write_key(tmp_path, b"  " + b"a" * 64 + b"\n")) == b"a" * 64


@pytest.mark.parametrize("content, mode, match", [
    (b"", 0o600, "is empty"), (b" \n", 0o600, "is empty"),
    (b"short", 0o600, f"at least {MIN_KEY_BYTES}"),
    (b"a" * 64, 0o644, "chmod 600"), (b"a" * 64, 0o604, "accessible by others"),
    (b"a" * 64, 0o660, "writable or executable by its group"),
])
def test_a_bad_key_file_is_refused(tmp_path: Path, content: bytes, mode: int,
                                   match: str) -> None:
    with pytest.raises(KvKeyError, match=match):
        load_kv_key(write_key(tmp_path, content, mode))


@pytest.mark.parametrize("mode, uid, problem", [
    (0o600, 1000, None), (0o400, 1000, None), (0o600, 0, None),
    (0o440, 0, None), (0o640, 0, None),  # root chose the group (a Kubernetes Secret)
    (0o640, 1000, "readable by its group but not owned by root"),
    (0o440, 1000, "readable by its group but not owned by root"),
    (0o444, 0, "accessible by others"), (0o604, 1000, "accessible by others"),
    (0o660, 0, "writable or executable by its group"),
    (0o610, 0, "writable or executable by its group"),
])
def test_who_may_read_a_key_file(mode: int, uid: int, problem: str | None) -> None:
    found = mode_problem(stat.S_IFREG | mode, uid)
    assert found == (None if problem is None else f"is {problem}")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to own a file as root and as another user")
def test_a_root_owned_group_readable_key_file_is_accepted(tmp_path: Path) -> None:
    path = write_key(tmp_path, b"a" * 64, 0o440)
    os.chown(path, 0, 12345)  # root:<fsGroup>, as a Kubernetes Secret volume
    assert load_kv_key(path) == b"a" * 64
    os.chown(path, 65534, 12345)  # the same mode on a file a user owns: refused
    with pytest.raises(KvKeyError, match="not owned by root"):
        load_kv_key(path)


def test_a_missing_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KvKeyError, match="cannot be read"):
        load_kv_key(tmp_path / "nope")
    with pytest.raises(KvKeyError, match="not a regular file"):
        load_kv_key(tmp_path)


def test_the_key_file_comes_from_the_flag_then_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVXFER_KV_KEY_FILE", "/env/key")
    assert key_file_from("/flag/key") == "/flag/key"
    assert key_file_from(None) == "/env/key"
    monkeypatch.delenv("KVXFER_KV_KEY_FILE")
    assert key_file_from(None) is None


def test_crossover_ratio_is_the_geometric_mean_of_phase_medians() -> None:
    from kvxfer.bench.trust import crossover_ratio

    # phase medians 1.1 and 1/1.1: an order effect that cancels
    assert crossover_ratio([[1.0, 1.1, 5.0], [0.1, 1 / 1.1, 1.0]]) == pytest.approx(1.0)
    assert crossover_ratio([[2.0, 2.0], [8.0]]) == pytest.approx(4.0)


def test_the_bootstrap_interval_is_tight_only_when_the_rounds_agree() -> None:
    from kvxfer.bench.trust import bootstrap_interval

    assert bootstrap_interval([[1.0] * 20, [1.0] * 20]) == (1.0, 1.0)
    steady = [[1.004, 0.998, 1.001, 1.0] * 10, [0.999, 1.003, 1.0, 1.002] * 10]
    low, high = bootstrap_interval(steady)
    assert 0.99 < low <= high < 1.01  # a real 0.1% effect under 0.5% noise: resolved
    # phases that disagree by 15%, as two pairs of processes did on a busy 2-core machine
    low, high = bootstrap_interval([[0.90] * 30, [1.24] * 30, [1.09] * 30, [0.99] * 30])
    assert low < 1.0 < 1.02 < high and high - low > 0.1
    assert bootstrap_interval(steady, seed=1) == bootstrap_interval(steady, seed=1)
