"""Host reads (:mod:`kvxfer.transfer.converted.host_reads`): who may be read, and what happens when
the process behind an offer is not the one that made it. The byte map itself is proven in
tests/test_staging.py (against the view-level expectation) and over real processes in
tests/test_transfer.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from msgspec.structs import replace as changed

from kvxfer.harness import preloaded
from kvxfer.harness.loopback import CacheConfig, LoopbackInstance, PrefillProcess
from kvxfer.transfer.converted.host_reads import (
    Canary,
    HostReadError,
    check_offer,
    copy_vectors,
    verify_canary,
)
from kvxfer.wire.metadata import HostReads


def _offer_from_child(conn: mp.connection.Connection) -> None:
    canary = Canary()
    conn.send(canary.offer())
    conn.recv()  # hold the canary until told to exit


def test_an_offer_is_checked_against_the_process_it_names() -> None:
    canary = Canary()
    offer = canary.offer()
    assert offer is not None and offer.pid == os.getpid()
    assert check_offer(offer) is None
    assert check_offer(None) == "the prefill does not offer host reads"
    assert check_offer(changed(offer, host="another/host")) == \
        "the prefill runs on another host or in another pid namespace"
    forged = changed(offer, canary=bytes(b ^ 1 for b in offer.canary))
    assert check_offer(forged) == f"pid {offer.pid} is not the prefill process (its canary differs)"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    ended = changed(offer, pid=int(gone.stdout))  # a process that exited (pid not reused yet)
    assert "no such process" in (check_offer(ended) or "")


def test_a_prefill_process_that_ended_fails_the_check_after_a_copy() -> None:
    """A pid outlives its process: after the prefill exits, its offer no longer verifies,
    so nothing read under that pid is taken for the prefill's bytes."""
    ctx = preloaded.context()  # a process of its own, forked preloaded
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_offer_from_child, args=(child,), daemon=True)
    process.start()
    try:
        offer = parent.recv()
        verify_canary(offer)  # the live child passes
        parent.send("exit")
        process.join(timeout=30)
        with pytest.raises(HostReadError) as err:
            verify_canary(offer)
        assert err.value.gone
    finally:
        process.kill()
        process.join(timeout=10)


def test_copy_vectors_reports_an_unmapped_range_and_copies_nothing_as_success() -> None:
    canary = Canary()
    offer = canary.offer()
    assert offer is not None
    got = np.zeros(16, dtype=np.uint8)
    with pytest.raises(HostReadError, match="not mapped") as err:
        copy_vectors(offer.pid, np.array([[got.ctypes.data, 16]], dtype=np.uint64),
                     np.array([[8, 16]], dtype=np.uint64))  # page 0 is never mapped
    assert err.value.gone


def test_malformed_offers_are_refused_when_decoded() -> None:
    for bad, why in ((dict(host=""), "host must not be empty"), (dict(pid=0), "pid must be"),
                     (dict(canary_addr=0), "canary_addr must be"),
                     (dict(canary=b"x"), "canary must be 8 to 64 bytes")):
        fields = {"host": "h", "pid": 5, "canary_addr": 4096, "canary": bytes(16), **bad}
        with pytest.raises(ValueError, match=why):
            HostReads(**fields)


