"""Push mode between real sidecars: the decode reserves, the prefill WRITEs, the decode
answers as one instance does.

The test drives the pair as a proxy would: ``POST /v1/kv/reserve`` on the decode (started
with ``--kv-transfer-mode push``), the prefill request with the reservation in its
``kv_transfer_params``, then the decode request naming the reservation and the prefill's
first token. Every answer is checked against a single instance (``both``), and both
sidecars end with every block free.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sidecars import (
    ProxyProcess,
    Sidecar,
    SidecarGroup,
    Spec,
    prefill_body,
    start_proxies,
    streamed,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HELD = "kvxfer_kv_reservations_held"
MODEL = "kvxfer-tiny"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "ignore_eos": True}
SEEDED: dict[str, Any] = {"model": MODEL, "temperature": 1.0, "seed": 7, "ignore_eos": True,
                          "logprobs": 2}


@dataclass(frozen=True)
class Trio:
    both: Sidecar
    prefill: Sidecar
    decode: Sidecar
    proxy: ProxyProcess  # --kv-transfer-mode push in front of prefill and decode


@pytest.fixture(scope="module")
def trio(plain: Sidecar, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    """The module's push pair and proxy; the reference is the run's shared ``both``
    (``shared_servers.py``)."""
    log_dir = tmp_path_factory.mktemp("push")
    with SidecarGroup(log_dir) as group:
        prefill, decode = group.start([
            Spec("prefill", layout="BLHNC"),
            Spec("decode", policy="fail", extra=("--kv-transfer-mode", "push"))])
        proxy = ProxyProcess(log_dir, [prefill], [decode], ("--health-interval", "3600",
                                                            "--kv-transfer-mode", "push"))
        try:
            start_proxies([proxy])
            yield Trio(plain, prefill, decode, proxy)
        finally:
            proxy.stop()


def idle(health: dict[str, Any]) -> bool:
    return bool(health["used_blocks"] == 0 and health["leases"] == 0
                and health["reservations"] == 0 and health["requests_in_flight"] == 0)


def reserve(decode: Sidecar, path: str, body: dict[str, Any]) -> httpx.Response:
    return decode.post("/v1/kv/reserve", {"endpoint": path, "body": body})


def pushed(trio: Trio, path: str, body: dict[str, Any]) -> httpx.Response:
    """One request through push mode, as the proxy sends it."""
    reserved = reserve(trio.decode, path, body)
    assert reserved.status_code == 200, reserved.text
    reservation = reserved.json()["kv_reservation"]
    first = trio.prefill.post(path, {**prefill_body(body), "kv_transfer_params": {
        "do_remote_decode": True, "kv_reservation": reservation}})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["kv_reservation_id"] == reservation["reservation_id"]
    return trio.decode.post(path, {**body, "kv_transfer_params": params})


def choice(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return dict(response.json()["choices"][0])


@pytest.mark.parametrize(("path", "body"), [
    (COMPLETIONS, {**GREEDY, "prompt": "The quick brown fox jumps over the lazy dog " * 3,
                   "max_tokens": 8}),
    (COMPLETIONS, {**SEEDED, "prompt": "A seeded story begins", "max_tokens": 6}),
    (CHAT, {**GREEDY, "messages": [{"role": "user", "content": "Why is the sky blue?"}],
            "max_tokens": 5}),
])
def test_a_pushed_prompt_answers_as_one_instance(trio: Trio, path: str,
                                                 body: dict[str, Any]) -> None:
    want = choice(trio.both.post(path, body))
    got = choice(pushed(trio, path, body))
    assert got == want
    for side in (trio.prefill, trio.decode):
        side.wait_for("every block free", idle)
    assert trio.decode.metric("kvxfer_kv_transfers_total", outcome="ok") >= 1


def test_a_reservation_names_one_prompt_and_is_used_once(trio: Trio) -> None:
    body = {**GREEDY, "prompt": "Used once", "max_tokens": 3}
    reservation = reserve(trio.decode, COMPLETIONS, body).json()["kv_reservation"]
    first = trio.prefill.post(COMPLETIONS, {**prefill_body(body), "kv_transfer_params": {
        "do_remote_decode": True, "kv_reservation": reservation}})
    params = first.json()["kv_transfer_params"]
    other = trio.decode.post(COMPLETIONS, {**body, "prompt": "Another prompt, longer than it",
                                           "kv_transfer_params": params})
    assert other.status_code == 400 and "holds" in other.text
    assert choice(trio.decode.post(COMPLETIONS, {**body, "kv_transfer_params": params})) == \
        choice(trio.both.post(COMPLETIONS, body))
    again = trio.decode.post(COMPLETIONS, {**body, "kv_transfer_params": params})
    assert again.status_code == 400 and "no reservation" in again.text
    trio.decode.wait_for("every block free", idle)


def test_reserving_is_refused_by_a_pull_decode_and_for_bad_bodies(trio: Trio) -> None:
    body = {**GREEDY, "prompt": "x", "max_tokens": 2}
    assert trio.prefill.post("/v1/kv/reserve", {"endpoint": COMPLETIONS, "body": body}
                             ).status_code == 400
    assert reserve(trio.decode, "/v1/embeddings", body).status_code == 400
    two = reserve(trio.decode, COMPLETIONS, {**body, "prompt": ["x", "y"]})
    assert two.status_code == 400 and "one prompt" in two.text
    many = reserve(trio.decode, COMPLETIONS, {**body, "prompt": "x" * 400, "n": 20})
    assert many.status_code == 400 and "n=20 samples" in many.text
    trio.decode.wait_for("every block free", idle)


@pytest.mark.parametrize("via", ["sidecars", "proxy"])
def test_n_samples_of_a_pushed_prompt_answer_as_one_instance(trio: Trio, via: str) -> None:
    """n > 1: the decode reserves blocks for every sample, the prefill writes one prompt's
    KV, the further samples start from a copy of it; every choice is one instance's."""
    body = {**SEEDED, "prompt": "Three samples of one pushed prompt", "max_tokens": 6, "n": 3}
    copies = trio.decode.metric("kvxfer_kv_sibling_copies_total")
    want = trio.both.post(COMPLETIONS, body)
    got = pushed(trio, COMPLETIONS, body) if via == "sidecars" else \
        trio.proxy.post(COMPLETIONS, body)
    assert got.status_code == 200, got.text
    pairs = list(zip(got.json()["choices"], want.json()["choices"], strict=True))
    for mine, theirs in pairs:  # the last prompt token computed alone: its logits may
        assert mine["text"] == theirs["text"]  # differ from one instance's in the last bit
        assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
        assert mine["logprobs"]["token_logprobs"] == pytest.approx(
            theirs["logprobs"]["token_logprobs"], abs=1e-4)
    assert len({mine["text"] for mine, _ in pairs}) > 1, "the samples differ"
    assert trio.decode.metric("kvxfer_kv_sibling_copies_total") == copies + 2
    for side in (trio.prefill, trio.decode):
        side.wait_for("every block free", idle)


