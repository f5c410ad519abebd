"""``WorkerSide`` (:mod:`kvxfer.vllm.worker_side`) without vLLM: vLLM's steps mapped onto the
shared lease client and lease answers, with a real worker, real listeners and senders.

Decode: each load is claimed at a prefill stand-in (a real side-channel listener of
another model, so that a handshake is refused before any NIXL connection) whose
claim answers the test sets; a load that fails comes back as vLLM wants it (its
request done receiving, its blocks in error), and the prefill is released only when
it may still hold the lease for this decode. Prefill: a held lease is claimed by one
decode only, released by its claimer only, and reported to vLLM once it finished.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_release import compat_of_another_model

from kvxfer.plan.layout import CacheSpec
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.listener import SideChannelListener
from kvxfer.transfer.transfer_config import TransferConfig
from kvxfer.vllm.extra_config import ConnectorSettings
from kvxfer.vllm.step_plan import Hold, Load, StepPlan
from kvxfer.vllm.worker_side import StepResult, WorkerSide
from kvxfer.wire.compat import CompatInfo
from kvxfer.wire.messages import RenewRefused

HOST = "127.0.0.1"
BLOCK, HEADS, HEAD, BLOCKS = 16, 2, 8, 8
TTL = 30.0
COMPAT = CompatInfo(model="tiny-vllm", dtype="float32", cache_dtype="float32", head_size=HEAD,
                    total_kv_heads=HEADS, num_layers=2)


class Prefill:
    """A listener that grants claims for ``claim_ttl`` s (or refuses: a str) and records
    claims and releases."""

    def __init__(self) -> None:
        self.claim_ttl: float | str = TTL
        self.claims: list[str] = []
        self.releases: list[tuple[str, str]] = []
        self.handshakes = 0
        self.listener = SideChannelListener(
            HOST, engine_id="prefill-stand-in", compat=compat_of_another_model(),
            metadata=self._metadata, on_release=self._on_release,
            on_renew=self._on_renew).start()

    def _metadata(self) -> list[object]:
        self.handshakes += 1
        return []

    def _on_renew(self, lease_id: str, _requester: str, claim: bool) -> float:
        self.claims.append(lease_id)
        if isinstance(self.claim_ttl, str):
            raise RenewRefused(self.claim_ttl)
        return self.claim_ttl

    def _on_release(self, lease_id: str, _requester: str, reason: str, _outcome: str) -> bool:
        self.releases.append((lease_id, reason))
        return True

    def params(self, lease_id: str, expires_in: float = TTL) -> dict[str, Any]:
        return {"remote_engine_id": "prefill-stand-in", "remote_host": HOST,
                "remote_port": self.listener.port, "remote_block_ids": [0, 1],
                "remote_request_id": lease_id, "tp_size": 1, "remote_num_tokens": 20,
                "lease_expires_at": time.time() + expires_in}

    def wait_for_releases(self, count: int) -> list[tuple[str, str]]:
        for _ in range(500):
            if len(self.releases) >= count:
                return self.releases
            time.sleep(0.01)
        raise AssertionError(f"{count} releases expected within 5 s, got {self.releases}")


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    made = Prefill()
    yield made
    made.listener.close()


@pytest.fixture
def side() -> Iterator[WorkerSide]:
    settings = ConnectorSettings(TransferConfig(lease_ttl=TTL, kv_read_timeout=2.0,
                                                handshake_timeout=1.0, host_reads=False),
                                 read_wait=0.01)
    made = WorkerSide(settings, "vllm-test", COMPAT, rank=0, tp_size=1, total_kv_heads=HEADS)
    caches = {f"layer.{i}": torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD) for i in range(2)}
    made.register(caches, CacheSpec(BLOCK, HEADS, HEAD, torch.float32), BLOCKS)
    yield made
    made.close()


def load(prefill: Prefill, lease_id: str, blocks: tuple[int, ...] = (3, 4),
         **params: Any) -> Load:
    return Load("r", {**prefill.params(lease_id), **params}, blocks)


def until_received(side: WorkerSide, request_id: str = "r") -> StepResult:
    """Step until ``request_id``'s load ended; that step's result."""
    for _ in range(500):
        result = side.poll([])
        if request_id in result.recving or result.failures:
            return result
    raise AssertionError(f"the load of {request_id} did not end within 500 steps")


def test_a_refused_claim_fails_the_load_and_nothing_is_read_or_released(
        side: WorkerSide, prefill: Prefill) -> None:
    prefill.claim_ttl = "another decode claimed it first: a lease is read by one decode"
    side.apply(StepPlan(loads=[load(prefill, "lease-taken")]))
    result = until_received(side)
    assert (result.recving, result.error_blocks, result.failures) == ({"r"}, {3, 4}, 1)
    assert prefill.claims == ["lease-taken"]
    assert prefill.handshakes == 0 and prefill.releases == []


def test_an_unanswered_claim_fails_the_load(side: WorkerSide, prefill: Prefill) -> None:
    prefill.listener.close()
    side.apply(StepPlan(loads=[load(prefill, "lease-gone")]))
    result = until_received(side)
    assert (result.recving, result.error_blocks, result.failures) == ({"r"}, {3, 4}, 1)


def test_a_granted_claim_reads_and_a_refused_handshake_releases_the_lease(
        side: WorkerSide, prefill: Prefill) -> None:
    side.apply(StepPlan(loads=[load(prefill, "lease-read")]))
    result = until_received(side)
    assert (result.recving, result.error_blocks, result.failures) == ({"r"}, {3, 4}, 1)
    [(lease_id, reason)] = prefill.wait_for_releases(1)
    assert lease_id == "lease-read" and reason.startswith("the decode's KV read failed: ")
    assert "not compatible" in reason, reason


def test_a_claim_granted_too_short_a_lease_fails_and_releases_it(
        side: WorkerSide, prefill: Prefill) -> None:
    prefill.claim_ttl = 1e-6
    side.apply(StepPlan(loads=[load(prefill, "lease-short")]))
    result = until_received(side)
    assert (result.recving, result.error_blocks, result.failures) == ({"r"}, {3, 4}, 1)
    assert prefill.wait_for_releases(1) == [("lease-short", "too little of the lease was "
                                                            "left to read it")]
    assert prefill.handshakes == 0


def test_a_load_with_nothing_to_read_only_releases_the_lease(
        side: WorkerSide, prefill: Prefill) -> None:
    side.apply(StepPlan(loads=[load(prefill, "lease-cached", blocks=())]))
    assert prefill.wait_for_releases(1) == [
        ("lease-cached", "the decode did not need it (prefix cache hit or aborted)")]
    assert prefill.claims == [] and side.poll([]) == StepResult()


def test_a_span_probe_is_refused_unless_the_decode_allows_it(
        side: WorkerSide, prefill: Prefill) -> None:
    side.apply(StepPlan(loads=[load(prefill, "lease-probe", kvxfer_span_probe=True)]))
    result = side.poll([])
    assert (result.recving, result.error_blocks, result.failures) == ({"r"}, {3, 4}, 1)
    assert prefill.wait_for_releases(1) == [("lease-probe",
                                             "the decode could not use the lease")]
    assert prefill.claims == [] and prefill.handshakes == 0


def test_an_expired_lease_fails_at_once_and_nothing_is_sent(
        side: WorkerSide, prefill: Prefill) -> None:
    side.apply(StepPlan(loads=[load(prefill, "lease-old", lease_expires_at=time.time() - 1)]))
    result = side.poll([])
    assert (result.recving, result.error_blocks, result.failures) == ({"r"}, {3, 4}, 1)
    time.sleep(0.1)
    assert prefill.claims == [] and prefill.releases == []


def test_the_prefill_grants_one_claimer_and_ends_the_lease_on_its_release(
        side: WorkerSide) -> None:
    hold = Hold("p", "lease-held", (0, 1), 20, time.time() + TTL)
    side.apply(StepPlan(holds=[hold]))
    side.after_forward()
    assert side.worker.holds_lease("lease-held")
    compat = compat_of_another_model()
    with SideChannelClient("decode-a", compat) as a, SideChannelClient("decode-b", compat) as b:
        claimed = a.renew(HOST, side.port, "lease-held", claim=True)
        assert claimed.found and 0 < claimed.expires_in <= TTL + 1e-6
        second = b.renew(HOST, side.port, "lease-held", claim=True)
        assert not second.found and "another decode claimed it" in second.reason
        assert not b.release(HOST, side.port, "lease-held", "not mine")
        assert side.poll([]).sending == set() and side.worker.holds_lease("lease-held")
        assert a.release(HOST, side.port, "lease-held", "the decode will not read it")
    assert side.poll([]).sending == set(), "reported only once vLLM finished the request"
    assert not side.worker.holds_lease("lease-held")
    assert side.poll(["p"]).sending == {"p"}
    assert side.poll(["p"]).sending == set(), "once"
