"""Converted reads (:mod:`kvxfer.plan.staging`), proven by executing them: the staging
descriptors run as byte copies into a real host buffer, the conversion places the
heads, and the decode views must equal a view-level assignment head by head (token by
token of each logical block where a side keeps kernel blocks)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_descriptors import (
    LAYOUTS,
    TP_PAIRS,
    Rank,
    block_sizes,
    expect_compatible,
    head_ranges,
    kernel_ratio,
    make_rank,
    make_views_like,
    pick_ids,
    spec_for,
)

from kvxfer.plan.descriptors import IncompatibleLayoutError, PeerReadPlan
from kvxfer.plan.staging import StagedRead, layer_groups, plan_reads
from kvxfer.plan.topology import read_plan
from kvxfer.transfer.converted import host_reads
from kvxfer.transfer.converted.host_reads import Canary, plan_host_read
from kvxfer.transfer.converted.mapped_reads import map_prefill, shared_offer, shared_zeros


def run_staged(local: Rank, remote: Rank, plan: StagedRead, local_ids: np.ndarray,
               remote_ids: np.ndarray) -> int:
    """READ into staging by byte copies, then convert; the number of descriptors."""
    lids, rids = plan.ids(local_ids, remote_ids)
    staging = torch.zeros(len(rids) * plan.bytes_per_block, dtype=torch.uint8)
    descs = plan.descriptors(rids, staging.data_ptr())
    assert int(descs.local[:, 1].sum()) == staging.numel()
    dst = staging.numpy()
    for (laddr, length, _), (raddr, _, _) in zip(descs.local.tolist(), descs.remote.tolist(),
                                                 strict=True):
        src = next(raw for raw in remote.buffers
                   if raw.data_ptr() <= raddr and raddr + length <= raw.data_ptr() + raw.numel())
        offset = laddr - staging.data_ptr()
        start = raddr - src.data_ptr()
        dst[offset:offset + length] = src.numpy()[start:start + length]
    plan.convert(staging, layer_groups(local.views), torch.from_numpy(lids),
                 remote_blocks=len(rids))
    return len(descs)


@st.composite
def conversions(draw: st.DrawFn) -> dict:
    local_tp, remote_tp = draw(st.sampled_from(TP_PAIRS))
    total = draw(st.sampled_from([h for h in (1, 2, 4, 8)
                                  if all((h % t == 0) if h >= t else (t % h == 0)
                                         for t in (local_tp, remote_tp))]))
    return {"local_tp": local_tp, "remote_tp": remote_tp, "total": total,
            "dtype": draw(st.sampled_from([torch.float16, torch.float32])),
            "local_rank": draw(st.integers(0, local_tp - 1)),
            "local_layout": draw(st.sampled_from(LAYOUTS)),
            "remote_layout": draw(st.sampled_from(LAYOUTS)),
            "block_size": draw(st.sampled_from([2, 4])), "head_size": draw(st.sampled_from([1, 3])),
            # the other side's blocks are ratio x larger (decode larger when positive)
            "ratio": draw(st.sampled_from([1, 1, 2, 4, -2, -4])),
            "pad": draw(st.sampled_from([0, 4])), "groups": draw(st.booleans()),
            "layers": draw(st.integers(1, 3)), "blocks": draw(st.integers(1, 7)),
            "separate_storage": draw(st.booleans()),
            "ids": draw(st.sampled_from(["random", "consecutive", "all"])),
            # kernel blocks per block on each side, at most (see kernel_ratio)
            "local_kernel": draw(st.sampled_from([1, 1, 2, 4])),
            "remote_kernel": draw(st.sampled_from([1, 1, 2, 4])),
            # ranges per host-read call: Linux's limit, or few enough to cut every block
            "iov_max": draw(st.sampled_from([1024, 3])),
            "seed": draw(st.integers(0, 2**31))}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversions())
def test_every_pair_byte_copies_refuse_is_converted_exactly(s: dict) -> None:
    rng = np.random.default_rng(s["seed"])
    local_bs, remote_bs = block_sizes(s)
    local_spec = spec_for(s, s["local_tp"], local_bs)
    remote_spec = spec_for(s, s["remote_tp"], remote_bs)
    local_kr = kernel_ratio(local_spec, s["local_kernel"])
    remote_kr = kernel_ratio(remote_spec, s["remote_kernel"])
    local = make_rank(local_spec, s["local_layout"], s["blocks"], s["layers"],
                      s["separate_storage"] and s["local_layout"].is_layer_compact, rng, local_kr)
    plan = read_plan(s["local_rank"], s["local_tp"], s["remote_tp"], s["total"])
    # the prefill's cache in shared memory, so that a mapped read runs too
    remotes = {p.remote_rank: make_rank(remote_spec, s["remote_layout"], s["blocks"] + 2,
                                        s["layers"], False, rng, remote_kr, shared_zeros)
               for p in plan}
    small = min(local_bs, remote_bs)
    lr, rr = local_bs // small, remote_bs // small  # blocks per larger block: one is 1
    # f blocks on the smaller-block side, ceil(f / ratio) on the other
    most = min(s["blocks"] * lr // rr if lr >= rr else s["blocks"],
               (s["blocks"] + 2) * rr // lr if rr >= lr else s["blocks"] + 2)
    fine = most if s["ids"] == "all" else int(rng.integers(1, most + 1))
    local_ids = pick_ids(s["ids"], -(-fine // lr), s["blocks"], rng)
    remote_ids = pick_ids(s["ids"], -(-fine // rr), s["blocks"] + 2, rng)
    full = all(p.count == local_spec.num_kv_heads == remote_spec.num_kv_heads for p in plan)
    direct = expect_compatible(s["local_layout"], s["remote_layout"], local_spec, remote_spec,
                               full, local_kr, remote_kr)
    reads = plan_reads(local.geometry, {r: x.geometry for r, x in remotes.items()}, plan,
                       local_tp=s["local_tp"], remote_tp=s["remote_tp"])
    # byte copies where they place every head, staging only where they cannot
    assert all(isinstance(r, PeerReadPlan) == direct for r in reads), (direct, reads)
    if direct:
        return
    expected = [raw.clone() for raw in local.buffers]
    expected_views = make_views_like(local, expected)
    position = np.arange(fine * small)  # every token, in order on both sides
    lkernel, lrow = (torch.from_numpy(a) for a in local.kernel_rows(
        local_ids[position // local_bs], position % local_bs))
    for piece in plan:
        remote = remotes[piece.remote_rank]
        rkernel, rrow = (torch.from_numpy(a) for a in remote.kernel_rows(
            remote_ids[position // remote_bs], position % remote_bs))
        for rh, lh, n in head_ranges(local_spec, remote_spec, piece.remote_head_offset,
                                     piece.local_head_offset, piece.count):
            lheads, rheads = torch.arange(lh, lh + n)[None], torch.arange(rh, rh + n)[None]
            for layer in range(s["layers"]):
                expected_views[layer][lkernel[:, None], lheads, lrow[:, None]] = \
                    remote.views[layer][rkernel[:, None], rheads, rrow[:, None]]
    # the same reads as host reads (kvxfer.transfer.converted.host_reads) and from the mapped cache
    # (kvxfer.transfer.converted.mapped_reads), this process standing in for the prefill's, into
    # buffers of their own
    host, mapped = [raw.clone() for raw in local.buffers], [raw.clone() for raw in local.buffers]
    host_groups = layer_groups(make_views_like(local, host))
    mapped_groups = layer_groups(make_views_like(local, mapped))
    canary = Canary()
    for read in reads:
        assert isinstance(read, StagedRead)
        remote = remotes[read.remote_rank]
        offer = shared_offer(canary, remote.plan.memory)
        assert offer is not None and offer.memory
        from_map = map_prefill(read, mapped_groups, offer)
        assert from_map is not None  # one allocation: its chunks lie at fixed strides
        lids, rids = read.ids(local_ids, remote_ids)
        paired = min(len(lids) * local_bs, len(rids) * remote_bs)  # tokens placed
        # two copy threads: the copy cut into shares of blocks, and of layer groups where
        # there are fewer blocks than shares
        with ThreadPoolExecutor(1) as pool:
            assert from_map.copy(lids, rids, pool, threads=2) == (
                paired * read.placed_per_block // remote_bs, 2)
        run_staged(local, remote, read, local_ids, remote_ids)
        with mock.patch.object(host_reads, "IOV_MAX", s["iov_max"]):
            runs = plan_host_read(read, host_groups, offer, min_run_bytes=0)
            if local_bs != remote_bs:  # not one template per block: read through staging
                assert runs is None
                continue
            assert runs is not None and runs.bytes_per_block == read.placed_per_block
            lids, rids = read.ids(local_ids, remote_ids)
            assert runs.copy(lids, rids)[0] == len(lids) * read.placed_per_block
    for got, want in zip(local.buffers, expected, strict=True):
        assert torch.equal(got, want), "decode buffer differs from the view-level expectation"
    for got, want in zip(mapped, expected, strict=True):
        assert torch.equal(got, want), "a mapped read differs from the view-level expectation"
    for got, want in zip(host if local_bs == remote_bs else [], expected, strict=False):
        assert torch.equal(got, want), "a host read differs from the view-level expectation"


def test_tokens_outside_heads_read_whole_pages_in_one_run_per_block() -> None:
    """LBNHC TP 1 -> decode rank of TP 2: every layer page of a block is one staging run
    (a BLNHC prefill's block, all layers, is even one run)."""
    from kvxfer.plan.layout import CacheSpec, KVCacheLayout

    rng = np.random.default_rng(0)
    for layout, runs in ((KVCacheLayout.LBNHC, 4 * 5), (KVCacheLayout.BLNHC, 5)):
        remote = make_rank(CacheSpec(4, 8, 2, torch.float16), layout, 12, 4, False, rng)
        local = make_rank(CacheSpec(4, 4, 2, torch.float16), KVCacheLayout.LBHNC, 6, 4, False,
                          rng)
        (read,) = plan_reads(local.geometry, {0: remote.geometry}, read_plan(1, 2, 1, 8),
                             local_tp=2, remote_tp=1)
        assert isinstance(read, StagedRead)
        ids = np.array([0, 2, 4, 6, 8])  # never adjacent: no run crosses blocks
        assert run_staged(local, remote, read, np.arange(5), ids) == runs
        assert read.placed_per_block * 2 == read.bytes_per_block  # half the heads kept


def test_staging_refuses_what_it_cannot_bridge() -> None:
    from kvxfer.plan.layout import CacheSpec, KVCacheLayout

    rng = np.random.default_rng(1)
    remote = make_rank(CacheSpec(4, 8, 2, torch.float16), KVCacheLayout.LBNHC, 4, 2, False, rng)
    local = make_rank(CacheSpec(6, 4, 2, torch.float16), KVCacheLayout.LBHNC, 4, 2, False, rng)
    with pytest.raises(IncompatibleLayoutError, match="decode block size 6 and prefill block "
                                                      "size 4: one must be a multiple"):
        plan_reads(local.geometry, {0: remote.geometry}, read_plan(0, 2, 1, 8), local_tp=2,
                   remote_tp=1)
    wider = make_rank(CacheSpec(4, 4, 3, torch.float16), KVCacheLayout.LBHNC, 4, 2, False, rng)
    with pytest.raises(IncompatibleLayoutError, match="head size or dtype differ"):
        plan_reads(wider.geometry, {0: remote.geometry}, read_plan(0, 2, 1, 8), local_tp=2,
                   remote_tp=1)


def logical_blocks(view: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[B * r, H, k, X]`` kernel blocks as the ``[B, H, r * k, X]`` logical blocks."""
    return view.unflatten(0, (-1, ratio)).transpose(1, 2).flatten(2, 3)


@pytest.mark.parametrize(("remote_packing", "local_packing", "local_layout", "ratios", "sizes"), [
    ("vllm-cpu-vec", "token", "LBNHC", (1, 1), (4, 4)),
    ("token", "vllm-cpu-vec", "BLHNC", (1, 1), (4, 4)),
    ("vllm-cpu-vec", "token", "BHLNC", (1, 1), (4, 4)),
    # kernel blocks: a vllm-cpu-vec head block depends on its kernel block size
    ("vllm-cpu-vec", "token", "LBNHC", (2, 1), (4, 4)),
    ("token", "vllm-cpu-vec", "BLHNC", (1, 2), (4, 4)),
    ("vllm-cpu-vec", "vllm-cpu-vec", "LBHNC", (2, 1), (4, 4)),
    ("vllm-cpu-vec", "vllm-cpu-vec", "BLHNC", (4, 2), (4, 4)),
    # block sizes: a token-packing prefill of small blocks feeding vLLM's CPU cache of
    # larger ones (a kvxfer sidecar at 16 -> vLLM at 128, scaled down), and the reverse
    ("token", "vllm-cpu-vec", "LBHNC", (1, 1), (2, 8)),
    ("vllm-cpu-vec", "token", "LBNHC", (1, 1), (8, 2)),
    ("vllm-cpu-vec", "vllm-cpu-vec", "LBHNC", (1, 1), (2, 4)),
    # one kernel size, two block sizes: whole kernel blocks, local ones in request order
    ("token", "token", "LBNHC", (1, 2), (2, 4))])
def test_the_conversion_repacks_k_and_v_when_the_sides_pack_them_differently(
        remote_packing: str, local_packing: str, local_layout: str,
        ratios: tuple[int, int], sizes: tuple[int, int]) -> None:
    """vLLM's CPU packing (K transposed, then V, per head's block) on one side, token
    packing on the other: every K and V element lands where the decode's packing reads
    it, whether or not the layouts alone would have needed a conversion; likewise one
    packing at two kernel block sizes (``ratios``: prefill's, decode's) or two block sizes
    (``sizes``: prefill's, decode's; the request's tokens in order on both sides)."""
    from kvxfer.plan.layout import CacheSpec, KVCacheLayout

    rng = np.random.default_rng(2)
    remote = make_rank(CacheSpec(sizes[0], 2, 3, torch.float32), KVCacheLayout.LBHNC, 6 * 4,
                       2, False, rng, ratios[0])
    local = make_rank(CacheSpec(sizes[1], 2, 3, torch.float32), KVCacheLayout[local_layout],
                      5 * 4, 2, False, rng, ratios[1])
    (read,) = plan_reads(replace(local.geometry, kv_packing=local_packing),
                         {0: replace(remote.geometry, kv_packing=remote_packing)},
                         read_plan(0, 1, 1, 2))
    assert isinstance(read, StagedRead)
    tokens = 11  # the last block of each side partly used
    lids = np.array([4, 0, 2, 19, 7, 11])[:-(-tokens // sizes[1])]
    rids = np.array([1, 5, 3, 23, 8, 12])[:-(-tokens // sizes[0])]
    lids, rids = read.ids(lids, rids)
    staging = torch.zeros(len(rids) * read.bytes_per_block, dtype=torch.uint8)
    descs = read.descriptors(rids, staging.data_ptr())
    src = remote.buffers[0]
    for (laddr, length, _), (raddr, _, _) in zip(descs.local.tolist(), descs.remote.tolist(),
                                                 strict=True):
        offset, start = laddr - staging.data_ptr(), raddr - src.data_ptr()
        staging.numpy()[offset:offset + length] = src.numpy()[start:start + length]
    read.convert(staging, layer_groups(local.views), torch.from_numpy(lids), remote_packing,
                 local_packing, len(rids))
    count = min(len(lids) * sizes[1], len(rids) * sizes[0])  # tokens paired
    for layer in range(2):
        for got, want in zip(token_kv(local.views[layer], ratios[1], lids, local_packing),
                             token_kv(remote.views[layer], ratios[0], rids, remote_packing),
                             strict=True):
            assert torch.equal(got[:, :count], want[:, :count])


def token_kv(view: torch.Tensor, ratio: int, ids: np.ndarray, packing: str
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of logical blocks ``ids`` of a kernel-block view packed as ``packing``,
    ``[H, tokens, X]`` each in token order, as int32 bits (random bytes include NaNs)."""
    from kvxfer.plan.packing import kv_views

    k, v = (logical_blocks(x, ratio)[ids].transpose(0, 1).flatten(1, 2).contiguous()
            .view(torch.int32) for x in kv_views(view, packing))
    return k, v


def head_split_read(rng: np.random.Generator) -> tuple[StagedRead, Rank]:
    """Decode rank 0 of TP 2 (LBHNC) reading an LBNHC TP 1 prefill's pages: a staged read;
    with the decode rank."""
    from kvxfer.plan.layout import CacheSpec, KVCacheLayout

    remote = make_rank(CacheSpec(4, 8, 2, torch.float16), KVCacheLayout.LBNHC, 12, 2, False, rng)
    local = make_rank(CacheSpec(4, 4, 2, torch.float16), KVCacheLayout.LBHNC, 12, 2, False, rng)
    (read,) = plan_reads(local.geometry, {0: remote.geometry}, read_plan(0, 2, 1, 8),
                         local_tp=2, remote_tp=1)
    assert isinstance(read, StagedRead)
    return read, local


def test_the_staging_pool_reuses_buffers_holds_failed_ones_and_bounds_itself() -> None:
    """Real NIXL registrations: a read takes one buffer per staged rank or none; a landed
    read's buffer is reused; a failed read's is held until its prefill is dropped."""
    from kvxfer.transfer.converted.staging_pool import (
        CHUNK_BYTES,
        Placement,
        StagedPiece,
        StagingPool,
        StagingTooSmall,
    )
    from kvxfer.transfer.nixl_agent import NixlAgent

    read, local = head_split_read(np.random.default_rng(3))
    ids = np.arange(4)
    piece = StagedPiece(read, ids, ids, (Placement(read, layer_groups(local.views)),))
    with NixlAgent("staging-pool-test") as agent:
        pool = StagingPool(agent, "test", limit=2 * CHUNK_BYTES)
        first, second = pool.take([piece]), pool.take([piece])
        assert first is not None and second is not None
        assert pool.take([piece]) is None  # both buffers in use: wait
        buffer = first.stagings[0].buffer
        pool.settle(first, "prefill-a")  # never posted: straight back to the pool
        again = pool.take([piece])
        assert again is not None and again.stagings[0].buffer is buffer  # reused
        second.parts[0].transfer = object()  # posted, never landed: a READ may still write
        pool.settle(second, "prefill-b")
        assert pool.held == 1 and pool.take([piece]) is None
        pool.drop_held("prefill-b")
        assert pool.held == 0 and pool.take([piece]) is not None
        with pytest.raises(StagingTooSmall, match="more than the 128 MiB limit"):
            pool.take([piece] * 3)  # three buffers of one chunk: never fits
        pool.close()


def test_a_packing_per_kernel_block_is_never_cut_by_byte_copies() -> None:
    """vllm-cpu-vec keeps K transposed per head's kernel block, so a run of tokens is no
    byte run: at two kernel or block sizes the read is converted (exactly: the property
    test above), at one it is byte copies."""
    from kvxfer.plan.layout import CacheSpec, KVCacheLayout

    rng = np.random.default_rng(5)
    small = make_rank(CacheSpec(4, 2, 3, torch.float32), KVCacheLayout.LBHNC, 4, 2, False, rng)
    large = make_rank(CacheSpec(8, 2, 3, torch.float32), KVCacheLayout.LBHNC, 4, 2, False, rng)
    vec = "vllm-cpu-vec"
    for local, remote in ((large, small), (small, large)):
        (read,) = plan_reads(replace(local.geometry, kv_packing=vec),
                             {0: replace(remote.geometry, kv_packing=vec)}, read_plan(0, 1, 1, 2))
        assert isinstance(read, StagedRead)
    (direct,) = plan_reads(replace(small.geometry, kv_packing=vec),  # one size: byte copies
                           {0: replace(small.geometry, kv_packing=vec)}, read_plan(0, 1, 1, 2))
    assert isinstance(direct, PeerReadPlan)


def test_packings_no_conversion_knows_are_refused_naming_both() -> None:
    from kvxfer.plan.layout import CacheSpec, KVCacheLayout

    rng = np.random.default_rng(4)
    side = make_rank(CacheSpec(4, 2, 3, torch.float32), KVCacheLayout.LBHNC, 4, 2, False, rng)
    with pytest.raises(IncompatibleLayoutError, match="decode packs K and V as 'token', prefill "
                                                      "as 'vllm-cpu-amx'; kvxfer converts only"):
        plan_reads(side.geometry, {0: replace(side.geometry, kv_packing="vllm-cpu-amx")},
                   read_plan(0, 1, 1, 2))


def test_layer_groups_join_views_of_one_allocation_and_keep_others_apart() -> None:
    """A converted read places a block's layers in one copy only where the views are one
    allocation at a fixed layer stride; any other view is its own group, and each group
    sees exactly its views' elements."""
    from kvxfer.plan.staging import layer_groups

    raw = torch.arange(3 * 5 * 2 * 4 * 6, dtype=torch.float32).view(3, 5, 4, 2, 6)
    joined = [raw[layer].permute(0, 2, 1, 3) for layer in range(3)]  # LBNHC, [B, H, N, C]
    separate = torch.zeros(5, 2, 4, 6)
    odd = torch.zeros(5, 2, 4, 6)[:, :1]  # another shape: never joined
    groups = layer_groups([*joined, separate, separate.clone(), odd])
    assert [(first, group.shape[1]) for first, group in groups] == [(0, 3), (3, 1), (4, 1),
                                                                    (5, 1)]
    (_, stacked) = groups[0]
    for layer, view in enumerate(joined):
        assert torch.equal(stacked[:, layer], view)
    stacked[2, 1].fill_(-1)  # a view, not a copy
    assert bool((joined[1][2] == -1).all()) and not bool((joined[0][2] == -1).any())
    assert layer_groups(joined[:1])[0][1].shape == (5, 1, 2, 4, 6)


def test_every_landed_part_is_handed_to_the_converter_at_once() -> None:
    """A converted read's parts land one after the other while earlier ones are placed:
    each landed part must be queued for placing as soon as the pool sees it, not only
    after the placements before it finished (which left the converter idle between
    READs and placed the tail one part per worker-loop tick)."""
    import threading

    from kvxfer.transfer.converted import staging_pool
    from kvxfer.transfer.converted.staging_pool import Placement, StagedPiece, StagingPool
    from kvxfer.transfer.nixl_agent import NixlAgent

    read, local = head_split_read(np.random.default_rng(5))

    class Landed:
        def state(self) -> str:
            return "DONE"

    started: list[int] = []
    release = threading.Event()

    def convert(self: StagedRead, staging: torch.Tensor, *_: object) -> None:
        started.append(staging.data_ptr())
        assert release.wait(10)

    ids = np.arange(4)
    piece = StagedPiece(read, ids, ids, (Placement(read, layer_groups(local.views)),))
    with NixlAgent("staging-pool-order") as agent, \
            mock.patch.object(staging_pool, "PART_BYTES", read.bytes_per_block), \
            mock.patch.object(StagedRead, "convert", convert):
        pool = StagingPool(agent, "test")
        job = pool.take([piece])
        assert job is not None and len(job.parts) == 4
        for part in job.parts:
            part.transfer = Landed()
        assert pool.place_landed(job) is False
        assert all(part.placed is not None for part in job.parts)  # all queued, none done
        release.set()
        for part in job.parts:
            assert part.placed is not None
            part.placed.result(timeout=10)
        assert pool.place_landed(job) is True
        assert len(started) == 4
        pool.settle(job, "prefill")
        pool.close()
