"""KV blocks moving for real: a prefill OS process, this process as decode, NIXL + ZMQ.

The prefill process fills its caches with a pattern naming every element's
(layer, block, global head, token, content); the decode side starts from a
sentinel and must end with exactly the prefill's bytes for its heads and blocks,
and nothing else changed. Prefill must see every lease released.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from kvxfer.harness.loopback import CacheConfig, LoopbackInstance, PrefillProcess, pattern
from kvxfer.plan.layout import KVCacheLayout, parse_layout
from kvxfer.wire import version


def decode_instance(cfg: CacheConfig) -> LoopbackInstance:
    return LoopbackInstance.create("decode", cfg, fill="sentinel")


def check_blocks(decode: LoopbackInstance, prefill_cfg: CacheConfig, local_ids: list[int],
                 remote_ids: list[int]) -> None:
    """Decode blocks hold the prefill pattern for the decode rank's heads; others untouched."""
    cfg = decode.cfg
    untouched = sorted(set(range(cfg.num_blocks)) - set(local_ids))
    # the pattern of prefill block rb, seen through the decode rank's heads
    seen = replace(prefill_cfg, tp=cfg.tp)
    for rank, caches in enumerate(decode.caches):
        for layer, view in enumerate(caches.values()):
            want = pattern(seen, rank, layer)
            got = view.to(torch.float32)
            assert torch.equal(got[local_ids], want[remote_ids]), \
                f"rank {rank} layer {layer} differs from the prefill's blocks"
            assert (got[untouched] == -1).all(), f"rank {rank} layer {layer}: other blocks changed"


def params_for(remote: dict, rid: str, ids: list[int], **over: object) -> dict:
    return {"remote_engine_id": remote["engine_id"], "remote_host": "127.0.0.1",
            "remote_port": remote["port"], "remote_block_ids": ids,
            "remote_request_id": rid, "tp_size": 1, **over}


def pick(rng: np.random.Generator, kind: str, count: int, limit: int) -> list[int]:
    if kind == "consecutive":
        start = int(rng.integers(0, limit - count + 1))
        return list(range(start, start + count))
    return [int(x) for x in rng.choice(limit, size=count, replace=False)]


# converted: tokens outside heads split for a TP change, or the two sides order heads and
# tokens differently (kvxfer.plan.staging; with these small heads, runs are too short for
# host reads, see test_converted_reads_are_host_read_on_one_host)
CONVERTED = [("LBNHC", "LBNHC", 1, 2), ("BLNHC", "BLNHC", 2, 1), ("LBNHC", "BLNHC", 2, 4),
             ("BLNHC", "LBHNC", 1, 2), ("LBHNC", "LBNHC", 1, 1), ("BHLNC", "BLNHC", 4, 2),
             ("BLNHC", "BHLNC", 1, 1), ("LHBNC", "LBNHC", 2, 1), ("LBNHC", "LHBNC", 1, 2)]
CASES = (
    [(lay.name, lay.name, 1, 1) for lay in KVCacheLayout]
    + [(lay, lay, p, d) for lay in ("LBHNC", "BLHNC", "BHLNC", "LHBNC")
       for p, d in ((1, 2), (2, 1), (1, 4), (4, 2))]
    + [("BLHNC", "LBHNC", 1, 1), ("BHLNC", "BLHNC", 2, 1), ("LHBNC", "LBHNC", 2, 1),
       ("BLHNC", "LHBNC", 1, 2)]
    + CONVERTED
)


# each case from a prefill on this host that offers its cache mapped (kvxfer's default:
# every rank is copied out of it, direct and converted reads alike), and each direct one
# also from a prefill that offers no mapped cache (as one on another host): NIXL READs
# (converted reads without a mapped cache: test_converted_reads_are_host_read_on_one_host)
PATH_CASES = [(*case, "mapped") for case in CASES] + \
    [(*case, "nixl") for case in CASES if case not in CONVERTED]


@pytest.mark.parametrize(("prefill_layout", "decode_layout", "prefill_tp", "decode_tp", "path"),
                         PATH_CASES)
def test_two_requests_in_flight_arrive_byte_exact(prefill: PrefillProcess, prefill_layout: str,
                                                  decode_layout: str, prefill_tp: int,
                                                  decode_tp: int, path: str) -> None:
    pcfg = CacheConfig(layout=prefill_layout, tp=prefill_tp, num_blocks=24,
                       shared_memory=path == "mapped")
    dcfg = CacheConfig(layout=decode_layout, tp=decode_tp, num_blocks=20)
    stats = two_requests_byte_exact(prefill, pcfg, dcfg, CASES.index(
        (prefill_layout, decode_layout, prefill_tp, decode_tp)))
    assert {s.path_names for s in stats} == {(path,)}


# K and V as head slots of their own (vLLM's num_head_slots = 2 x KV heads): every layout,
# and the TP pairs, converted ones included
HEAD_SLOT_CASES = ([(lay.name, lay.name, 1, 1) for lay in KVCacheLayout]
                   + [(lay, lay, p, d) for lay in ("LBHNC", "BLHNC", "BHLNC", "LHBNC")
                      for p, d in ((1, 2), (2, 1))]
                   + [("LBNHC", "LBNHC", 1, 2), ("LHBNC", "BLNHC", 2, 1)])


@pytest.mark.parametrize(("prefill_layout", "decode_layout", "prefill_tp", "decode_tp"),
                         HEAD_SLOT_CASES)
def test_separate_kv_head_slots_arrive_byte_exact(prefill: PrefillProcess, prefill_layout: str,
                                                  decode_layout: str, prefill_tp: int,
                                                  decode_tp: int) -> None:
    pcfg = CacheConfig(layout=prefill_layout, tp=prefill_tp, num_blocks=24,
                       separate_kv_head_groups=True)
    dcfg = CacheConfig(layout=decode_layout, tp=decode_tp, num_blocks=20,
                       separate_kv_head_groups=True)
    stats = two_requests_byte_exact(prefill, pcfg, dcfg, HEAD_SLOT_CASES.index(
        (prefill_layout, decode_layout, prefill_tp, decode_tp)))
    assert {s.path_names for s in stats} == {("mapped",)}