def test_a_decode_that_cannot_host_read_falls_back_to_staging(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real prefill process that offers host reads, a decode that sees it on another
    host: the converted read goes through staging, byte-exact, and ends the lease."""
    from test_transfer import check_blocks, params_for

    from kvxfer.transfer.converted import host_reads

    monkeypatch.setattr(host_reads, "host_identity", lambda: "elsewhere/ns")
    prefill = PrefillProcess()
    pcfg = CacheConfig(layout="LBHNC", head_size=32, num_blocks=12)
    decode = LoopbackInstance.create("decode", replace(pcfg, layout="LBNHC"), fill="sentinel")
    try:
        remote = prefill.create(pcfg)
        prefill.hold(remote["engine_id"], "req", [3, 7, 1], ttl=30)
        decode.read("r", params_for(remote, "req", [3, 7, 1]), [0, 5, 9])
        stats, failed = decode.wait(["r"])
        assert failed == {}
        assert [s.host_ranks for s in stats["r"]] == [0]
        check_blocks(decode, pcfg, [0, 5, 9], [3, 7, 1])
        assert prefill.wait_released(remote["engine_id"], {"req"}) == {"req": "done"}
    finally:
        decode.close()
        prefill.close()


READ_AS_CHILD = """
import json, sys
from kvxfer.transfer.converted.host_reads import check_offer
from kvxfer.wire.metadata import HostReads
o = json.loads(sys.argv[1])
print(check_offer(HostReads(o["host"], o["pid"], o["addr"], bytes.fromhex(o["canary"]))))
"""


def _undumpable_offer(conn: mp.connection.Connection) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: like a setuid program
    _offer_from_child(conn)


def test_a_reader_without_the_right_to_read_the_prefill_is_told_why() -> None:
    """As root, the reader runs as another user (nobody); otherwise the prefill makes
    itself undumpable, which also takes the right away from a reader of the same user."""
    ctx = preloaded.context()  # a process of its own, forked preloaded
    parent, child = ctx.Pipe()
    root = os.geteuid() == 0
    process = ctx.Process(target=_offer_from_child if root else _undumpable_offer,
                          args=(child,), daemon=True)
    process.start()
    try:
        offer = parent.recv()
        wire = {"host": offer.host, "pid": offer.pid, "addr": offer.canary_addr,
                "canary": offer.canary.hex()}
        import json

        user = {"user": 65534, "group": 65534} if root else {}
        out = subprocess.run([sys.executable, "-c", READ_AS_CHILD, json.dumps(wire)],
                             capture_output=True, text=True, timeout=60, check=False, **user)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == f"reading process {offer.pid}: not permitted (another " \
                                     f"user, or ptrace is restricted)", out.stdout
        parent.send("exit")
    finally:
        process.join(timeout=10)
        process.kill()


def _siblings() -> tuple[list[Any], Any, list[Any], Canary]:
    """Two decode ranks (LBNHC, TP 2) of one LBNHC TP 1 prefill, in this process: their
    host reads, the prefill's rank and the decode ranks."""
    from test_descriptors import make_rank

    from kvxfer.plan.layout import CacheSpec, KVCacheLayout
    from kvxfer.plan.staging import layer_groups, plan_reads
    from kvxfer.plan.topology import read_plan
    from kvxfer.transfer.converted.host_reads import plan_host_read

    rng = np.random.default_rng(7)
    remote = make_rank(CacheSpec(4, 4, 8, torch.float32), KVCacheLayout.LBNHC, 12, 3, False,
                       rng)
    ranks = [make_rank(CacheSpec(4, 2, 8, torch.float32), KVCacheLayout.LBNHC, 10, 3, False,
                       rng) for _ in range(2)]
    canary = Canary()
    offer = canary.offer()
    assert offer is not None
    reads = []
    for rank, local in enumerate(ranks):
        (staged,) = plan_reads(local.geometry, {0: remote.geometry}, read_plan(rank, 2, 1, 4),
                               local_tp=2, remote_tp=1)
        reads.append(plan_host_read(staged, layer_groups(local.views), offer))
    return reads, remote, ranks, canary


def _expected(reads: list[Any], ranks: list[Any], lids: np.ndarray, rids: np.ndarray
              ) -> list[Any]:
    """Each rank's buffers after its host read alone (proven in test_staging), from copies."""
    saved = [[raw.clone() for raw in r.buffers] for r in ranks]
    for read in reads:
        read.copy(lids, rids)
    after = [[raw.clone() for raw in r.buffers] for r in ranks]
    for rank, buffers in zip(ranks, saved, strict=True):
        for raw, old in zip(rank.buffers, buffers, strict=True):
            raw.copy_(old)
    return after


def _together(shared: Any, reads: list[Any], ids: list[tuple[np.ndarray, np.ndarray]],
              request: str = "req") -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(shared.copy, "decode", "prefill", request, rank, read, *pair)
                   for rank, (read, pair) in enumerate(zip(reads, ids, strict=True))]
        return [f.exception() or f.result() for f in futures]


