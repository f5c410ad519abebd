"""Routes (:mod:`kvxfer.transfer.routes`): a direct read copied out of a mapped cache places
exactly the bytes its NIXL descriptors would, in every layout and TP pair byte copies
serve; between real processes a same-host direct read takes the mapped path and a peer
that offers no mapping, or sits on another host, is read byte-exact over NIXL, each path
counted for metrics with its ceiling; and a peer's candidate paths are chosen from their
probes as documented. Every layout and TP pair over both paths: test_transfer."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_descriptors import LAYOUTS, execute, make_rank
from test_transfer import check_blocks, decode_instance, params_for

from kvxfer.harness.loopback import CacheConfig, PrefillProcess
from kvxfer.plan.descriptors import PeerReadPlan, build_requests_descriptors
from kvxfer.plan.layout import CacheSpec
from kvxfer.plan.regions import MemoryRegion
from kvxfer.plan.staging import layer_groups, plan_reads, plan_staged_read
from kvxfer.plan.topology import heads_per_rank, read_plan
from kvxfer.transfer import routes
from kvxfer.transfer.converted.host_reads import Canary
from kvxfer.transfer.converted.mapped_reads import map_prefill, shared_offer, shared_zeros
from kvxfer.transfer.routes import MARGIN, PROBE_MIN_BYTES, Route, choose

TOTAL_HEADS = 4
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (1, 4), (4, 2)]
# a head split of a cache that keeps tokens outside heads needs a conversion, not a copy
DIRECT = [(layout, tp) for layout in LAYOUTS for tp in TP_PAIRS
          if layout.heads_outside_tokens or tp[0] == tp[1]]


@pytest.mark.parametrize("separate", [False, True], ids=["packed", "head-slots"])
@pytest.mark.parametrize(("layout", "tp"), DIRECT, ids=[f"{lay.name}-{p}-{d}"
                                                        for lay, (d, p) in DIRECT])
def test_a_mapped_direct_read_places_what_its_descriptors_do(layout: Any,
                                                             tp: tuple[int, int],
                                                             separate: bool) -> None:
    """The prefill's caches in offered shared memory (this process's own, mapped again);
    two decode ranks alike: one given the request's descriptors run as byte copies, one
    the mapped copy of the same plan's heads (plan_staged_read). Every byte of the two
    decode caches is equal, the untouched blocks included."""
    local_tp, remote_tp = tp
    rng = np.random.default_rng(17 * local_tp + remote_tp)
    remote_spec = CacheSpec(4, heads_per_rank(remote_tp, TOTAL_HEADS), 3, torch.float16,
                            separate_kv_head_groups=separate)
    local_spec = CacheSpec(4, heads_per_rank(local_tp, TOTAL_HEADS), 3, torch.float16,
                           separate_kv_head_groups=separate)
    remotes = {rank: make_rank(remote_spec, layout, 7, 3, False, rng, zeros=shared_zeros)
               for rank in range(remote_tp)}
    seed = int(rng.integers(2**31))
    by_descs, by_copy = (make_rank(local_spec, layout, 6, 3, False, np.random.default_rng(seed))
                         for _ in range(2))
    local_rank = local_tp - 1
    slices = read_plan(local_rank, local_tp, remote_tp, TOTAL_HEADS)
    plans = plan_reads(by_descs.geometry, {r: x.geometry for r, x in remotes.items()}, slices,
                       local_tp=local_tp, remote_tp=remote_tp)
    assert plans and all(isinstance(p, PeerReadPlan) for p in plans)
    local_ids, remote_ids = [4, 0, 2, 3], [6, 1, 3, 4]
    for rank_descs in build_requests_descriptors(plans, local_ids, remote_ids):
        execute(by_descs, remotes[rank_descs.remote_rank], rank_descs.local, rank_descs.remote)
    canary = Canary()
    for plan in plans:
        rank = plan.remote_rank
        offer = shared_offer(canary, remotes[rank].plan.memory)
        assert offer is not None
        copy = plan_staged_read(by_copy.geometry, remotes[rank].geometry, rank,
                                [s for s in slices if s.remote_rank == rank])
        mapped = map_prefill(copy, layer_groups(by_copy.views), offer)
        assert mapped is not None, "kvxfer's caches lie at fixed strides in one buffer"
        mapped.copy(*copy.ids(local_ids, remote_ids))
    for want, got in zip(by_descs.buffers, by_copy.buffers, strict=True):
        assert torch.equal(want, got)


# -- between real processes: the path taken, counted; a peer on another host -------------

@pytest.mark.parametrize("path", ["mapped", "nixl"])
def test_a_peers_path_is_counted_with_what_it_moved_and_its_ceiling(prefill: PrefillProcess,
                                                                     path: str) -> None:
    """A direct read from a prefill on this host that offers its cache mapped is a copy out
    of it (no NIXL descriptor), one from a prefill that does not is NIXL READs; either
    ends the lease with "done" over NIXL, and the worker counts, for metrics, the path it
    chose at connect with the ceiling its probe reached, then the bytes and seconds of
    the path's reads."""
    pcfg = CacheConfig(layout="LBHNC", tp=2, num_blocks=16, head_size=64,
                       shared_memory=path == "mapped")
    remote = prefill.create(pcfg)
    decode = decode_instance(replace(pcfg, tp=1, shared_memory=True))
    try:
        prefill.hold(remote["engine_id"], "req", [3, 9, 4], ttl=30)
        decode.read("r", params_for(remote, "req", [3, 9, 4], tp_size=2), [0, 7, 2])
        stats, failed = decode.wait(["r"])
        assert failed == {}
        check_blocks(decode, pcfg, [0, 7, 2], [3, 9, 4])
        assert prefill.wait_released(remote["engine_id"], {"req"}) == {"req": "done"}
        (read,) = stats["r"]
        assert read.path_names == (path,) and [p.path for p in read.paths] == [path]
        assert read.mapped_ranks == (2 if path == "mapped" else 0)  # both prefill ranks
        # NIXL times its own READs (the transfer time NixlConnector reports), not a copy
        assert read.posted_seconds is not None
        if path == "nixl":
            assert read.nixl_seconds is not None
            assert 0 < read.nixl_seconds <= read.posted_seconds
        else:
            assert read.nixl_seconds is None
        moved = decode.workers[0].take_counts().paths
        assert set(moved) == {(remote["engine_id"], path)}
        traffic = moved[remote["engine_id"], path]
        assert traffic.num_bytes == read.num_bytes and traffic.seconds > 0
        assert traffic.ceiling is not None and traffic.ceiling > 0
    finally:
        decode.close()


