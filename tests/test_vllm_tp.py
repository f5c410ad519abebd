"""KvxferConnector at TP > 1 without vLLM: real ``WorkerSide`` ranks, one per process in
vLLM (here one per object: its own NIXL agent, listener, port and lease table), and the
real ``SchedulerSide`` handing out the params.

A prefill at TP ``p`` holds each lease on every rank; its params name every rank's
side-channel port; a decode at TP ``d`` claims the lease at each port, reads its share
of the heads from the prefill ranks that hold them, and every prefill rank's lease ends
by the "done" of its readers. Every byte lands where the decode's heads are, nothing
else changes, and no rank keeps a lease.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvxfer.plan.layout import CacheSpec, allocate_kv_cache
from kvxfer.transfer.transfer_config import TransferConfig
from kvxfer.vllm.extra_config import ConnectorSettings
from kvxfer.vllm.scheduler_side import BlockRef, SchedulerSide
from kvxfer.vllm.step_plan import Load, StepPlan
from kvxfer.vllm.worker_side import StepResult, WorkerSide
from kvxfer.wire.compat import CompatInfo

BLOCK, HEADS, HEAD, BLOCKS, LAYERS = 16, 2, 8, 8, 3
SETTINGS = ConnectorSettings(TransferConfig(lease_ttl=30.0, kv_read_timeout=10.0,
                                            handshake_timeout=2.0, host_reads=False),
                             read_wait=0.01)
COMPAT = CompatInfo(model="tiny-vllm-tp", dtype="float32", cache_dtype="float32",
                    head_size=HEAD, total_kv_heads=HEADS, num_layers=LAYERS)


class Instance:
    """An instance's TP ranks over one logical cache ``full`` ``[L, B, H, N, 2C]``: rank
    ``r`` holds heads ``r * H / tp`` on, in one allocation of every layer (as vLLM 0.32)."""

    def __init__(self, engine_id: str, tp: int, seed: int) -> None:
        self.engine_id, self.tp = engine_id, tp
        self.heads = HEADS // tp
        spec = CacheSpec(BLOCK, self.heads, HEAD, torch.float32)
        self.full = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD,
                                generator=torch.Generator().manual_seed(seed))
        self.views: list[list[torch.Tensor]] = []
        self.ranks: list[WorkerSide] = []
        for rank in range(tp):
            _, views = allocate_kv_cache(spec, BLOCKS, LAYERS, "LBHNC")
            for layer, view in enumerate(views):
                view.copy_(self.full[layer, :, rank * self.heads:(rank + 1) * self.heads])
            side = WorkerSide(SETTINGS, engine_id, COMPAT, rank=rank, tp_size=tp,
                              total_kv_heads=HEADS)
            side.register({f"layer.{i}": v for i, v in enumerate(views)}, spec, BLOCKS)
            self.views.append(views)
            self.ranks.append(side)

    def cache(self) -> torch.Tensor:
        """The logical cache as the ranks hold it now."""
        return torch.stack([torch.cat([self.views[r][layer] for r in range(self.tp)], dim=1)
                            for layer in range(LAYERS)])

    def close(self) -> None:
        for side in self.ranks:
            side.close()


@pytest.fixture
def instances(request: pytest.FixtureRequest) -> Iterator[tuple[Instance, Instance]]:
    prefill_tp, decode_tp = request.param
    made: list[Instance] = []
    try:
        made.append(Instance(f"vllm-prefill-tp{prefill_tp}", prefill_tp, 1))
        made.append(Instance(f"vllm-decode-tp{decode_tp}", decode_tp, 2))
        yield made[0], made[1]
    finally:
        for instance in reversed(made):
            instance.close()


def hand_out(prefill: Instance, blocks: list[int], tokens: int) -> dict[str, Any]:
    """The prefill's scheduler leases ``blocks`` for a prompt of ``tokens``: every rank
    holds the lease after the forward; the params it answers with."""
    scheduler = SchedulerSide(SETTINGS.transfer, prefill.engine_id, BLOCK, prefill.tp)
    scheduler.set_side_channel_ports({r: side.port for r, side in enumerate(prefill.ranks)})
    params: dict[str, Any] = {"do_remote_decode": True}
    scheduler.after_alloc("p", params, tokens, [BlockRef(b, False) for b in blocks], 0)
    plan = scheduler.build_plan({"p": (0, tokens)}, lambda _: blocks)
    for side in prefill.ranks:  # vLLM hands every worker the same plan
        side.apply(plan)
        side.after_forward()
    keep, handed = scheduler.finished("p", params, completed=True)
    assert keep and handed is not None
    return handed


def step_all(prefill: Instance, decode: Instance, finished: set[str]
             ) -> tuple[list[StepResult], list[StepResult]]:
    return ([side.poll(finished) for side in prefill.ranks],
            [side.poll(set()) for side in decode.ranks])


@pytest.mark.parametrize("instances", [(2, 1), (1, 2), (2, 2)], indirect=True,
                         ids=["prefill-tp2-decode-tp1", "prefill-tp1-decode-tp2", "tp2-tp2"])
def test_a_decode_reads_a_lease_from_every_prefill_rank_at_any_tp_pair(
        instances: tuple[Instance, Instance]) -> None:
    prefill, decode = instances
    remote, local, tokens = [5, 2, 7], [1, 6, 3], 40
    params = hand_out(prefill, remote, tokens)
    if prefill.tp > 1:
        assert params["remote_rank_ports"] == [side.port for side in prefill.ranks]
    before = decode.cache()
    for side in decode.ranks:
        side.apply(StepPlan(loads=[Load("d", dict(params), tuple(local))]))
    received: list[set[str]] = [set() for _ in decode.ranks]
    sending: list[set[str]] = [set() for _ in prefill.ranks]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (all(received) and all(sending)):
        prefills, decodes = step_all(prefill, decode, {"p"})
        for seen, result in zip(received, decodes, strict=True):
            assert result.failures == 0 and not result.error_blocks
            seen |= result.recving
        for seen, result in zip(sending, prefills, strict=True):
            seen |= result.sending
    assert received == [{"d"}] * decode.tp, "every decode rank finished its load"
    assert sending == [{"p"}] * prefill.tp, "every prefill rank's lease ended by its readers"
    after = decode.cache()
    for src, dst in zip(remote, local, strict=True):
        assert torch.equal(after[:, dst], prefill.full[:, src]), f"block {src} -> {dst}"
    untouched = [b for b in range(BLOCKS) if b not in local]
    assert torch.equal(after[:, untouched], before[:, untouched])
    assert all(side.worker.num_leases == 0 for side in prefill.ranks)


@pytest.mark.parametrize("instances", [(2, 1)], indirect=True, ids=["prefill-tp2-decode-tp1"])
def test_a_lease_one_prefill_rank_no_longer_holds_is_not_read_and_is_released_on_each(
        instances: tuple[Instance, Instance]) -> None:
    prefill, decode = instances
    params = hand_out(prefill, [5, 2], 20)
    prefill.ranks[1].worker.end_lease(params["remote_request_id"], "abandoned")
    before = decode.cache()
    decode.ranks[0].apply(StepPlan(loads=[Load("d", dict(params), (1, 6))]))
    deadline = time.monotonic() + 30
    result = StepResult()
    while time.monotonic() < deadline and not result.failures:
        _, (result,) = step_all(prefill, decode, set())
    assert result.recving == {"d"} and result.error_blocks == {1, 6}, "refused at rank 1"
    assert torch.equal(decode.cache(), before), "nothing was read"
    ended = prefill.ranks[0].worker
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ended.num_leases:
        step_all(prefill, decode, {"p"})
    assert ended.num_leases == 0, "rank 0's lease was not left to its TTL"


def two_free_ports() -> int:
    """A base port such that it and the next one were both free a moment ago."""
    import socket

    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", base + 1))
            except OSError:
                continue  # the next port is taken: try another base
            return base
    raise AssertionError("no two consecutive free ports in 50 tries")


def test_with_a_fixed_side_channel_port_rank_r_listens_on_port_plus_r() -> None:
    for _ in range(5):  # another process may take the port between the probe and the bind
        base = two_free_ports()
        settings = ConnectorSettings(TransferConfig(side_channel_port=base, host_reads=False))
        spec = CacheSpec(BLOCK, 1, HEAD, torch.float32)
        side = WorkerSide(settings, "vllm-fixed-port", COMPAT, rank=1, tp_size=2,
                          total_kv_heads=HEADS)
        _, views = allocate_kv_cache(spec, BLOCKS, LAYERS, "LBHNC")
        try:
            side.register({f"layer.{i}": v for i, v in enumerate(views)}, spec, BLOCKS)
            break
        except OSError as exc:
            side.close()
            assert "already in use" in str(exc), exc
    else:
        raise AssertionError("the probed port was taken five times over")
    try:
        assert side.port == base + 1
        scheduler = SchedulerSide(settings.transfer, "vllm-fixed-port", BLOCK, 2)
        assert scheduler.side_channel_ports == (base, base + 1), "known without a handshake"
    finally:
        side.close()


REPAIR_S = 5.0  # a lost "done" is repaired within this (the lease TTL here is 30 s)


@pytest.mark.parametrize("instances", [(1, 2)], indirect=True, ids=["prefill-tp1-decode-tp2"])
def test_lost_notifications_are_repaired_reader_by_reader_over_the_side_channel(
        instances: tuple[Instance, Instance], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every NIXL notification to the prefill is lost (its rank takes them off the agent
    and drops them). Decode rank 0 reads first: its side-channel report counts one of
    the lease's two readers, and the lease stays while rank 1 has not read. Rank 1's
    report then ends it "done", within REPAIR_S of that read, far below the TTL."""
    prefill, decode = instances
    table = prefill.ranks[0].worker._leases
    monkeypatch.setattr(table, "receive", lambda _notifications: None)
    params = hand_out(prefill, [5, 2, 7], 40)
    lease_id = params["remote_request_id"]
    load = StepPlan(loads=[Load("d", dict(params), (1, 6, 3))])
    sending: set[str] = set()

    def step_until(rank: int) -> float:
        decode.ranks[rank].apply(load)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sending.update(prefill.ranks[0].poll({"p"}).sending)
            result = decode.ranks[rank].poll(set())
            assert result.failures == 0
            if result.recving == {"d"}:
                return time.monotonic()
            time.sleep(0.002)
        raise AssertionError(f"decode rank {rank} did not finish its load")

    step_until(0)
    settle = time.monotonic() + 1.0  # its report arrives within milliseconds
    while time.monotonic() < settle:
        sending.update(prefill.ranks[0].poll({"p"}).sending)
        time.sleep(0.01)
    assert prefill.ranks[0].worker.holds_lease(lease_id), \
        "one reader's done ended a lease another decode rank still reads"
    read_at = step_until(1)
    while "p" not in sending and time.monotonic() < read_at + REPAIR_S:
        sending.update(prefill.ranks[0].poll({"p"}).sending)
        time.sleep(0.005)
    assert "p" in sending, f"the lease was not freed within {REPAIR_S} s of the last read"
    assert prefill.ranks[0].worker.num_leases == 0
    assert torch.equal(decode.cache()[:, [1, 6, 3]], prefill.full[:, [5, 2, 7]])