@pytest.mark.parametrize("stream", [False, True])
def test_the_proxy_in_push_mode_answers_as_one_instance(trio: Trio, stream: bool) -> None:
    """The proxy reserves at the decode, has the prefill write into the reservation and
    relays the decode's answer, streamed or whole: the same tokens and log-probabilities
    as one instance."""
    body = {**SEEDED, "prompt": "Through the proxy, pushed", "max_tokens": 7, "stream": stream}
    want, got = trio.both.post(COMPLETIONS, body), trio.proxy.post(COMPLETIONS, body)
    if stream:
        assert streamed(got) == streamed(want)
    else:
        assert choice(got) == choice(want)
    for side in (trio.prefill, trio.decode):
        side.wait_for("every block free", idle)


def test_a_decode_with_a_prefix_cache_reserves_and_is_written_only_past_it(
        trio: Trio, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same prompt twice into a decode with a prefix cache and blocks half the
    prefill's: the second reservation skips the cached prefix (whole decode blocks, short
    of the last token), which ends inside a prefill block, so the prefill writes from the
    middle of one of its blocks; fewer bytes land, and both answers are one instance's."""
    body = {**GREEDY, "prompt": "The quick brown fox jumps over the lazy dog " * 2,
            "max_tokens": 6, "logprobs": 2}
    want = choice(trio.both.post(COMPLETIONS, body))
    tokens = trio.both.post(COMPLETIONS, body).json()["usage"]["prompt_tokens"]
    with SidecarGroup(tmp_path_factory.mktemp("push-cache")) as group:
        (decode,) = group.start([Spec("decode", policy="fail", block_size=8, extra=(
            "--kv-transfer-mode", "push", "--enable-prefix-caching"))])
        seen = []
        for _ in ("cold", "warm"):
            moved = decode.metric("kvxfer_kv_transfer_bytes_total")
            reservation = reserve(decode, COMPLETIONS, body).json()["kv_reservation"]
            first = trio.prefill.post(COMPLETIONS, {**prefill_body(body), "kv_transfer_params": {
                "do_remote_decode": True, "kv_reservation": reservation}})
            params = first.json()["kv_transfer_params"]
            assert choice(decode.post(COMPLETIONS, {**body, "kv_transfer_params": params})) \
                == want
            seen.append((reservation["cached_tokens"], len(reservation["block_ids"]),
                         decode.metric("kvxfer_kv_transfer_bytes_total") - moved))
            decode.wait_for("every block free", idle)
        (cold_cached, cold_blocks, cold_bytes), (cached, blocks, written) = seen
        assert cold_cached == 0 and cold_blocks == -(-tokens // 8)
        assert cached == (tokens - 1) // 8 * 8 and cached % 16 == 8, "ends inside a block"
        assert blocks == cold_blocks - cached // 8 and 0 < written < cold_bytes / 5
        assert decode.metric("kvxfer_prefix_cache_hits_total") == cached
        # three samples share the cached blocks, each holding them: released unused, each
        # lets go once (the decode keeps serving)
        spare = reserve(decode, COMPLETIONS, {**body, "n": 3}).json()["kv_reservation"]
        assert spare["cached_tokens"] == cached
        assert decode.post("/v1/kv/release", {"kv_transfer_params": {
            "kv_reservation": spare}}).json() == {"released": True}
        decode.wait_for("every block free", idle)
        assert decode.get("/health").json()["status"] == "ok"
        # and used: the samples past the cached prefix start from a copy of the push
        sampled = {**body, "n": 3, "temperature": 1.0, "seed": 11}
        spare = reserve(decode, COMPLETIONS, sampled).json()["kv_reservation"]
        first = trio.prefill.post(COMPLETIONS, {**prefill_body(sampled), "kv_transfer_params": {
            "do_remote_decode": True, "kv_reservation": spare}})
        got = decode.post(COMPLETIONS, {**sampled, "kv_transfer_params": first.json()[
            "kv_transfer_params"]})
        assert got.status_code == 200, got.text
        assert [c["text"] for c in got.json()["choices"]] == \
            [c["text"] for c in trio.both.post(COMPLETIONS, sampled).json()["choices"]]
        decode.wait_for("every block free", idle)
    trio.prefill.wait_for("every block free", idle)


def test_a_reservation_nobody_will_use_is_released_by_whoever_holds_it(trio: Trio) -> None:
    """The caller holding a reservation frees it at once (no prefill claimed it); a
    request naming it later is refused; another decode's, or a used one, frees nothing."""
    body = {**GREEDY, "prompt": "Nobody will use this", "max_tokens": 3}
    reservation = reserve(trio.decode, COMPLETIONS, body).json()["kv_reservation"]
    assert trio.decode.health()["reservations"] == 1
    assert trio.decode.metric("kvxfer_kv_reservations_held") == 1
    released = trio.decode.post("/v1/kv/release",
                                {"kv_transfer_params": {"kv_reservation": reservation}})
    assert released.status_code == 200 and released.json() == {"released": True}
    trio.decode.wait_for("every block free", idle, timeout=2.0)  # not its deadline's 120 s
    assert trio.decode.metric("kvxfer_kv_reservations_held") == 0
    late = trio.decode.post(COMPLETIONS, {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "kv_reservation_id": reservation["reservation_id"]}})
    assert late.status_code == 400 and "was released" in late.text
    again = trio.decode.post("/v1/kv/release",
                             {"kv_transfer_params": {"kv_reservation": reservation}})
    assert again.json() == {"released": False}
    other = trio.decode.post("/v1/kv/release", {"kv_transfer_params": {
        "kv_reservation": {**reservation, "engine_id": "decode-elsewhere"}}})
    assert other.status_code == 400 and "not this one's" in other.text
    held = reserve(trio.decode, COMPLETIONS, body).json()["kv_reservation"]
    altered = trio.decode.post("/v1/kv/release", {"kv_transfer_params": {
        "kv_reservation": {**held, "expires_at": held["expires_at"] + 60}}})
    assert altered.status_code == 200 and altered.json() == {"released": False}
    assert trio.decode.health()["reservations"] == 1, "an altered one released nothing"
    assert trio.decode.post("/v1/kv/release", {"kv_transfer_params": {
        "kv_reservation": held}}).json() == {"released": True}
    written = reserve(trio.decode, COMPLETIONS, body).json()["kv_reservation"]
    assert trio.prefill.post(COMPLETIONS, {**prefill_body(body), "kv_transfer_params": {
        "do_remote_decode": True, "kv_reservation": written}}).status_code == 200
    trio.prefill.wait_for("the push ended", idle)  # landed: every lease of it ended
    assert trio.decode.post("/v1/kv/release", {"kv_transfer_params": {
        "kv_reservation": written}}).json() == {"released": True}
    trio.decode.wait_for("every block free", idle, timeout=2.0)
    used = reserve(trio.decode, COMPLETIONS, body).json()["kv_reservation"]
    first = trio.prefill.post(COMPLETIONS, {**prefill_body(body), "kv_transfer_params": {
        "do_remote_decode": True, "kv_reservation": used}})
    choice(trio.decode.post(COMPLETIONS, {**body,
                                          "kv_transfer_params": first.json()[
                                              "kv_transfer_params"]}))
    assert trio.decode.post("/v1/kv/release", {"kv_transfer_params": {
        "kv_reservation": used}}).json() == {"released": False}
    for side in (trio.prefill, trio.decode):
        side.wait_for("every block free", idle)


