"""Trust, with real processes: sidecars sharing a kv key refuse forged, altered, expired
and replayed leases, forged releases and "done" notifications and unauthenticated
metadata requests; a decode that waits renews its lease; no block leaks.

Every sidecar is a real ``kvxfer serve`` process (``tests/sidecars.py``) with
``--kv-key-file``; the attacker is this test process, speaking real ZMQ and real
NIXL. Each test ends with every sidecar's blocks free.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from sidecars import ROOT, Sidecar, SidecarGroup, Spec, prefill_body, write_key

from kvxfer.harness import preloaded
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.failures import PeerRefused
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.envelope import decode_envelope, decode_payload, encode_message
from kvxfer.wire.messages import ErrorReply, MetadataRequest, MetadataResponse, RenewAck, RenewLease
from kvxfer.wire.notification import ReadDone, encode_notif
from kvxfer.wire.protocol_errors import AUTH_FAILED, BadSignature, ErrorCode
from kvxfer.wire.tickets import LeaseClaims, sign_ticket
from proxy.contract import decode_request, parse_prefill_answer

COMPLETIONS = "/v1/completions"
HOST = "127.0.0.1"
BODY: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": True}
SMALL_BLOCKS = 8  # the waiting decode: 128 tokens of cache
# Any CompatInfo will do for an attacker: the listener checks the key before the hash.
STRANGER = CompatInfo(model="x", dtype="float32", cache_dtype="float32", head_size=8,
                      total_kv_heads=1, num_layers=1)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[dict[str, Sidecar]]:
    other_key = write_key(tmp_path_factory.mktemp("other") / "kv.key")
    keyed = ("--kv-key-file", str(key_file))
    with SidecarGroup(tmp_path_factory.mktemp("trust")) as group:
        names = ["prefill", "short", "decode", "small", "wrong", "recompute"]
        started = group.start([
            Spec("prefill", extra=keyed),
            Spec("prefill", num_blocks=16,
                 extra=(*keyed, "--lease-ttl", "0.5", "--lease-max-age", "10")),
            Spec("decode", policy="fail", extra=keyed),
            Spec("decode", policy="fail", num_blocks=SMALL_BLOCKS, extra=keyed),
            Spec("decode", policy="fail", extra=("--kv-key-file", str(other_key))),
            Spec("decode", policy="recompute", extra=keyed),
        ])
        yield dict(zip(names, started, strict=True))


def idle(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0)


@pytest.fixture(autouse=True)
def no_leaked_blocks(rig: dict[str, Sidecar]) -> Iterator[None]:
    """0 leaked blocks on every sidecar after each test."""
    yield
    for sidecar in rig.values():
        sidecar.wait_for("every block free and no lease held", idle, timeout=20)


def lease(prefill: Sidecar, prompt: str) -> dict[str, Any]:
    """Prefill ``prompt`` as the proxy does; the params of the lease it now holds."""
    answer = prefill.post(COMPLETIONS, prefill_body({**BODY, "prompt": prompt}))
    assert answer.status_code == 200, answer.text
    return parse_prefill_answer(answer.content, prefill.url)


def decode(sidecar: Sidecar, prompt: str, params: dict[str, Any]) -> httpx.Response:
    return sidecar.post(COMPLETIONS, decode_request({**BODY, "prompt": prompt}, params))


def reference(prefill: Sidecar, prompt: str) -> dict[str, Any]:
    """The single-instance answer (a prefill serves plain requests itself)."""
    answer = prefill.post(COMPLETIONS, {**BODY, "prompt": prompt})
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["choices"][0])


def same(answer: httpx.Response, want: dict[str, Any]) -> bool:
    assert answer.status_code == 200, answer.text
    got = answer.json()["choices"][0]
    return bool(got["text"] == want["text"]
                and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
                and all(abs(a - b) < 1e-4 for a, b in zip(
                    got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"],
                    strict=True)))


def refused(answer: httpx.Response, named: str) -> None:
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"]["message"], answer.text


def still_held(prefill: Sidecar, params: dict[str, Any]) -> None:
    """The prefill still holds the lease and its blocks (checked after a barrier request,
    which is answered only after the loop took every queued release)."""
    barrier = prefill.post(COMPLETIONS, {"prompt": "barrier", "max_tokens": 1})
    assert barrier.status_code == 200, barrier.text
    health = prefill.health()
    assert health["leases"] == 1, health
    assert health["used_blocks"] == len(params["remote_block_ids"]), health


# -- forged and altered reads ----------------------------------------------------------------

def test_a_forged_read_is_refused_and_the_victim_answer_is_unchanged(
        rig: dict[str, Sidecar]) -> None:
    prefill, dec = rig["prefill"], rig["decode"]
    prompt = "the victim's prompt about a secret plan"
    want = reference(prefill, prompt)
    victim = lease(prefill, prompt)
    forged = {k: v for k, v in victim.items() if k != "lease_ticket"}
    forged["remote_request_id"] = "made-up-request@1"
    refused(decode(dec, prompt, forged), "lease_ticket is missing")
    refused(decode(dec, prompt, {**forged, "lease_ticket": victim["lease_ticket"]}),
            "does not verify")
    still_held(prefill, victim)
    assert same(decode(dec, prompt, victim), want)


ALTERATIONS: dict[str, Any] = {
    "block ids": lambda p: {"remote_block_ids": [b + 1 for b in p["remote_block_ids"]]},
    "token count": lambda p: {"remote_num_tokens": p["remote_num_tokens"] + 1},
    "engine": lambda p: {"remote_engine_id": "prefill-000000000000"},
    "port": lambda p: {"remote_port": p["remote_port"] + 1},
    "host": lambda p: {"remote_host": "localhost"},
    "later expiry": lambda p: {"lease_expires_at": p["lease_expires_at"] + 3600},
}


def test_an_altered_ticket_is_refused(rig: dict[str, Sidecar]) -> None:
    prefill, dec = rig["prefill"], rig["decode"]
    prompt = "a prompt whose params someone alters"
    want = reference(prefill, prompt)
    victim = lease(prefill, prompt)
    for name, change in ALTERATIONS.items():
        answer = decode(dec, prompt, {**victim, **change(victim)})
        assert answer.status_code == 400, f"{name}: {answer.text}"
        message = answer.json()["error"]["message"]
        assert "does not verify" in message or "remote_num_tokens" in message, (name, message)
    still_held(prefill, victim)
    assert same(decode(dec, prompt, victim), want)


def read_then_lease_another(prefill: Sidecar, dec: Sidecar, prompt: str, other_prompt: str
                            ) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """``prompt``'s lease read (and released) by ``dec``, then another lease, likely in the
    same blocks: (the used params, the new lease's params, its reference answer)."""
    want = reference(prefill, prompt)
    params = lease(prefill, prompt)
    assert same(decode(dec, prompt, params), want)
    prefill.wait_for("the lease released", idle)
    other_want = reference(prefill, other_prompt)
    return params, lease(prefill, other_prompt), other_want


def test_a_prefill_releases_a_lease_only_for_params_it_signed(rig: dict[str, Sidecar]) -> None:
    """``POST /v1/kv/release`` (what the proxy sends when no decode took a request):
    altered or ticket-less params end nothing; the params as handed out end the lease."""
    prefill = rig["prefill"]
    params = lease(prefill, "a prompt whose params someone tries to release")
    for forged in ({**params, "remote_block_ids": [b + 1 for b in params["remote_block_ids"]]},
                   {k: v for k, v in params.items() if k != "lease_ticket"}):
        answer = prefill.post("/v1/kv/release", {"kv_transfer_params": forged})
        assert answer.status_code == 400, answer.text
        assert "does not verify" in answer.text or "is missing" in answer.text, answer.text
    still_held(prefill, params)
    answer = prefill.post("/v1/kv/release", {"kv_transfer_params": params})
    assert answer.status_code == 200 and answer.json() == {"released": True}, answer.text
    prefill.wait_for("the lease released", idle, timeout=10)


def test_a_replayed_ticket_is_refused(rig: dict[str, Sidecar]) -> None:
    prefill, dec = rig["prefill"], rig["decode"]
    prompt, other_prompt = ("a prompt read once and replayed",
                            "someone else's prompt, in the blocks a replay would read")
    params, other, other_want = read_then_lease_another(prefill, dec, prompt, other_prompt)
    refused(decode(dec, prompt, params), "already used")
    refused(decode(dec, prompt, params), "already used")
    still_held(prefill, other)
    assert same(decode(dec, other_prompt, other), other_want)


def test_params_replayed_to_a_second_decode_are_refused_there(rig: dict[str, Sidecar]) -> None:
    """The params one decode read, sent to another decode (as to this one after a restart:
    a new engine id) once the prefill freed their blocks for another lease: the prefill
    refuses the second claim, nothing is read, the other lease's answer is unchanged."""
    prefill, dec, second = rig["prefill"], rig["decode"], rig["small"]
    prompt, other_prompt = ("a prompt read by one decode and replayed to another",
                            "someone else's prompt, in the blocks the second decode would read")
    params, other, other_want = read_then_lease_another(prefill, dec, prompt, other_prompt)
    refused(decode(second, prompt, params), "refused this decode's claim")
    still_held(prefill, other)
    assert same(decode(dec, other_prompt, other), other_want)


def test_a_lease_another_decode_claimed_is_not_read(rig: dict[str, Sidecar],
                                                    key: bytes) -> None:
    """Another decode (here: this test, with the key) claimed the lease first: this
    decode's claim is refused, it neither reads nor releases, and only the claimer can
    end the lease early."""
    prefill, dec = rig["prefill"], rig["decode"]
    prompt = "a prompt whose lease another decode claimed first"
    params = lease(prefill, prompt)
    port, lease_id = params["remote_port"], params["remote_request_id"]
    with SideChannelClient("decode-first0000000", STRANGER, hmac_key=key) as first:
        assert first.renew(HOST, port, lease_id, claim=True).found
        refused(decode(dec, prompt, params), "another decode claimed it first")
        still_held(prefill, params)
        assert first.release(HOST, port, lease_id, "the claimer will not read it either")


def test_an_expired_ticket_is_refused(rig: dict[str, Sidecar]) -> None:
    short, dec = rig["short"], rig["decode"]
    prompt = "a prompt whose lease ran out"
    params = lease(short, prompt)
    short.wait_for("the 0.5 s lease expired", idle, timeout=10)
    refused(decode(dec, prompt, params), "in the past")
    fresh = lease(short, prompt)
    refused(decode(dec, prompt, {**fresh, "lease_expires_at": 0}), "does not verify")
    short.wait_for("the lease expired", idle, timeout=10)


RECOMPUTES = "kvxfer_kv_recomputes_total"


def test_under_recompute_a_lease_that_cannot_be_read_is_recomputed_and_a_forged_one_refused(
        rig: dict[str, Sidecar], key: bytes) -> None:
    """Policy ``recompute``: a genuine lease that expired (a request that waited in a
    queue) and one another decode claimed first are not read, and each request is
    answered as one instance answers it; forged or altered params still get a 400."""
    short, prefill, rec = rig["short"], rig["prefill"], rig["recompute"]
    prompt = "a prompt that waited in a queue past its lease"
    want = reference(short, prompt)
    before = rec.metric(RECOMPUTES)
    expired = lease(short, prompt)
    short.wait_for("the 0.5 s lease expired", idle, timeout=10)
    assert same(decode(rec, prompt, expired), want)
    refused(decode(rec, prompt, {**expired, "lease_expires_at": expired["lease_expires_at"]
                                 + 3600}), "does not verify")
    refused(decode(rec, prompt, {k: v for k, v in expired.items() if k != "lease_ticket"}),
            "lease_ticket is missing")
    claimed = lease(prefill, prompt)
    port, lease_id = claimed["remote_port"], claimed["remote_request_id"]
    with SideChannelClient("decode-first0000000", STRANGER, hmac_key=key) as first:
        assert first.renew(HOST, port, lease_id, claim=True).found
        assert same(decode(rec, prompt, claimed), reference(prefill, prompt))
        still_held(prefill, claimed)
        assert first.release(HOST, port, lease_id, "the claimer will not read it either")
    assert rec.metric(RECOMPUTES) == before + 2


def test_a_decode_with_another_key_refuses_the_ticket(rig: dict[str, Sidecar],
                                                      key: bytes) -> None:
    prefill, wrong, dec = rig["prefill"], rig["wrong"], rig["decode"]
    prompt = "a prompt the wrong decode must not read"
    want = reference(prefill, prompt)
    params = lease(prefill, prompt)
    refused(decode(wrong, prompt, params), "does not verify")
    still_held(prefill, params)  # and it did not release it either
    assert same(decode(dec, prompt, params), want)


# -- the side channel ------------------------------------------------------------------------

def raw_exchange(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send(raw)
        assert sock.poll(int(timeout * 1000)), "the listener did not answer"
        [reply] = sock.recv_multipart()
        return reply
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("attacker_key", [None, b"guess" * 8], ids=["unsigned", "wrong-key"])
def test_an_unauthenticated_metadata_request_gets_nothing_usable(
        rig: dict[str, Sidecar], attacker_key: bytes | None) -> None:
    prefill = rig["prefill"]
    port = prefill.health()["side_channel_port"]
    request = encode_message(MetadataRequest("attacker", (0,)), compat=STRANGER,
                             hmac_key=attacker_key)
    reply = raw_exchange(port, request)
    envelope = decode_envelope(reply, expected_hash=None, peer="prefill")
    assert envelope.sender is None, "the model is not told"
    answer = decode_payload(envelope, ErrorReply)
    assert (answer.code, answer.message) == (ErrorCode.BAD_SIGNATURE, AUTH_FAILED)
    assert b"UCX" not in reply and len(reply) < 300, "no NIXL agent blob in the answer"


def test_a_wrong_key_handshake_is_refused(rig: dict[str, Sidecar]) -> None:
    port = rig["prefill"].health()["side_channel_port"]
    with SideChannelClient("attacker", STRANGER, hmac_key=b"guess" * 8) as attacker, \
            pytest.raises(BadSignature):  # refused, and the refusal is not signed for us
        attacker.fetch(HOST, port, [0], timeout=5.0, retries=0)


@pytest.mark.parametrize("attacker_key", [None, b"guess" * 8], ids=["unsigned", "wrong-key"])
def test_a_forged_release_is_refused_and_the_victim_answer_is_unchanged(
        rig: dict[str, Sidecar], attacker_key: bytes | None) -> None:
    prefill, dec = rig["prefill"], rig["decode"]
    prompt = f"a victim whose lease someone releases ({attacker_key is None})"
    want = reference(prefill, prompt)
    victim = lease(prefill, prompt)
    with SideChannelClient("attacker", STRANGER, hmac_key=attacker_key) as attacker, \
            pytest.raises((PeerRefused, BadSignature)) as info:
        attacker.release(HOST, victim["remote_port"], victim["remote_request_id"], "forged")
    if isinstance(info.value, PeerRefused):
        assert info.value.reason == AUTH_FAILED
    still_held(prefill, victim)
    assert same(decode(dec, prompt, victim), want)


def test_a_forged_done_notification_is_ignored(rig: dict[str, Sidecar], key: bytes) -> None:
    """The attacker has the prefill's agent metadata (the side channel is not encrypted,
    so assume it was sniffed); its unsigned and wrongly signed "done" notifications
    reach the prefill, which ignores them."""
    from kvxfer.transfer.nixl_agent import NixlAgent

    prefill, dec = rig["prefill"], rig["decode"]
    prompt = "a victim whose lease someone says is done"
    want = reference(prefill, prompt)
    victim = lease(prefill, prompt)
    blob = _sniffed_blob(key, victim["remote_port"])
    before = prefill.log_path.read_text(errors="replace").count("ignoring a notification")
    with NixlAgent(f"attacker-{os.getpid()}") as agent:
        name = agent.add_remote(blob)
        agent.connect(name)
        for attacker_key in (None, b"guess" * 8):
            for reader in range(2):
                done = ReadDone(victim["remote_request_id"], "decode-attacker", reader, 1, True)
                agent.send_notif(name, encode_notif(done, attacker_key))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            agent.progress()
            text = prefill.log_path.read_text(errors="replace")
            if text.count("ignoring a notification") >= before + 4:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the forged notifications never reached the prefill")
    still_held(prefill, victim)
    assert same(decode(dec, prompt, victim), want)


def _sniffed_blob(key: bytes, port: int) -> bytes:
    """Rank 0's NIXL agent blob, fetched with the key (what an observer of a real
    handshake sees): a first request learns the prefill's CompatInfo from the hash
    mismatch it is refused with, a second one gets the metadata."""
    request = encode_message(MetadataRequest("sniffed", (0,)), compat=STRANGER, hmac_key=key)
    envelope = decode_envelope(raw_exchange(port, request), expected_hash=None,
                               peer="prefill", hmac_key=key)
    assert envelope.sender is not None, "a key holder is told the model"
    real = encode_message(MetadataRequest("sniffed", (0,)), compat=envelope.sender,
                          hmac_key=key)
    envelope = decode_envelope(raw_exchange(port, real), expected_hash=None, peer="prefill",
                               hmac_key=key)
    return decode_payload(envelope, MetadataResponse).ranks[0].agent_blob


# -- renewal ---------------------------------------------------------------------------------

def test_a_waiting_decode_renews_its_lease_and_answers_right(rig: dict[str, Sidecar],
                                                             key: bytes) -> None:
    """A 0.5 s lease; the decode has no free blocks for 2 s (a filler request holds 7 of
    its 8 blocks, stuck in a handshake with a side channel this test answers late)
    while other prompts churn the prefill's cache. The decode renews, reads intact
    blocks, and answers exactly as a single instance does."""
    short, small = rig["short"], rig["small"]
    prompt = "a prompt that waits for decode blocks longer than its lease"
    want = reference(short, prompt)
    expired = short.metric("kvxfer_kv_leases_released_total", reason="expired")
    done = short.metric("kvxfer_kv_leases_released_total", reason="done")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    hole = ctx.socket(zmq.ROUTER)
    hole.setsockopt(zmq.LINGER, 0)
    port = hole.bind_to_random_port(f"tcp://{HOST}")
    try:
        filler = _filler_params(key, port)
        results: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda: results.__setitem__("filler", small.post(
            COMPLETIONS, {**BODY, "prompt": list(range(1, 101)), "max_tokens": 1,
                          "kv_transfer_params": filler})))]
        threads[0].start()
        _grant_claim(hole, key)
        assert hole.poll(20_000), "the filler's handshake never came"
        identity, _request = hole.recv_multipart()
        small.wait_for("the filler holds 7 blocks", lambda h: h["used_blocks"] == 7)
        params = lease(short, prompt)
        threads.append(threading.Thread(target=lambda: results.__setitem__(
            "victim", decode(small, prompt, params))))
        threads[1].start()
        started, i = time.monotonic(), 0
        while time.monotonic() - started < 2.0:  # four lease TTLs, the prefill's blocks reused
            # 3 blocks each: with the victim's lease they fit the prefill's 16 at once
            churn = short.post(COMPLETIONS, {"prompt": f"churn {i % 10} " * 6, "max_tokens": 1})
            assert churn.status_code == 200, churn.text
            i += 1
            time.sleep(0.02)
        assert "victim" not in results, "the decode did not wait"
        identities = [identity]
        while hole.poll(0):  # a retry of the handshake, if the first attempt timed out
            identities.append(hole.recv_multipart()[0])
        for each in identities:
            hole.send_multipart([each, b"not a kvxfer answer"])  # the filler fails: 502
        for thread in threads:
            thread.join(30)
    finally:
        hole.close()
        ctx.term()
    assert results["filler"].status_code == 502, results["filler"].text
    assert same(results["victim"], want)
    assert short.metric("kvxfer_kv_leases_released_total", reason="expired") == expired, \
        "the lease was renewed, never expired"
    assert short.metric("kvxfer_kv_leases_released_total", reason="done") == done + 1