@pytest.mark.parametrize("instances", [(1, 1)], indirect=True, ids=["tp1-tp1"])
def test_a_load_given_up_with_reads_in_flight_reaches_vllm_only_once_they_ended(
        instances: tuple[Instance, Instance], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM recomputes a failed load in the same blocks (or frees them): a READ given up
    while NIXL still reports it in flight may land there later, so the failure is
    reported only once it ended."""
    from test_stale_reads import StuckRead

    prefill, decode = instances
    side = decode.ranks[0]
    warm = hand_out(prefill, [1], 8)
    side.apply(StepPlan(loads=[Load("warm", dict(warm), (1,))]))  # handshake + connect
    deadline = time.monotonic() + 30
    while "warm" not in step_all(prefill, decode, {"p"})[1][0].recving:
        assert time.monotonic() < deadline, "the warm-up load never ended"
    stuck = StuckRead()
    monkeypatch.setattr(side.worker._agent, "read", lambda *a, **k: stuck)
    side.worker.read_timeout = 0.5
    side.apply(StepPlan(loads=[Load("d", dict(hand_out(prefill, [5, 2], 20)), (3, 4))]))
    seen = StepResult()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # the read fails after 0.5 s: vLLM hears nothing
        seen = step_all(prefill, decode, {"p"})[1][0]
        assert not seen.recving and not seen.error_blocks, seen
        assert not stuck.released
        time.sleep(0.01)
    stuck.land()
    deadline = time.monotonic() + 10
    while not seen.recving:
        assert time.monotonic() < deadline, "the load never reached vLLM once it ended"
        seen = step_all(prefill, decode, {"p"})[1][0]
    assert seen.recving == {"d"} and seen.error_blocks == {3, 4} and seen.failures == 1