def test_a_prefill_on_another_host_is_read_over_nixl(prefill: PrefillProcess,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill that offers its mapped cache, seen from another host (its host identity is
    not this one's): nothing is copied on this host; its direct reads are NIXL READs,
    byte-exact, ending the lease with "done"."""
    from kvxfer.transfer.converted import host_reads

    monkeypatch.setattr(host_reads, "host_identity", lambda: "elsewhere/ns")
    pcfg = CacheConfig(layout="BLHNC", tp=1, num_blocks=16)
    remote = prefill.create(pcfg)
    decode = decode_instance(replace(pcfg, tp=2))
    try:
        prefill.hold(remote["engine_id"], "far", [5, 1, 12], ttl=30)
        decode.read("f", params_for(remote, "far", [5, 1, 12]), [2, 3, 10])
        stats, failed = decode.wait(["f"])
        assert failed == {}
        check_blocks(decode, pcfg, [2, 3, 10], [5, 1, 12])
        assert [s.path_names for s in stats["f"]] == [("nixl",)] * 2
        assert [s.host_ranks for s in stats["f"]] == [0, 0]
        assert prefill.wait_released(remote["engine_id"], {"far"}) == {"far": "done"}
    finally:
        decode.close()


# -- choosing from the probes ---------------------------------------------------------------

BIG = MemoryRegion(4096, 64 << 20, 0)
TINY = MemoryRegion(4096, PROBE_MIN_BYTES // 2, 0)
OPTIONS = (Route("mapped", SimpleNamespace(remote_rank=0)),  # type: ignore[arg-type]
           Route("nixl", SimpleNamespace(remote_rank=0)))  # type: ignore[arg-type]


@pytest.mark.parametrize(("memory", "rates", "chosen"), [
    (BIG, {"mapped": 10e9, "nixl": 5e9}, "mapped"),
    (BIG, {"mapped": 5e9, "nixl": 5e9 * MARGIN * 0.99}, "mapped"),  # within the margin
    (BIG, {"mapped": 2e9, "nixl": 6e9}, "nixl"),  # clearly faster: taken
    (BIG, {"nixl": 6e9}, "nixl"),  # the mapped probe failed
    (BIG, {}, "mapped"),  # nothing probed (a GPU cache): the handshake's order
    (TINY, {"mapped": 1e9, "nixl": 6e9}, "mapped")])  # too small a probe to choose
def test_the_first_candidate_is_kept_unless_a_later_one_probes_clearly_faster(
        monkeypatch: pytest.MonkeyPatch, memory: MemoryRegion, rates: dict[str, float],
        chosen: str) -> None:
    monkeypatch.setattr(routes, "_probe", lambda _local, route, _agent, _memory:
                        rates.get(route.path))
    route, probed = choose(None, OPTIONS, "agent", memory)  # type: ignore[arg-type]
    assert probed == rates
    assert (route.path, route.ceiling) == (chosen, rates.get(chosen))


def test_probe_shares_cover_the_bytes_at_page_boundaries() -> None:
    assert routes._cuts(10 << 20, 2) == [(0, 5 << 20), (5 << 20, 10 << 20)]
    assert routes._cuts(5000, 3) == [(0, 0), (0, 0), (0, 5000)]  # shares of whole pages
    assert routes._cuts(3 * 4096 + 5, 3) == [(0, 4096), (4096, 8192), (8192, 3 * 4096 + 5)]


def _link(bytes_per_s: float, moves: list[int], first_s: float = 0.0):
    """A move at ``bytes_per_s`` that records what it was asked to move; its first move
    costs ``first_s`` more (a first use)."""
    def move(nbytes: int) -> None:
        time.sleep(nbytes / bytes_per_s + (first_s if not moves else 0.0))
        moves.append(nbytes)
    return move


def test_a_fast_path_is_timed_on_a_second_whole_probe() -> None:
    moves: list[int] = []
    rate = routes._rate(_link(2e9, moves), routes.PROBE_BYTES)
    assert moves == [PROBE_MIN_BYTES, routes.PROBE_BYTES, routes.PROBE_BYTES]
    assert 0.2e9 < rate <= 2e9


def test_a_slow_link_is_timed_on_its_first_mebibyte_alone() -> None:
    moves: list[int] = []
    started = time.monotonic()
    rate = routes._rate(_link(8e6, moves), routes.PROBE_BYTES)  # 8 MB/s: 4 s for 2 x 16 MiB
    assert moves == [PROBE_MIN_BYTES, PROBE_MIN_BYTES]
    assert time.monotonic() - started < 1.0
    assert 4e6 < rate <= 8e6


def test_a_slow_first_use_alone_does_not_make_a_path_slow() -> None:
    moves: list[int] = []
    routes._rate(_link(2e9, moves, first_s=0.2), routes.PROBE_BYTES)
    assert moves == [PROBE_MIN_BYTES, PROBE_MIN_BYTES, routes.PROBE_BYTES, routes.PROBE_BYTES]