def _grant_claim(hole: zmq.Socket[bytes], key: bytes) -> None:
    """Answer the filler's claim of its fake lease as a prefill would: granted."""
    assert hole.poll(20_000), "the filler's claim never came"
    identity, request = hole.recv_multipart()
    envelope = decode_envelope(request, expected_hash=None, peer="decode", hmac_key=key)
    claim = decode_payload(envelope, RenewLease)
    assert claim.claim, claim
    hole.send_multipart([identity, encode_message(RenewAck(claim.lease_id, True, 60.0),
                                                  compat=STRANGER, hmac_key=key)])


def _filler_params(key: bytes, port: int) -> dict[str, Any]:
    """Signed params for a lease of a fake prefill (this test holds the key)."""
    claims = LeaseClaims("prefill-fake00000000", HOST, port, secrets.token_urlsafe(16),
                         tuple(range(7)), 100, 1, time.time() + 60)
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": claims.engine_id, "remote_host": HOST, "remote_port": port,
            "remote_block_ids": list(claims.block_ids), "remote_request_id": claims.lease_id,
            "remote_num_tokens": 100, "tp_size": 1, "lease_expires_at": claims.expires_at,
            "lease_ticket": sign_ticket(key, claims)}



# -- start-up ----------------------------------------------------------------------------------