def test_the_proxy_releases_the_reservation_of_a_prefill_that_did_not_answer(
        trio: Trio, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A frozen prefill: the proxy gives up on it after --prefill-timeout and releases the
    decode's reservation at once; once thawed, the prefill finds it ended and writes
    nothing. Both sides end with every block free, long before the reservation's deadline."""
    body = {**GREEDY, "prompt": "A prefill that froze", "max_tokens": 3}
    with SidecarGroup(tmp_path_factory.mktemp("push-release")) as group:
        (prefill,) = group.start([Spec("prefill")])
        proxy = ProxyProcess(group.log_dir, [prefill], [trio.decode], (
            "--health-interval", "3600", "--kv-transfer-mode", "push", "--prefill-timeout",
            "2", "--retries", "0"))
        try:
            start_proxies([proxy])
            prefill.send_signal(signal.SIGSTOP)
            try:
                answer = proxy.post(COMPLETIONS, body)
                assert answer.status_code == 504, answer.text
                trio.decode.wait_for("every block free", idle, timeout=5.0)
            finally:
                prefill.send_signal(signal.SIGCONT)
            prefill.wait_for("every block free", idle)
            trio.decode.wait_for("every block free", idle)
        finally:
            proxy.stop()


def test_the_proxy_releases_the_reservation_of_a_decode_that_refused_the_request(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The decode starts draining while the prefill computes: the prefill writes into the
    reservation, and the decode refuses the request (503, draining; with --retries 0 the
    client gets a 502 that says so). The proxy releases the reservation at once: the
    decode holds none well before its quiet period ends (it would hold it until it exits;
    a decode that refused a request and stays up, until the reservation's deadline)."""
    body = {**GREEDY, "prompt": "A decode that began to drain", "max_tokens": 3}
    with SidecarGroup(tmp_path_factory.mktemp("push-refused")) as group:
        prefill, decode = group.start([Spec("prefill"), Spec("decode", extra=(
            "--kv-transfer-mode", "push"))])
        proxy = ProxyProcess(group.log_dir, [prefill], [decode], (
            "--health-interval", "3600", "--kv-transfer-mode", "push", "--retries", "0"))
        try:
            start_proxies([proxy])
            prefill.send_signal(signal.SIGSTOP)
            with ThreadPoolExecutor(1) as pool:
                try:
                    answer = pool.submit(proxy.post, COMPLETIONS, body)
                    decode.wait_for("the reservation", lambda h: h["reservations"] == 1)
                    decode.send_signal(signal.SIGTERM)  # draining: refuses new requests
                finally:
                    prefill.send_signal(signal.SIGCONT)
                refused = answer.result(timeout=60)
            assert refused.status_code == 502 and "draining" in refused.text, refused.text
            deadline = time.monotonic() + 3.0  # the decode exits 5 s after the refusal
            while decode.metric(HELD) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert decode.metric(HELD) == 0, "the reservation is still held"
            assert "released" in proxy.log_tail(100), proxy.log_tail(40)
            prefill.wait_for("every block free", idle)
        finally:
            proxy.stop()