def two_requests_byte_exact(prefill: PrefillProcess, pcfg: CacheConfig, dcfg: CacheConfig,
                            seed: int) -> list[Any]:
    """Two requests in flight at once, random and consecutive blocks, land byte-exact and
    release their leases; their ReadStats, each rank's."""
    prefill_tp = pcfg.tp
    remote = prefill.create(pcfg)
    decode = decode_instance(dcfg)
    try:
        rng = np.random.default_rng(seed)
        remote_a, remote_b = pick(rng, "random", 5, 12), pick(rng, "consecutive", 6, 12)
        remote_b = [12 + b for b in remote_b]  # disjoint from a
        local = pick(rng, "random", 11, 20)
        local_a, local_b = local[:5], local[5:]
        for rid, ids in (("req-a", remote_a), ("req-b", remote_b)):
            prefill.hold(remote["engine_id"], rid, ids, ttl=30)
        decode.read("a", params_for(remote, "req-a", remote_a, tp_size=prefill_tp), local_a)
        decode.read("b", params_for(remote, "req-b", remote_b, tp_size=prefill_tp), local_b)
        stats, failed = decode.wait(["a", "b"])
        assert failed == {}
        check_blocks(decode, pcfg, local_a + local_b, remote_a + remote_b)
        released = prefill.wait_released(remote["engine_id"], {"req-a", "req-b"})
        assert released == {"req-a": "done", "req-b": "done"}
        assert prefill.leases(remote["engine_id"]) == [0] * prefill_tp
        assert all(s.num_bytes > 0 and s.descriptors > 0 for s in stats["a"] + stats["b"])
        return [*stats["a"], *stats["b"]]
    finally:
        decode.close()


@pytest.mark.parametrize("path", ["mapped", "host", "staged"])
@pytest.mark.parametrize(("prefill_layout", "decode_layout", "prefill_tp", "decode_tp"),
                         CONVERTED)
