"""kv_aware routing with real processes: two prefill sidecars and one decode, each with its
prefix cache and a signed KV event stream, behind a ``python -m proxy`` that reads their
streams (``--kv-key-file``) and tokenizes prompts as they do (``--tokenizer byte``).

Checked: a prompt whose prefix one prefill holds goes to that prefill, again and again,
and the answer is the decode's own; a proxy without the key reads no signed stream and
goes round robin; a prefill that freezes stops being believed within the stated bound, and
is read again (caught up from its replay socket) once it thaws. A prompt with fewer tokens
left to compute than ``--pd-min-tokens`` goes to the decode alone. A decode that answers
without reading its lease (a stub: as a decode without a KV connector would) raises the
alarm on the proxy's /health and /metrics for that pair, and its lease is released. A
stream that claims blocks its instance lacks steers a prompt there, which computes them:
the answer is still right."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sidecars import ProxyProcess, Sidecar, SidecarGroup, Spec, start_proxies
from stub_upstream import Stub

from kvxfer.net.kv_events import BlockStored
from kvxfer.sidecar.kv_event_publisher import KVEventPublisher
from proxy.event_streams import STALE_AFTER_S

pytestmark = pytest.mark.heavy  # seven sidecar and proxy processes

GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 4, "logprobs": 1}
BLOCK = 16
EVENTS = ("--enable-prefix-caching", "--kv-events-port", "0")
WAIT_S = 20.0


@dataclass(frozen=True)
class Fleet:
    prefills: list[Sidecar]
    decode: Sidecar
    proxy: ProxyProcess  # kv_aware, with the key: reads every stream; always P/D
    keyless: ProxyProcess  # kv_aware without the key: reads none
    short: ProxyProcess  # the same, a decode alone below 64 tokens to compute
    unread: ProxyProcess  # prefills[0] and a decode that reads no KV (a stub)
    stub: Stub
    liar: Sidecar  # a prefill whose stream (by --kv-events) is the test's: it lies
    lied_to: ProxyProcess  # prefills[0] and the liar, the decode; no key (a flag's stream)
    lies: KVEventPublisher


@dataclass(frozen=True)
class Instance:
    """A stub's address, as ProxyProcess takes its instances."""

    url: str
    port: int
    spec: Spec = field(default_factory=Spec)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("kv-routing")
    keyed = ("--kv-key-file", str(key_file))
    with SidecarGroup(log_dir) as group, contextlib.ExitStack() as stack:
        p0, p1, decode, liar = group.start([
            Spec("prefill", extra=(*EVENTS, *keyed)), Spec("prefill", extra=(*EVENTS, *keyed)),
            Spec("decode", policy="fail", extra=(*EVENTS, *keyed)),
            Spec("prefill", extra=("--enable-prefix-caching", *keyed))])
        stub = Stub("decode")
        stub.server.start()
        stack.callback(stub.server.stop)
        lies = KVEventPublisher("127.0.0.1")
        lies.start()
        stack.callback(lies.close)
        lie = f"{liar.url}=tcp://127.0.0.1:{lies.port},tcp://127.0.0.1:{lies.replay_port}"
        flags = ("--tokenizer", "byte", "--health-interval", "0.5")
        proxies = [ProxyProcess(log_dir, [p0, p1], [decode],
                                (*flags, *keyed, "--pd-min-tokens", "0")),
                   ProxyProcess(log_dir, [p0, p1], [decode], flags),
                   ProxyProcess(log_dir, [p0, p1], [decode],
                                (*flags, *keyed, "--pd-min-tokens", "64")),
                   ProxyProcess(log_dir, [p0], [Instance(stub.url, stub.server.port)],  # type: ignore[list-item]
                                flags),
                   ProxyProcess(log_dir, [p0, liar], [decode],
                                (*flags, "--pd-min-tokens", "0", "--kv-events", lie))]
        for launched in proxies:
            stack.callback(launched.stop)
        start_proxies(proxies)
        yield Fleet([p0, p1], decode, *proxies[:4], stub, liar, proxies[4], lies)


