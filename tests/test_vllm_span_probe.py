"""The span probe of ``kvxfer bench vllm`` through two real ``WorkerSide`` ranks (real
NIXL agents, listeners and leases, no vLLM): a decode that allows probes reads a lease's
bytes as one READ of whole memory spans, from the lease's first block on the prefill into
the load's first block on the decode, across whatever blocks follow; the same lease read
normally moves as many bytes, a descriptor per layer and block run."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvxfer.plan.layout import CacheSpec, allocate_kv_cache
from kvxfer.transfer.transfer_config import TransferConfig
from kvxfer.vllm.extra_config import SPAN_PROBE_KEY, ConnectorSettings
from kvxfer.vllm.step_plan import Hold, Load, StepPlan
from kvxfer.vllm.worker_side import StepResult, WorkerSide
from kvxfer.wire.compat import CompatInfo

HOST = "127.0.0.1"
SPEC = CacheSpec(16, 2, 8, torch.float32)
BLOCKS, LAYERS = 8, 4
COMPAT = CompatInfo(model="tiny-vllm", dtype="float32", cache_dtype="float32",
                    head_size=SPEC.head_size, total_kv_heads=SPEC.num_kv_heads,
                    num_layers=LAYERS)


class Rank:
    """One WorkerSide over one backing allocation holding every layer (as vLLM 0.32)."""

    def __init__(self, name: str, fill: int, *, probes: bool) -> None:
        self.raw, views = allocate_kv_cache(SPEC, BLOCKS, LAYERS, "LBHNC")
        self.raw.copy_(torch.randint(0, 256, (self.raw.numel(),),
                                     generator=torch.Generator().manual_seed(fill),
                                     dtype=torch.int32).to(torch.uint8).view(self.raw.dtype))
        settings = ConnectorSettings(TransferConfig(lease_ttl=30.0, kv_read_timeout=10.0,
                                                    host_reads=False),
                                     read_wait=0.01, span_probe=probes)
        self.side = WorkerSide(settings, name, COMPAT, rank=0, tp_size=1,
                               total_kv_heads=SPEC.num_kv_heads)
        self.side.register({f"layer.{i}": v for i, v in enumerate(views)}, SPEC, BLOCKS)

    def bytes(self) -> torch.Tensor:
        return self.raw.view(torch.uint8).clone()


@pytest.fixture
def pair() -> Iterator[tuple[Rank, Rank]]:
    prefill = Rank("prefill-probe", 1, probes=False)
    decode = Rank("decode-probe", 2, probes=True)
    yield prefill, decode
    decode.side.close()
    prefill.side.close()


def read(prefill: Rank, decode: Rank, lease: str, remote: tuple[int, ...],
         local: tuple[int, ...], **extra: object) -> StepResult:
    prefill.side.apply(StepPlan(holds=[Hold("p", lease, remote, len(remote) * SPEC.block_size,
                                            time.time() + 30)]))
    prefill.side.after_forward()
    params = {"remote_engine_id": "prefill-probe", "remote_host": HOST,
              "remote_port": prefill.side.port, "remote_block_ids": list(remote),
              "remote_request_id": lease, "tp_size": 1,
              "remote_num_tokens": len(remote) * SPEC.block_size,
              "lease_expires_at": time.time() + 30, **extra}
    decode.side.apply(StepPlan(loads=[Load(lease, params, local)]))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        prefill.side.poll([])
        result = decode.side.poll([])
        if lease in result.recving or result.failures:
            return result
    raise AssertionError(f"the read of {lease} did not end within 30 s")


def test_a_probe_moves_the_reads_bytes_as_one_descriptor_from_its_first_blocks(
        pair: tuple[Rank, Rank]) -> None:
    prefill, decode = pair
    page = SPEC.page_size_bytes  # one layer's block
    normal = read(prefill, decode, "lease-read", (5, 6, 7), (1, 2, 3))
    assert normal.failures == 0 and len(normal.reads) == 1
    assert normal.reads[0].num_bytes == 3 * LAYERS * page
    assert normal.reads[0].descriptors == LAYERS  # each layer's run of three blocks

    before, source = decode.bytes(), prefill.bytes()
    probe = read(prefill, decode, "lease-probe", (5, 6, 7), (4, 5, 6), **{SPAN_PROBE_KEY: True})
    assert probe.failures == 0 and probe.error_blocks == set()
    (stats,) = probe.reads
    assert (stats.num_bytes, stats.descriptors) == (3 * LAYERS * page, 1)
    # from the request's first block on each side (layer 0's), on through the next ones
    after, n = decode.bytes(), stats.num_bytes
    assert torch.equal(after[4 * page:4 * page + n], source[5 * page:5 * page + n])
    assert torch.equal(after[:4 * page], before[:4 * page])
    assert torch.equal(after[4 * page + n:], before[4 * page + n:])  # nothing past them