def serve_with_key_file(path: Path, env: dict[str, str] | None = None
                        ) -> subprocess.CompletedProcess[str]:
    """``kvxfer serve`` in a process of its own (forked preloaded)."""
    args = ["serve", "--role", "prefill", "--port", "0"]
    if not env:
        args += ["--kv-key-file", str(path)]
    return preloaded.run("kvxfer.cli", args, ROOT, {**os.environ, **(env or {})}, 120)


@pytest.mark.parametrize("case, content, mode, named", [
    ("missing", None, 0o600, "cannot be read"),
    ("empty", b"\n", 0o600, "is empty"),
    ("short", b"abc", 0o600, "at least 16"),
    ("world-readable", b"k" * 32, 0o644, "chmod 600"),
])
def test_a_bad_key_file_stops_serve_at_start_up(tmp_path: Path, case: str,
                                                content: bytes | None, mode: int,
                                                named: str) -> None:
    path = tmp_path / "kv.key"
    if content is not None:
        path.write_bytes(content)
        path.chmod(mode)
    for env in (None, {"KVXFER_KV_KEY_FILE": str(path)}):
        done = serve_with_key_file(path, env)
        assert done.returncode == 2, (case, done.stdout, done.stderr)
        assert "kvxfer serve: error: kv key file" in done.stderr and named in done.stderr, \
            (case, done.stderr)


def test_without_a_key_the_side_channel_warns_at_start_up(tmp_path: Path) -> None:
    with SidecarGroup(tmp_path) as group:
        [prefill] = group.start([Spec("prefill")])
        log = prefill.log_path.read_text(errors="replace")
    assert "no --kv-key-file" in log and "unauthenticated" in log, log