def test_converted_reads_are_host_read_on_one_host(prefill: PrefillProcess, prefill_layout: str,
                                                  decode_layout: str, prefill_tp: int,
                                                  decode_tp: int, path: str) -> None:
    """A prefill process on this host whose cache is in shareable memory is read from its
    mapped cache (kvxfer.transfer.converted.mapped_reads); one whose cache is not, with heads large
    enough for runs to pay (32 float32 elements), is host-read
    (kvxfer.transfer.converted.host_reads); one that turned host reads off is read through staging.
    Every path is byte-exact and ends the lease with "done"."""
    host_reads = path != "staged"
    pcfg = CacheConfig(layout=prefill_layout, tp=prefill_tp, num_blocks=24, head_size=32,
                       host_reads=host_reads, shared_memory=path == "mapped")
    dcfg = replace(pcfg, layout=decode_layout, tp=decode_tp, num_blocks=20, host_reads=True)
    remote = prefill.create(pcfg)
    decode = decode_instance(dcfg)
    try:
        rng = np.random.default_rng(CONVERTED.index((prefill_layout, decode_layout, prefill_tp,
                                                     decode_tp)))
        remote_ids, local_ids = pick(rng, "random", 7, 24), pick(rng, "random", 7, 20)
        # warm-up: every rank handshakes on its own, so the first read may not be shared
        spare = next(b for b in range(20) if b not in local_ids)
        prefill.hold(remote["engine_id"], "warm", [0], ttl=30)
        decode.read("w", params_for(remote, "warm", [0], tp_size=prefill_tp), [spare])
        assert decode.wait(["w"])[1] == {}
        prefill.hold(remote["engine_id"], "req", remote_ids, ttl=30)
        decode.read("r", params_for(remote, "req", remote_ids, tp_size=prefill_tp), local_ids)
        stats, failed = decode.wait(["r"])
        assert failed == {}
        check_blocks(decode, pcfg, [spare, *local_ids], [0, *remote_ids])
        assert prefill.wait_released(remote["engine_id"], {"warm", "req"}) == \
            {"warm": "done", "req": "done"}
        assert prefill.leases(remote["engine_id"]) == [0] * prefill_tp
        host_ranks = [s.host_ranks for s in stats["r"]]
        assert all(h > 0 for h in host_ranks) if host_reads else host_ranks == [0] * decode_tp
        mapped = [s.mapped_ranks for s in stats["r"]]
        assert mapped == (host_ranks if path == "mapped" else [0] * decode_tp)
        # the decode ranks that host-read one prefill rank copy it together (SharedCopies),
        # or, through staging, READ the pages that hold every head once between them; each
        # copies its own heads out of a mapped cache
        pages = not parse_layout(prefill_layout).heads_outside_tokens
        together = {"mapped": 1, "host": max(1, decode_tp // prefill_tp),
                    "staged": decode_tp // prefill_tp if pages and decode_tp > prefill_tp
                    else 0}[path]
        assert [s.members for s in stats["r"]] == [together] * decode_tp
        if not host_reads and together:  # the pages were read once
            pages_bytes = 7 * pcfg.num_layers * pcfg.block_size * 4 * \
                (pcfg.total_kv_heads // prefill_tp) * pcfg.spec().content_size
            assert sum(s.num_bytes for s in stats["r"]) == prefill_tp * pages_bytes
        assert all(w._staging.held == 0 for w in decode.workers)
    finally:
        decode.close()


def test_cross_layer_layout_moves_a_block_in_one_descriptor(prefill: PrefillProcess) -> None:
    cfg = CacheConfig(layout="BHLNC", num_blocks=16, shared_memory=False)  # NIXL READs
    remote = prefill.create(cfg)
    decode = decode_instance(cfg)
    try:
        prefill.hold(remote["engine_id"], "coalesced", [1, 5, 9], ttl=30)
        decode.read("c", params_for(remote, "coalesced", [1, 5, 9]), [0, 4, 8])
        stats, failed = decode.wait(["c"])
        assert failed == {}
        assert stats["c"][0].descriptors == 3
        check_blocks(decode, cfg, [0, 4, 8], [1, 5, 9])
    finally:
        decode.close()


# -- bad inputs: each fails one request, leaves the listener serving, leaks nothing -------

def good_read(prefill: PrefillProcess, remote: dict, cfg: CacheConfig, decode: LoopbackInstance,
              rid: str) -> None:
    """A valid read after a failure: the prefill is still serving and frees its lease."""
    for worker in decode.workers:  # skip the decode's short fail-fast memory of the failure
        worker.forget_peer(remote["engine_id"])
    prefill.hold(remote["engine_id"], rid, [2, 3], ttl=30)
    decode.read(rid, params_for(remote, rid, [2, 3], tp_size=cfg.tp), [6, 7])
    _, failed = decode.wait([rid])
    assert failed == {}
    assert prefill.wait_released(remote["engine_id"], {rid}) == {rid: "done"}


@pytest.fixture
def pair(prefill: PrefillProcess) -> Iterator[tuple[dict, CacheConfig, LoopbackInstance]]:
    cfg = CacheConfig(num_blocks=12)
    remote = prefill.create(cfg)
    decode = decode_instance(cfg)
    try:
        yield remote, cfg, decode
    finally:
        decode.close()


def test_garbage_on_the_side_channel_is_survived(prefill: PrefillProcess, pair: tuple) -> None:
    remote, cfg, decode = pair
    ctx = zmq.Context.instance()
    for frames in ([b"\x00garbage\xff" * 50], [b"KVXF"], [b"KVXF\x85\xa7ver"], [b""],
                   [b"a", b"b", b"c", b"d"]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{remote['port']}")
        sock.send_multipart(frames)
        if sock.poll(2000):
            reply = sock.recv_multipart()
            assert reply[-1].startswith(version.MAGIC)  # an ErrorReply, not silence
        sock.close()
    good_read(prefill, remote, cfg, decode, "after-garbage")


def test_wrong_protocol_version_names_both(prefill: PrefillProcess, pair: tuple,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    remote, cfg, decode = pair
    prefill.hold(remote["engine_id"], "v", [0], ttl=1.0)
    current = version.KVXFER_PROTOCOL_VERSION
    monkeypatch.setattr(version, "KVXFER_PROTOCOL_VERSION", current + 1)
    decode.read("v", params_for(remote, "v", [0]), [0])
    _, failed = decode.wait(["v"])
    monkeypatch.undo()
    assert f"speaks kvxfer protocol {current}, this side speaks {current + 1}" in failed["v"]
    assert f"127.0.0.1:{remote['port']}" in failed["v"]
    # the decode never got to NIXL, so the lease runs out and frees the blocks
    assert prefill.wait_released(remote["engine_id"], {"v"}) == {"v": "expired"}
    good_read(prefill, remote, cfg, decode, "after-version")


def test_hash_mismatch_names_the_differing_field(prefill: PrefillProcess, pair: tuple) -> None:
    remote, cfg, _ = pair
    other = decode_instance(replace(cfg, num_layers=cfg.num_layers + 1))
    try:
        prefill.hold(remote["engine_id"], "h", [0], ttl=1.0)
        other.read("h", params_for(remote, "h", [0]), [0])
        _, failed = other.wait(["h"])
        assert "num_layers" in failed["h"] and remote["engine_id"] in failed["h"]
        assert prefill.wait_released(remote["engine_id"], {"h"}) == {"h": "expired"}
    finally:
        other.close()


def test_out_of_range_remote_block_ids_fail_that_request_only(prefill: PrefillProcess,
                                                              pair: tuple) -> None:
    remote, cfg, decode = pair
    prefill.hold(remote["engine_id"], "bad", [0, 1], ttl=30)
    prefill.hold(remote["engine_id"], "fine", [4, 5], ttl=30)
    decode.read("bad", params_for(remote, "bad", [0, 4096]), [0, 1])
    decode.read("fine", params_for(remote, "fine", [4, 5]), [2, 3])
    stats, failed = decode.wait(["bad", "fine"])
    assert "remote block id 4096" in failed["bad"] and "fine" in stats
    check_blocks_subset(decode, cfg, [2, 3], [4, 5])
    # the failed reader told the prefill it gave the blocks up: no wait for expiry
    assert prefill.wait_released(remote["engine_id"], {"bad", "fine"}) == \
        {"bad": "failed", "fine": "done"}


def tokens_of(view: torch.Tensor, ids: list[int], count: int) -> torch.Tensor:
    """``[H, count, C]``: the first ``count`` tokens that blocks ``ids`` hold, in order."""
    blocks = view[ids].float()  # [len(ids), H, N, C]
    return blocks.permute(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[3])[:, :count]


def check_tokens(decode: LoopbackInstance, prefill_cfg: CacheConfig, remote_ids: list[int],
                 local_ids: list[int], tokens: int) -> None:
    """The first ``tokens`` tokens of the prefill's blocks, for each decode rank's heads, are
    in the decode's blocks, seen per logical block; the decode's other blocks untouched."""
    seen = replace(prefill_cfg, tp=decode.cfg.tp)
    others = sorted(set(range(decode.cfg.num_blocks)) - set(local_ids))
    for rank, caches in enumerate(decode.caches):
        for layer, view in enumerate(caches.values()):
            got = decode.cfg.logical(view)
            want = tokens_of(pattern(seen, rank, layer), remote_ids, tokens)
            assert torch.equal(tokens_of(got, local_ids, tokens), want), (rank, layer)
            assert (got[others] == -1).all(), "blocks outside the request changed"


@pytest.mark.parametrize(("prefill_layout", "decode_layout", "prefill_bs", "decode_bs", "tp",
                          "path"), [
    # layouts byte copies serve: cut at every block, a NIXL descriptor per run would cost
    # more than a few long READs into staging and a local copy, or, from a prefill with
    # shared memory on this host, one copy out of its mapped cache
    ("LBHNC", "BLHNC", 16, 32, (1, 1), "staged"), ("BHLNC", "LBHNC", 32, 8, (1, 2), "staged"),
    ("LBNHC", "LBNHC", 8, 32, (1, 1), "staged"),
    ("LBHNC", "BLHNC", 16, 32, (1, 1), "mapped"), ("BHLNC", "LBHNC", 32, 8, (1, 2), "mapped"),
    # converted: a head split of a tokens-outside-heads prefill, heads and tokens ordered
    # differently, both; from the prefill's mapped cache, or through staging (a host read's
    # byte map needs one block size, so a prefill without shared memory is staged too)
    ("LBNHC", "LBNHC", 16, 32, (1, 2), "mapped"), ("LBNHC", "LBNHC", 16, 32, (1, 2), "staged"),
    ("LBHNC", "LBNHC", 32, 16, (1, 1), "mapped"), ("LBHNC", "LBNHC", 32, 16, (1, 1), "staged"),
    ("BLNHC", "BHLNC", 8, 32, (2, 1), "mapped"), ("BLNHC", "BHLNC", 8, 32, (2, 1), "staged")])
def test_different_block_sizes_move_every_token_to_its_place(
        prefill: PrefillProcess, prefill_layout: str, decode_layout: str, prefill_bs: int,
        decode_bs: int, tp: tuple[int, int], path: str) -> None:
    """The request's tokens pair in order across two block sizes, one a multiple of the
    other, whatever the layouts and TP sizes, from a mapped cache or through staging."""
    tokens = 77  # a last block partly filled on both sides
    pcfg = CacheConfig(layout=prefill_layout, block_size=prefill_bs, num_blocks=24, tp=tp[0],
                       shared_memory=path == "mapped")
    dcfg = CacheConfig(layout=decode_layout, block_size=decode_bs, num_blocks=24, tp=tp[1])
    remote = prefill.create(pcfg)
    decode = decode_instance(dcfg)
    try:
        rng = np.random.default_rng(prefill_bs * decode_bs)
        remote_ids = pick(rng, "random", -(-tokens // prefill_bs), 24)
        local_ids = pick(rng, "random", -(-tokens // decode_bs), 24)
        prefill.hold(remote["engine_id"], "mixed", remote_ids, ttl=30)
        decode.read("mixed", params_for(remote, "mixed", remote_ids, tp_size=tp[0],
                                        remote_block_size=prefill_bs), local_ids)
        stats, failed = decode.wait(["mixed"])
        assert failed == {}
        check_tokens(decode, pcfg, remote_ids, local_ids, tokens)
        assert all(s.descriptors > 0 for s in stats["mixed"])
        assert [s.mapped_ranks > 0 for s in stats["mixed"]] == [path == "mapped"] * tp[1]
        # staged reads took staging and gave it back to the pool; the others took none
        assert all(bool(w._staging._free) == (path == "staged") for w in decode.workers)
        assert prefill.wait_released(remote["engine_id"], {"mixed"}) == {"mixed": "done"}
    finally:
        decode.close()


@pytest.mark.parametrize(("prefill_side", "decode_side", "tp"), [
    # (layout, logical block size, kernel block size or None) of each side
    (("LBHNC", 16, 8), ("LBHNC", 16, None), (1, 1)),     # prefill kernel blocks
    (("BLHNC", 16, None), ("BHLNC", 16, 4), (1, 1)),     # decode kernel blocks
    (("BHLNC", 32, 8), ("LBHNC", 16, 8), (1, 2)),        # both, block sizes differ, TP 1 -> 2
    (("LBHNC", 8, 2), ("BLHNC", 32, 16), (2, 1)),        # the reverse mismatch, TP 2 -> 1
    (("LBNHC", 16, 4), ("LBHNC", 16, 8), (1, 2)),        # converted through staging
    (("LBNHC", 8, 4), ("LBHNC", 32, 16), (1, 2))])       # the same, block sizes differ
def test_kernel_blocks_move_every_token_of_each_logical_block(
        prefill: PrefillProcess, prefill_side: tuple[str, int, int | None],
        decode_side: tuple[str, int, int | None], tp: tuple[int, int]) -> None:
    """Views at a kernel block size on either side or both: ids stay logical (the params
    count the prefill's logical blocks) and every token of every logical block arrives,
    compared through the logical blocks of both sides."""
    tokens = 77  # a last block partly filled on both sides
    (play, pbs, pkernel), (dlay, dbs, dkernel) = prefill_side, decode_side
    pcfg = CacheConfig(layout=play, block_size=pbs, kernel_block_size=pkernel, num_blocks=24,
                       tp=tp[0])
    dcfg = CacheConfig(layout=dlay, block_size=dbs, kernel_block_size=dkernel, num_blocks=24,
                       tp=tp[1])
    remote = prefill.create(pcfg)
    decode = decode_instance(dcfg)
    try:
        rng = np.random.default_rng(pbs * dbs + (pkernel or 0) + 7 * (dkernel or 0))
        remote_ids = pick(rng, "random", -(-tokens // pbs), 24)
        local_ids = pick(rng, "random", -(-tokens // dbs), 24)
        prefill.hold(remote["engine_id"], "kernel", remote_ids, ttl=30)
        decode.read("kernel", params_for(remote, "kernel", remote_ids, tp_size=tp[0],
                                         remote_block_size=pbs), local_ids)
        stats, failed = decode.wait(["kernel"])
        assert failed == {}
        check_tokens(decode, pcfg, remote_ids, local_ids, tokens)
        assert all(s.num_bytes > 0 and s.descriptors > 0 for s in stats["kernel"])
        assert prefill.wait_released(remote["engine_id"], {"kernel"}) == {"kernel": "done"}
    finally:
        decode.close()


@pytest.mark.parametrize(("kernel", "decode_size"), [(None, 32), (8, 8)])
def test_params_that_miscount_the_prefills_block_size_read_nothing(
        prefill: PrefillProcess, kernel: int | None, decode_size: int) -> None:
    """Ids counted at a block size the prefill's cache does not have would be misread:
    another decode's size, or (a prefill of 16-token blocks seen as 8-token kernel
    blocks) its kernel size; ids count logical blocks."""
    pcfg = CacheConfig(layout="LBHNC", block_size=16, kernel_block_size=kernel, num_blocks=8)
    remote = prefill.create(pcfg)
    decode = decode_instance(CacheConfig(layout="LBHNC", block_size=decode_size, num_blocks=8))
    try:
        for rid, over in (("unsaid", {}), ("wrong", {"remote_block_size": decode_size})):
            prefill.hold(remote["engine_id"], rid, [0], ttl=30)
            decode.read(rid, params_for(remote, rid, [0], **over), [0])
        _, failed = decode.wait(["unsaid", "wrong"])
        assert "its cache has 16-token blocks but kv_transfer_params do not say " \
               f"remote_block_size, so the ids were counted at this decode's {decode_size}" \
               in failed["unsaid"]
        assert "its cache has 16-token blocks but kv_transfer_params say " \
               f"remote_block_size={decode_size}" in failed["wrong"]
        for view in decode.caches[0].values():
            assert (view == -1).all(), "a refused read must not write anything"
        assert prefill.wait_released(remote["engine_id"], {"unsaid", "wrong"}) == \
            {"unsaid": "failed", "wrong": "failed"}  # each reader said it gave up
    finally:
        decode.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_read_names_both_sides_memory_kinds(prefill: PrefillProcess, lanes: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each READ, a lane's too, is prepared with this cache's kind and the prefill's, as
    its handshake sent it (a host prefill feeding a GPU decode needs both named)."""
    cfg = CacheConfig(layout="LBHNC", num_layers=8, num_blocks=40, shared_memory=False)
    remote = prefill.create(cfg)
    decode = decode_instance(replace(cfg, read_lanes=lanes))
    try:
        worker = decode.workers[0]
        prefill.hold(remote["engine_id"], "warm", [1], ttl=30)  # handshake, connect, probes
        decode.read("warm", params_for(remote, "warm", [1]), [1])
        assert decode.wait(["warm"])[1] == {}
        kinds: list[tuple[object, object]] = []
        for agent in (worker._agent, *(worker._lanes.agents if worker._lanes else ())):
            def recording_read(*args: object, _real: Any = agent.read, **kwargs: object) -> Any:
                kinds.append((kwargs.get("local_is_cuda"), kwargs.get("remote_is_cuda")))
                return _real(*args, **kwargs)

            monkeypatch.setattr(agent, "read", recording_read)
        ids = list(range(0, 40, 2))  # 20 blocks x 8 layers, none adjacent: 160 descriptors
        prefill.hold(remote["engine_id"], "kinds", ids, ttl=30)
        decode.read("kinds", params_for(remote, "kinds", ids), ids)
        stats, failed = decode.wait(["kinds"])
        assert failed == {} and stats["kinds"][0].lanes == lanes
        assert len(kinds) == lanes and set(kinds) == {(False, False)}
        # NIXL timed every lane's READ: the read's span, first post to last completion
        read = stats["kinds"][0]
        assert read.nixl_seconds is not None and read.posted_seconds is not None
        assert 0 < read.nixl_seconds <= read.posted_seconds
    finally:
        decode.close()


def test_a_cache_of_two_memory_kinds_is_refused() -> None:
    from kvxfer.plan.regions import MemoryRegion
    from kvxfer.transfer.local_rank import memory_kind
    from kvxfer.transfer.results import TransferError

    host, gpu = MemoryRegion(4096, 64, 0, False), MemoryRegion(8192, 64, 0, True)
    assert memory_kind([gpu, gpu], "x") is True and memory_kind([host], "x") is False
    with pytest.raises(TransferError, match="prefill rank 1 registers both host and GPU memory"):
        memory_kind([host, gpu], "prefill rank 1")


def check_blocks_subset(decode: LoopbackInstance, cfg: CacheConfig, local: list[int],
                        remote: list[int]) -> None:
    for layer, view in enumerate(decode.caches[0].values()):
        assert torch.equal(view[local].float(), pattern(cfg, 0, layer)[remote])
    for view in decode.caches[0].values():
        assert (view[[0, 1]] == -1).all(), "a failed request must not have written anything"


def test_prefill_that_never_answers_hits_the_deadline(pair: tuple) -> None:
    _, _, decode = pair
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    for worker in decode.workers:
        worker.handshake_timeout, worker.handshake_retries = 0.3, 1
    try:
        started = time.monotonic()
        decode.read("t", {"remote_engine_id": "ghost", "remote_host": "127.0.0.1",
                          "remote_port": port, "remote_block_ids": [0],
                          "remote_request_id": "t", "tp_size": 1}, [0])
        _, failed = decode.wait(["t"], timeout=10)
        assert time.monotonic() - started < 5
        assert f"127.0.0.1:{port}" in failed["t"] and "ghost" in failed["t"]
    finally:
        silent.close()


def test_prefill_killed_fails_its_request_and_others_continue(prefill: PrefillProcess,
                                                              pair: tuple) -> None:
    remote, cfg, decode = pair
    doomed = PrefillProcess()
    try:
        big = CacheConfig(num_blocks=12, shared_memory=False)  # READ over NIXL: it fails
        victim = doomed.create(big)
        doomed.hold(victim["engine_id"], "warm", [0], ttl=30)
        decode.read("warm", params_for(victim, "warm", [0]), [0])  # handshake + connect
        assert decode.wait(["warm"])[1] == {}
        doomed.hold(victim["engine_id"], "dies", [1, 2], ttl=30)
        doomed.kill()
        decode.read("dies", params_for(victim, "dies", [1, 2]), [1, 2])
        _, failed = decode.wait(["dies"], timeout=30)
        assert victim["engine_id"] in failed["dies"]
    finally:
        doomed.close()
    good_read(prefill, remote, cfg, decode, "after-kill")


def kill_during_reads(big: CacheConfig, reader_cfg: CacheConfig, warm: list[int],
                      warm_local: list[int], count: int, delay_s: float) -> list[Any]:
    """Kill a prefill ``delay_s`` after a stream of ``count`` reads started: each read
    completes with the right bytes or fails naming the peer; nothing hangs. Returns the
    warm-up read's ReadStats (one per rank)."""
    doomed, reader = PrefillProcess(), decode_instance(reader_cfg)
    try:
        victim = doomed.create(big)
        doomed.hold(victim["engine_id"], "warm", warm, ttl=30)
        reader.read("warm", params_for(victim, "warm", warm), warm_local)  # handshake + connect
        warm_stats, warm_failed = reader.wait(["warm"])
        assert warm_failed == {}
        ids = [f"r{i}" for i in range(count)]
        for i, rid in enumerate(ids):
            doomed.hold(victim["engine_id"], rid, [i % 12, (i + 5) % 12], ttl=30)
        killer = threading.Timer(delay_s, doomed.kill)
        killer.start()
        for i, rid in enumerate(ids):
            reader.read(rid, params_for(victim, rid, [i % 12, (i + 5) % 12]), [2 * i, 2 * i + 1])
        stats, failed = reader.wait(ids, timeout=60)
        killer.join()
        assert set(stats) | set(failed) == set(ids)
        assert all(victim["engine_id"] in reason for reason in failed.values())
        for i, rid in enumerate(ids):
            if rid in stats:
                for layer, view in enumerate(reader.caches[0].values()):
                    assert torch.equal(view[[2 * i, 2 * i + 1]],
                                       pattern(big, 0, layer)[[i % 12, (i + 5) % 12]])
        print(f"killed mid-stream: {len(stats)} reads completed, {len(failed)} failed")
        return list(warm_stats["warm"])
    finally:
        reader.close()
        doomed.close()


@pytest.mark.parametrize("path", ["nixl", "mapped"])
def test_prefill_killed_while_reads_are_running(prefill: PrefillProcess, pair: tuple,
                                                path: str) -> None:
    """Kill the prefill while a stream of multi-MiB reads is going, READ over NIXL or
    copied from its mapped cache: each read either completes with the right bytes or fails
    with a reason naming the peer; nothing hangs."""
    remote, cfg, decode = pair
    big = CacheConfig(head_size=4096, num_blocks=12, shared_memory=path == "mapped")
    warm = kill_during_reads(big, replace(big, num_blocks=40), [0], [39], count=20,
                             delay_s=0.003)
    assert [s.path_names for s in warm] == [(path,)]
    good_read(prefill, remote, cfg, decode, "after-kill-running")


@pytest.mark.parametrize("host_reads", [True, False], ids=["host", "staged"])
def test_prefill_killed_during_converted_reads(prefill: PrefillProcess, pair: tuple,
                                               host_reads: bool) -> None:
    """The same for converted reads (LBHNC prefill, LBNHC decode), host-read or through
    staging: every one completes with the right bytes or fails naming the peer (a host
    read of a process that is gone, or half gone, fails), and the worker keeps serving."""
    remote, cfg, decode = pair
    big = CacheConfig(head_size=4096, num_blocks=12, host_reads=host_reads)
    warm = kill_during_reads(big, replace(big, num_blocks=40, layout="LBNHC"), [0], [39],
                             count=20, delay_s=0.003)
    assert [s.host_ranks for s in warm] == [1 if host_reads else 0]
    good_read(prefill, remote, cfg, decode, "after-kill-converted")


class FailedRead:
    """A posted READ that NIXL reports failed, on every look (as a dropped peer's does)."""

    def state(self) -> str:
        from kvxfer.transfer.nixl_agent import NixlTransferError

        raise NixlTransferError("READ", "prefill", "NIXL_ERR_REMOTE_DISCONNECT")

    def release(self) -> None:
        pass


def test_a_converted_read_that_fails_fails_alone(prefill: PrefillProcess,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Its failure is reported (not raised out of the worker loop), its staging is freed
    once the failed prefill is forgotten, and the worker goes on reading from others."""
    cfg = CacheConfig(layout="LBHNC", num_blocks=8, host_reads=False)  # through staging
    remote = prefill.create(cfg)
    decode = decode_instance(replace(cfg, layout="LBNHC"))
    try:
        worker = decode.workers[0]
        prefill.hold(remote["engine_id"], "warm", [1], ttl=30)
        decode.read("warm", params_for(remote, "warm", [1]), [5])  # handshake + connect
        assert decode.wait(["warm"])[1] == {}
        monkeypatch.setattr(worker._agent, "read", lambda *a, **k: FailedRead())
        prefill.hold(remote["engine_id"], "lost", [2, 3], ttl=30)
        decode.read("lost", params_for(remote, "lost", [2, 3]), [2, 3])
        _, failed = decode.wait(["lost"], timeout=20)
        assert "NIXL_ERR_REMOTE_DISCONNECT" in failed["lost"], failed
        monkeypatch.undo()
        assert worker._reads.staging_wait == [] and worker._reads.inflight == []
        deadline = time.monotonic() + 10
        while worker._staging.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker._staging.held == 0, "the dead prefill's staging was never freed"
        other = prefill.create(cfg)  # the failed one is avoided for a few seconds
        prefill.hold(other["engine_id"], "after", [4], ttl=30)
        decode.read("after", params_for(other, "after", [4]), [4])
        _, failed = decode.wait(["after"], timeout=20)
        assert failed == {}
        check_blocks_subset(decode, cfg, [4], [4])
    finally:
        decode.close()


def test_a_shared_staged_read_whose_share_fails_fails_every_member(
        prefill: PrefillProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two in-process decode ranks share the staged read of an LBNHC prefill's pages; one
    rank's READ fails: both report the request failed (the other's heads lack that share)
    and the prefill is told by both, so its lease ends at once; the next shared read of
    another prefill is whole."""
    cfg = CacheConfig(layout="LBNHC", num_blocks=12, host_reads=False)
    remote = prefill.create(cfg)
    decode = decode_instance(replace(cfg, tp=2))
    try:
        prefill.hold(remote["engine_id"], "warm", [1], ttl=30)
        decode.read("warm", params_for(remote, "warm", [1]), [5])  # handshakes + connect
        assert decode.wait(["warm"])[1] == {}
        monkeypatch.setattr(decode.workers[1]._agent, "read", lambda *a, **k: FailedRead())
        prefill.hold(remote["engine_id"], "lost", [2, 3, 4, 6], ttl=30)
        decode.read("lost", params_for(remote, "lost", [2, 3, 4, 6]), [2, 3, 4, 6])
        left = {0: "a sibling decode rank's share of the read failed",
                1: "NIXL_ERR_REMOTE_DISCONNECT"}
        deadline = time.monotonic() + 20
        while left and time.monotonic() < deadline:
            for rank in list(left):
                result = decode.workers[rank].poll()
                assert "lost" not in result.finished, f"rank {rank} reported a success"
                if "lost" in result.failed:
                    assert left.pop(rank) in result.failed["lost"], result.failed
            time.sleep(0.005)
        assert not left, f"ranks {sorted(left)} never reported the failed read"
        assert prefill.wait_released(remote["engine_id"], {"warm", "lost"}) == \
            {"warm": "done", "lost": "failed"}  # said they will not read: freed at once
        monkeypatch.undo()
        other = prefill.create(cfg)  # the failed prefill is avoided for a few seconds
        prefill.hold(other["engine_id"], "again", [10], ttl=30)  # each rank handshakes alone
        decode.read("again", params_for(other, "again", [10]), [10])
        assert decode.wait(["again"])[1] == {}
        prefill.hold(other["engine_id"], "after", [7, 8, 9], ttl=30)
        decode.read("after", params_for(other, "after", [7, 8, 9]), [7, 8, 9])
        stats, failed = decode.wait(["after"], timeout=20)
        assert failed == {} and [s.members for s in stats["after"]] == [2, 2]
        for rank, caches in enumerate(decode.caches):  # each rank's heads, whole
            for layer, view in enumerate(caches.values()):
                want = pattern(replace(cfg, tp=2), rank, layer)[[7, 8, 9]]
                assert torch.equal(view[[7, 8, 9]].float(), want), (rank, layer)
    finally:
        decode.close()


def test_a_staged_read_that_ends_after_its_peer_was_dropped_is_reported_unnotified(
        prefill: PrefillProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged READ carries no "done": when the prefill's connection was dropped before
    the read ended, nobody was told, and the read says so (the decode then releases
    the lease over the side channel) instead of leaving the lease to expire."""
    import threading

    from kvxfer.plan.staging import StagedRead

    cfg = CacheConfig(layout="LBHNC", num_blocks=8, host_reads=False)
    remote = prefill.create(cfg)
    decode = decode_instance(replace(cfg, layout="LBNHC"))
    try:
        worker = decode.workers[0]
        reported: list[Any] = []  # the "done" reports the worker queues
        monkeypatch.setattr(worker._reports, "done",
                            lambda *args: reported.append(args) is None)
        placing, release = threading.Event(), threading.Event()
        convert = StagedRead.convert

        def slow_convert(*args: Any, **kwargs: Any) -> None:
            placing.set()
            assert release.wait(20)
            convert(*args, **kwargs)

        monkeypatch.setattr(StagedRead, "convert", slow_convert)
        prefill.hold(remote["engine_id"], "late", [2, 3], ttl=30)
        worker.start_read("late", params_for(remote, "late", [2, 3]), [2, 3])
        assert placing.wait(20)  # READ landed, its placing holds
        worker.forget_peer(remote["engine_id"])
        deadline = time.monotonic() + 10
        while remote["engine_id"] in worker._peers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert remote["engine_id"] not in worker._peers
        release.set()
        result = worker.poll()
        while not result and time.monotonic() < deadline:
            time.sleep(0.01)
            result = worker.poll()
        assert result.finished == ["late"] and result.unnotified == {"late"}
        assert not reported, "no peer: nobody to report to, the caller releases"
    finally:
        decode.close()


def test_decode_that_never_reads_lets_the_lease_expire(prefill: PrefillProcess,
                                                       pair: tuple) -> None:
    remote, _, _ = pair
    prefill.hold(remote["engine_id"], "orphan", [0, 1, 2], ttl=0.3)
    assert prefill.wait_released(remote["engine_id"], {"orphan"}) == {"orphan": "expired"}
    assert prefill.leases(remote["engine_id"]) == [0]


def test_malformed_params_raise_before_anything_starts(pair: tuple) -> None:
    _, _, decode = pair
    for params, message in (({"remote_host": "x"}, "remote_engine_id is missing"),
                            ({"remote_engine_id": "e", "remote_host": "h", "remote_port": 70000,
                              "remote_block_ids": [], "remote_request_id": "r", "tp_size": 1},
                             "remote_port 70000"),
                            ({"remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
                              "remote_block_ids": ["a"], "remote_request_id": "r",
                              "tp_size": 1}, "list of integers")):
        with pytest.raises(ValueError, match=message):
            decode.workers[0].start_read("m", params, [0])


@pytest.mark.parametrize(("remote_size", "start", "end", "ids"), [
    (None, 32, 75, (2, 3, 4)),     # the decode's own size: its hit of 2 blocks skipped
    (8, 32, 75, (4, 5, 6, 7, 8, 9)),  # smaller prefill blocks: 4 of them per decode block
    (32, 32, 75, (1, 2)),          # larger ones: the hit ends at a prefill block
    (32, 0, 16, (0,))])            # a prompt shorter than one prefill block
def test_params_narrow_to_the_prefill_blocks_holding_a_token_range(
        remote_size: int | None, start: int, end: int, ids: tuple[int, ...]) -> None:
    from kvxfer.wire.params import RemoteParams

    params = RemoteParams("e", "h", 1, tuple(range(10)), "r", 1, remote_block_size=remote_size)
    assert params.tokens(start, end, 16).remote_block_ids == ids


def test_params_refuse_a_token_range_the_lease_cannot_serve() -> None:
    from kvxfer.wire.params import RemoteParams

    params = RemoteParams("e", "h", 1, (0, 1, 2), "r", 1, remote_block_size=32)
    with pytest.raises(ValueError, match="the first 16 tokens, which end inside a 32-token "
                                         "block of the prefill"):
        params.tokens(16, 64, 16)
    with pytest.raises(ValueError, match="leased 3 blocks of 32 tokens, but the prompt's first "
                                         "97 tokens need 4"):
        params.tokens(0, 97, 16)


def test_nothing_listening_is_reported_with_the_address(pair: tuple) -> None:
    _, _, decode = pair
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for worker in decode.workers:
        worker.handshake_timeout, worker.handshake_retries = 0.2, 0
    decode.read("n", {"remote_engine_id": "nobody", "remote_host": "127.0.0.1",
                      "remote_port": port, "remote_block_ids": [0],
                      "remote_request_id": "n", "tp_size": 1}, [0])
    _, failed = decode.wait(["n"], timeout=10)
    assert f"127.0.0.1:{port}" in failed["n"]


# -- read lanes: one request copied by several agents/threads at once --------------------

LANE_CASES = (("LBHNC", "LBHNC", 1, 1), ("LBHNC", "LBHNC", 2, 1), ("BLHNC", "BLHNC", 1, 2),
              ("BHLNC", "BLHNC", 4, 2), ("LBNHC", "LBNHC", 2, 2))


@pytest.mark.parametrize("lanes", [2, 4])
@pytest.mark.parametrize(("prefill_layout", "decode_layout", "prefill_tp", "decode_tp"),
                         LANE_CASES)
def test_lanes_split_a_large_read_and_stay_byte_exact(prefill: PrefillProcess,
                                                      prefill_layout: str, decode_layout: str,
                                                      prefill_tp: int, decode_tp: int,
                                                      lanes: int) -> None:
    """A request of >= 64 descriptors is split across the rank's share of ``lanes``
    (per instance: ``lanes // decode_tp`` per rank); every byte lands where it belongs,
    nothing else changes, and "done" reaches every prefill rank."""
    pcfg = CacheConfig(layout=prefill_layout, tp=prefill_tp, num_layers=8, num_blocks=40,
                       shared_memory=False)  # NIXL READs (not a copy from a mapped cache)
    dcfg = CacheConfig(layout=decode_layout, tp=decode_tp, num_layers=8, num_blocks=40,
                       read_lanes=lanes)
    remote = prefill.create(pcfg)
    decode = decode_instance(dcfg)
    try:
        rng = np.random.default_rng(lanes * 100 + LANE_CASES.index(
            (prefill_layout, decode_layout, prefill_tp, decode_tp)))
        remote_ids, local_ids = pick(rng, "random", 30, 40), pick(rng, "random", 30, 40)
        small_remote, small_local = [i for i in range(40) if i not in remote_ids][:1], \
            [i for i in range(40) if i not in local_ids][:1]
        prefill.hold(remote["engine_id"], "big", remote_ids, ttl=30)
        prefill.hold(remote["engine_id"], "small", small_remote, ttl=30)
        decode.read("big", params_for(remote, "big", remote_ids, tp_size=prefill_tp), local_ids)
        decode.read("small", params_for(remote, "small", small_remote, tp_size=prefill_tp),
                    small_local)
        stats, failed = decode.wait(["big", "small"])
        assert failed == {}
        check_blocks(decode, pcfg, local_ids + small_local, remote_ids + small_remote)
        per_rank = max(1, lanes // decode_tp)
        assert [s.lanes for s in stats["big"]] == [per_rank] * decode_tp
        assert all(s.lanes == 1 for s in stats["small"]), "a tiny read needs no lanes"
        released = prefill.wait_released(remote["engine_id"], {"big", "small"})
        assert released == {"big": "done", "small": "done"}
        assert prefill.leases(remote["engine_id"]) == [0] * prefill_tp
    finally:
        decode.close()


def test_lanes_that_lose_the_prefill_fail_the_request_naming_it(prefill: PrefillProcess,
                                                                pair: tuple) -> None:
    """The prefill dies while lanes are copying: each read completes byte-exact or fails
    naming the peer, and nothing hangs (the worker waits for every lane)."""
    remote, cfg, decode = pair
    big = CacheConfig(head_size=1024, num_layers=40, num_blocks=12, shared_memory=False)
    # warm-up: 2 runs x 40 layers = 80 descriptors, enough to use both lanes
    warm = kill_during_reads(big, replace(big, num_blocks=40, read_lanes=2), [0, 2], [37, 39],
                             count=12, delay_s=0.01)
    assert [s.lanes for s in warm] == [2]
    good_read(prefill, remote, cfg, decode, "after-lane-kill")


def test_read_lanes_must_be_positive() -> None:
    from kvxfer.transfer.worker import TransferWorker

    with pytest.raises(ValueError, match="read_lanes must be at least 1, got 0"):
        TransferWorker("e", 0, 1, CacheConfig().compat(), CacheConfig().transfer(),
                       total_kv_heads=4, read_lanes=0)


def test_a_new_lease_wakes_an_idle_prefill_so_reads_do_not_wait_for_its_poll(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ that carries its "done" notification completes only once the prefill's
    agent progresses and takes it, so an idle prefill worker must start polling fast when
    a lease is held, not at the end of its idle wait. Here the idle wait is a minute
    (and the fast window after a handshake 50 ms): were ``hold`` not to wake the worker,
    the second read would stay in progress until the wait ran out."""
    import kvxfer.transfer.worker as worker_module

    monkeypatch.setattr(worker_module, "IDLE_POLL_S", 60.0)
    monkeypatch.setattr(worker_module, "CONNECT_WINDOW_S", 0.05)
    cfg = CacheConfig(shared_memory=False)  # READ over NIXL, not copied from a mapped cache
    prefill = LoopbackInstance.create("prefill", cfg)
    decode = decode_instance(cfg)
    try:
        for request_id, block in (("warm-up", 0), ("after-idle", 1)):
            prefill.hold(request_id, [block], ttl=60)
            decode.read(request_id, prefill.params(request_id, [block]), [block])
            _, failed = decode.wait([request_id], timeout=20)
            assert not failed, failed
            released: dict[str, str] = {}
            deadline = time.monotonic() + 20
            while request_id not in released and time.monotonic() < deadline:
                released.update(prefill.released())
                time.sleep(0.01)
            assert released.get(request_id) == "done", released
            time.sleep(0.3)  # past the fast window: the prefill's worker now waits idle
        check_blocks(decode, cfg, [0, 1], [0, 1])
    finally:
        decode.close()
        prefill.close()