def test_sibling_ranks_copy_one_merged_read_together() -> None:
    """Two in-process decode ranks of one prefill rank: one copy writes both ranks' heads
    (the prefill's pages are read once, no sink), byte for byte what each alone writes."""
    from kvxfer.transfer.converted.host_reads import SharedCopies

    reads, _, ranks, _canary = _siblings()
    lids, rids = np.array([4, 0, 9, 2, 7]), np.array([11, 3, 5, 0, 8])
    want = _expected(reads, ranks, lids, rids)
    shared = SharedCopies()
    for rank in (0, 1):
        shared.register("decode", "prefill", 0, rank)
    results = _together(shared, reads, [(lids, rids)] * 2)
    assert [r[2] for r in results] == [2, 2], results
    assert [r[0] for r in results] == [5 * read.bytes_per_block for read in reads]
    for rank, expect in zip(ranks, want, strict=True):
        for got, raw in zip(rank.buffers, expect, strict=True):
            assert torch.equal(got, raw)
    merged_read = shared._merged[tuple(map(id, reads))][1]
    assert merged_read.read_per_block == merged_read.bytes_per_block  # nothing into a sink
    assert all(r.read_per_block > r.bytes_per_block for r in reads)  # alone: half a sink


def test_a_sibling_that_is_late_or_has_other_ids_copies_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only ranks that joined with the same ids are written by a shared copy: a rank that
    comes after the wait, or with other block ids, copies its own heads alone."""
    from kvxfer.transfer.converted import siblings
    from kvxfer.transfer.converted.host_reads import SharedCopies

    reads, _, ranks, _canary = _siblings()
    lids, rids = np.array([1, 2, 3]), np.array([4, 5, 6])
    other = (np.array([7, 8, 9]), np.array([4, 5, 6]))
    shared = SharedCopies()
    for rank in (0, 1):
        shared.register("decode", "prefill", 0, rank)
    monkeypatch.setattr(siblings, "MEET_S", 0.01)
    assert shared.copy("decode", "prefill", "late", 0, reads[0], lids, rids)[2] == 1
    assert shared.copy("decode", "prefill", "late", 1, reads[1], lids, rids)[2] == 1
    want = _expected(reads, ranks, lids, rids)
    results = _together(shared, reads, [(lids, rids), other], request="mixed")
    assert [r[2] for r in results] == [1, 1]
    for got, raw in zip(ranks[0].buffers, want[0], strict=True):
        assert torch.equal(got, raw)
    assert shared.siblings.waiting == 0  # nothing left waiting


def test_a_share_that_fails_fails_every_sibling() -> None:
    """The prefill process went away: every member of the shared copy raises (none reports
    a success), and the next request meets afresh."""
    from msgspec.structs import replace as changed

    from kvxfer.transfer.converted.host_reads import SharedCopies

    reads, _, _, canary = _siblings()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = [replace(r, offer=changed(r.offer, pid=int(gone.stdout))) for r in reads]
    shared = SharedCopies()
    for rank in (0, 1):
        shared.register("decode", "prefill", 0, rank)
    pair = (np.array([0, 1]), np.array([2, 3]))
    results = _together(shared, dead, [pair] * 2)
    assert all(isinstance(r, HostReadError) and "no such process" in str(r) for r in results)
    assert [r[2] for r in _together(shared, reads, [pair] * 2, request="next")] == [2, 2]
    del canary
