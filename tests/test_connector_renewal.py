"""The decode connector renews the lease of a request waiting for blocks, in this process:
a granted renewal keeps the lease readable past its first expiry; a refused one means
the lease is never read (the request fails by policy, no handshake, no release).

The prefill is a real side-channel listener (another model: a handshake would be
refused) whose ``on_renew`` the test controls.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from test_release import compat_of_another_model

from kvxfer.connector import KVConnector
from kvxfer.engine import LLMEngine, SamplingParams, tiny_config
from kvxfer.handshake import HandshakeListener
from kvxfer.metrics import SidecarMetrics
from kvxfer.worker import RemoteParams

HOST = "127.0.0.1"
TTL = 0.4
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = [(7 * i) % 200 + 1 for i in range(20)]  # 2 blocks of 16


class Prefill:
    """A listener that grants (``ttl``) or refuses (None) renewals and records every call."""

    def __init__(self) -> None:
        self.ttl: float | None = TTL
        self.renewals: list[str] = []
        self.releases: list[str] = []
        self.handshakes = 0
        self.listener = HandshakeListener(
            HOST, engine_id="prefill-renew", compat=compat_of_another_model(),
            metadata=self._metadata, on_release=self._on_release,
            on_renew=self._on_renew).start()

    def _metadata(self) -> list[object]:
        self.handshakes += 1
        return []

    def _on_renew(self, lease_id: str, _requester: str) -> float | None:
        self.renewals.append(lease_id)
        return self.ttl

    def _on_release(self, lease_id: str, _requester: str, _reason: str) -> bool:
        self.releases.append(lease_id)
        return True

    def params(self, lease_id: str) -> RemoteParams:
        return RemoteParams("prefill-renew", HOST, self.listener.port, (0, 1), lease_id, 1,
                            len(PROMPT), time.time() + TTL)


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    made = Prefill()
    yield made
    made.listener.close()


@pytest.fixture
def connector() -> Iterator[KVConnector]:
    """A decode connector over an 8-block engine, policy fail, whose blocks a filler holds."""
    engine = LLMEngine(tiny_config(), None, block_size=16, num_blocks=8)
    metrics = SidecarMetrics(role="decode", engine_id="decode-test", model="tiny",
                             layout=engine.layout.name, tp=1)
    made = KVConnector(engine, "decode", metrics, failure_policy="fail")
    engine.add_request("filler", [1] * 100, PARAMS, remote_kv=True)  # 7 of 8 blocks
    yield made
    made.close()


def wait_for_blocks(connector: KVConnector, seconds: float) -> None:
    """Poll for ``seconds`` while the request waits for blocks, then free them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        connector.poll()
        assert connector.waiting and not connector.busy, "it still waits for blocks"
        time.sleep(0.01)
    connector.engine.abort("filler")


def error_after_admission(connector: KVConnector) -> str:
    for _ in range(1000):
        connector.poll()
        error = connector.take_transfer_error("r")
        if error is not None:
            return error
        time.sleep(0.005)
    raise AssertionError("the request did not end within 5 s")


def test_a_granted_renewal_keeps_the_lease_readable(connector: KVConnector,
                                                    prefill: Prefill) -> None:
    connector.add_remote("r", PROMPT, PARAMS, prefill.params("lease-kept"))
    wait_for_blocks(connector, 3 * TTL)
    assert len(prefill.renewals) >= 3 and set(prefill.renewals) == {"lease-kept"}
    error = error_after_admission(connector)
    # it went on to read: the handshake ran (and was refused: another model)
    assert "not compatible" in error and "was not read" not in error, error
    assert prefill.handshakes == 0, "refused before metadata was asked for"


def test_a_refused_renewal_means_the_lease_is_never_read(connector: KVConnector,
                                                         prefill: Prefill) -> None:
    prefill.ttl = None  # the prefill no longer holds it
    connector.add_remote("r", PROMPT, PARAMS, prefill.params("lease-lost"))
    wait_for_blocks(connector, 2 * TTL)
    assert prefill.renewals[:1] == ["lease-lost"]
    error = error_after_admission(connector)
    assert "was not read" in error and "no longer holds it" in error, error
    assert prefill.releases == [], "an ended lease is not released"


def test_without_renewals_an_expired_lease_is_not_read(connector: KVConnector,
                                                       prefill: Prefill) -> None:
    prefill.listener.close()  # renewals fail: nobody answers
    connector.add_remote("r", PROMPT, PARAMS, prefill.params("lease-gone"))
    wait_for_blocks(connector, 2 * TTL)
    error = error_after_admission(connector)
    assert "was not read" in error and "expired" in error, error
