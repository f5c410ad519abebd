"""Sidecars that pack K and V differently work together (real processes, NIXL, ZMQ):
a prefill in token packing and a decode in vLLM's CPU packing, and the reverse, answer
exactly what one plain instance answers; the decode converts (``kvxfer.plan.staging``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sidecars import Sidecar, SidecarGroup, Spec, disaggregated

BODY = {"prompt": [256, *[(5 * i + 1) % 256 for i in range(45)]], "max_tokens": 6,
        "temperature": 0, "logprobs": 1, "ignore_eos": True}


def packed(role: str, packing: str, layout: str) -> Spec:
    return Spec(role, layout, policy="fail", num_blocks=32,
                extra=("--kv-packing", packing, "--dtype", "float32"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Sidecar]]:
    with SidecarGroup(tmp_path_factory.mktemp("packing")) as group:
        yield group.start([Spec("both", extra=("--dtype", "float32")),
                           packed("prefill", "token", "BLHNC"),
                           packed("prefill", "vllm-cpu-vec", "LBHNC"),
                           packed("decode", "vllm-cpu-vec", "BHLNC"),
                           packed("decode", "token", "LBNHC")])


@pytest.mark.parametrize(("prefill", "decode"), [(1, 3), (2, 4)],
                         ids=["token-to-vllm-cpu-vec", "vllm-cpu-vec-to-token"])
def test_the_decode_converts_another_packing_exactly(fleet: list[Sidecar], prefill: int,
                                                     decode: int) -> None:
    reference = fleet[0].post("/v1/completions", BODY)
    assert reference.status_code == 200, reference.text
    reads = fleet[decode].metric("kvxfer_kv_transfers_total", outcome="ok")
    _, answer = disaggregated(fleet[prefill], fleet[decode], "/v1/completions", BODY)
    assert answer.status_code == 200, answer.text
    got, want = answer.json()["choices"][0], reference.json()["choices"][0]
    assert got["text"] == want["text"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    for a, b in zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"],
                    strict=True):
        assert abs(a - b) < 1e-4
    assert fleet[decode].metric("kvxfer_kv_transfers_total", outcome="ok") == reads + 1
    assert fleet[decode].metric("kvxfer_kv_recomputes_total") == 0