def wait_until(what: str, check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def indexed(proxy: ProxyProcess, sidecar: Sidecar) -> dict[str, Any] | None:
    """The proxy's view of ``sidecar``'s stream (its /health), if it reads one."""
    state: dict[str, Any] | None = proxy.instance(sidecar.url).get("kv_events")
    return state


def computed(sidecar: Sidecar) -> float:
    """Prompt tokens ``sidecar`` looked up in its prefix cache so far: one per prompt it
    prefilled (what it then computed is that minus its hits)."""
    return sidecar.metric("kvxfer_prefix_cache_queries_total")


def complete(proxy: ProxyProcess, prompt: str) -> dict[str, Any]:
    answer = proxy.post("/v1/completions", {"prompt": prompt, **GREEDY})
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["choices"][0])


def alone(decode: Sidecar, prompt: str) -> dict[str, Any]:
    answer = decode.post("/v1/completions", {"prompt": prompt, **GREEDY})
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["choices"][0])


def test_a_prompt_goes_to_the_prefill_that_holds_its_prefix(fleet: Fleet) -> None:
    proxy = fleet.proxy
    wait_until("the proxy to read every stream",
               lambda: all((indexed(proxy, s) or {}).get("believed")
                           for s in [*fleet.prefills, fleet.decode]))
    shared = "A shared system prompt that every turn of this chat starts with. " * 4
    before = [computed(p) for p in fleet.prefills]
    complete(proxy, shared + "First question?")
    holder = next(i for i, p in enumerate(fleet.prefills) if computed(p) > before[i])
    other = fleet.prefills[1 - holder]
    blocks = (1 + len(shared.encode())) // BLOCK  # BOS and the bytes, in whole blocks
    wait_until("the holder's blocks in the proxy's index",
               lambda: (indexed(proxy, fleet.prefills[holder]) or {}).get("blocks", 0) >= blocks)
    other_before = computed(other)
    hits_before = fleet.prefills[holder].metric("kvxfer_prefix_cache_hits_total")
    for turn in range(4):  # round robin would send half of these to the other prefill
        prompt = f"{shared}Question number {turn}?"
        got = complete(proxy, prompt)
        want = alone(fleet.decode, prompt)
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert computed(other) == other_before, "a prompt went to the prefill without its prefix"
    hits = fleet.prefills[holder].metric("kvxfer_prefix_cache_hits_total") - hits_before
    assert hits >= 4 * blocks * BLOCK, f"the holder computed the shared prefix again ({hits})"


def test_a_proxy_without_the_key_reads_no_signed_stream_and_goes_round_robin(
        fleet: Fleet) -> None:
    proxy = fleet.keyless
    assert all(indexed(proxy, s) is None for s in [*fleet.prefills, fleet.decode])
    prompt = "Round and round: " * 8
    counts = []
    for p in fleet.prefills:
        counts.append(computed(p))
    for turn in range(4):
        complete(proxy, f"{prompt}{turn}")
    grew = [computed(p) - c for p, c in zip(fleet.prefills, counts, strict=True)]
    assert all(g > 0 for g in grew), f"round robin should use both prefills: {grew}"


def test_a_frozen_prefill_is_not_believed_after_the_stated_bound(fleet: Fleet) -> None:
    """Its heartbeats stop: within STALE_AFTER_S (and a health check) its index is no
    longer believed; thawed, it is again."""
    proxy, frozen = fleet.proxy, fleet.prefills[0]
    wait_until("its stream believed", lambda: (indexed(proxy, frozen) or {}).get("believed"))
    frozen.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_until("its index no longer believed",
                   lambda: not (indexed(proxy, frozen) or {}).get("believed"),
                   timeout=STALE_AFTER_S + 5)
        assert time.monotonic() - stopped <= STALE_AFTER_S + 2
    finally:
        frozen.send_signal(signal.SIGCONT)
    wait_until("its stream believed again",
               lambda: (indexed(proxy, frozen) or {}).get("believed"))


def test_a_prompt_with_few_tokens_to_compute_goes_to_a_decode_alone(fleet: Fleet) -> None:
    proxy = fleet.short
    wait_until("the proxy to read every stream",
               lambda: all((indexed(proxy, s) or {}).get("believed")
                           for s in [*fleet.prefills, fleet.decode]))
    prefilled = sum(computed(p) for p in fleet.prefills)
    decoded = computed(fleet.decode)
    prompt = "Short one."  # 11 tokens with BOS
    got = complete(proxy, prompt)
    assert sum(computed(p) for p in fleet.prefills) == prefilled, "it went through a prefill"
    assert computed(fleet.decode) > decoded
    assert got["logprobs"]["tokens"] == alone(fleet.decode, prompt)["logprobs"]["tokens"]
    assert proxy.metric("kvxfer_proxy_routed_total", path="decode", reason="short") == 1
    long_prompt = "A longer prompt, well past the threshold of sixty-four tokens. " * 2
    complete(proxy, long_prompt)
    assert sum(computed(p) for p in fleet.prefills) > prefilled
    assert proxy.metric("kvxfer_proxy_routed_total", path="pd", reason="pays") == 1
    # the next turn: the decode holds the history it read, so it computes the rest alone
    blocks = (1 + len(long_prompt.encode())) // BLOCK
    wait_until("the decode's blocks indexed",
               lambda: (indexed(proxy, fleet.decode) or {}).get("blocks", 0) >= blocks)
    prefilled = sum(computed(p) for p in fleet.prefills)
    turn = long_prompt + "And now?"
    got = complete(proxy, turn)
    assert sum(computed(p) for p in fleet.prefills) == prefilled, "it went through a prefill"
    assert proxy.metric("kvxfer_proxy_routed_total", path="decode", reason="short") == 2
    assert got["logprobs"]["tokens"] == alone(fleet.decode, turn)["logprobs"]["tokens"]


def test_a_decode_that_reads_no_kv_raises_the_alarm_for_its_pair(fleet: Fleet) -> None:
    proxy, prefill = fleet.unread, fleet.prefills[0]
    assert "pd_not_happening" not in fleet.proxy.health(), "a pair that reads raised it"
    for turn in range(2):
        complete(proxy, f"Nobody reads the KV of this prompt, long enough for P/D, turn {turn}.")
    wait_until("the alarm on /health", lambda: "pd_not_happening" in proxy.health())
    wait_until("both requests counted", lambda: proxy.metric(
        "kvxfer_proxy_pd_unread_total", prefill=prefill.url, decode=fleet.stub.url) == 2)
    (alarm,) = proxy.health()["pd_not_happening"]
    assert (alarm["prefill"], alarm["decode"], alarm["requests"]) == \
        (prefill.url, fleet.stub.url, 2)
    assert "computed the prompt itself" in alarm["reason"]
    assert proxy.log_path.read_text().count("P/D is not happening") == 1  # once per pair
    prefill.wait_for("its leases released, not left to their TTL",
                     lambda h: h["leases"] == 0, timeout=5)


def test_an_instance_whose_events_claim_blocks_it_lacks_computes_them_and_answers_right(
        fleet: Fleet) -> None:
    """The stream the proxy reads for ``liar`` says it holds a prompt it never saw: the
    proxy sends the prompt there, and the prefill computes what it lacks (all of it)."""
    proxy, liar = fleet.lied_to, fleet.liar
    prompt = "A prompt nobody has seen, whose blocks one stream claims all the same. " * 2
    tokens = [256, *prompt.encode()]
    full = len(tokens) // BLOCK * BLOCK
    fleet.lies.publish([BlockStored(list(range(full // BLOCK)), None, tokens[:full], BLOCK)])
    wait_until("the lie indexed",
               lambda: (indexed(proxy, liar) or {}).get("blocks", 0) == full // BLOCK)
    queried, hits = computed(liar), liar.metric("kvxfer_prefix_cache_hits_total")
    got = complete(proxy, prompt)
    assert computed(liar) > queried, "the lie did not steer the prompt"
    assert liar.metric("kvxfer_prefix_cache_hits_total") == hits, "it had nothing cached"
    assert got["logprobs"]["tokens"] == alone(fleet.decode, prompt)["logprobs"]["tokens"]
