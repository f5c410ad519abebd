"""Push mode for real: a prefill OS process WRITEs into a decode's reserved blocks.

The decode (this process, or a second OS process where it is killed) reserves blocks and
serves handshakes; the prefill process leases its pattern-filled blocks and pushes them,
layer group by layer group, into the reservation over NIXL. A reservation ends "done" on
the decode only once every writer's signed "done" arrived, and then its blocks hold
exactly the prefill's bytes for the decode rank's heads, and nothing else changed. Every
fault ends both sides' holds: nothing leaked, nothing wrong marked landed.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import msgspec
import pytest
import torch

from kvxfer.harness import preloaded
from kvxfer.harness.loopback import CacheConfig, LoopbackInstance, PrefillProcess
from kvxfer.plan.layout import KVCacheLayout
from tests.test_transfer import check_blocks, pattern, tokens_of

KEY = "5ec7e7" * 8

# layout pairs and TP pairs that byte copies place
CASES = (
    [(lay.name, lay.name, 1, 1) for lay in KVCacheLayout]
    + [(lay, lay, p, d) for lay in ("LBHNC", "BLHNC", "BHLNC", "LHBNC")
       for p, d in ((1, 2), (2, 1), (2, 4))]
    + [("BLHNC", "LBHNC", 1, 1), ("BHLNC", "BLHNC", 2, 1), ("LBHNC", "BHLNC", 1, 2)]
)
# pairs the prefill converts (into a shadow, then byte copies): a head split of a
# tokens-outside-heads prefill, heads and tokens ordered apart, and a decode that keeps a
# block's heads together gathering them from two prefill ranks (a run per token)
CONVERTED = [("LBNHC", "LBNHC", 1, 2), ("BLNHC", "LBHNC", 1, 1), ("LBHNC", "BLNHC", 2, 4),
             ("LBNHC", "LBNHC", 2, 1), ("BHLNC", "BLNHC", 2, 1)]


def wait_released(inst: LoopbackInstance, ids: set[str], timeout: float = 20.0
                  ) -> dict[str, str]:
    got: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while not ids <= set(got) and time.monotonic() < deadline:
        got.update(inst.released())
        time.sleep(0.002)
    return got


def leases(inst: LoopbackInstance) -> list[int]:
    return [w.num_leases for w in inst.workers]


# every case handed layer by layer, as an engine hands them; a few all at the seal
@pytest.mark.parametrize(("prefill_layout", "decode_layout", "prefill_tp", "decode_tp", "groups"),
                         [(*case, "each layer") for case in CASES + CONVERTED] +
                         [(*case, None) for case in CASES if case[0] in ("LBHNC", "BHLNC")
                          and case[2:] in ((1, 1), (2, 4))])
def test_a_push_lands_byte_exact(prefill: PrefillProcess, prefill_layout: str,
                                 decode_layout: str, prefill_tp: int, decode_tp: int,
                                 groups: str | None) -> None:
    """Two pushes at once, layer by layer or all at the seal: each reservation ends "done"
    with the prefill's bytes in place, and each prefill lease ends "done"."""
    pcfg = CacheConfig(layout=prefill_layout, tp=prefill_tp, num_blocks=24, key=KEY)
    dcfg = replace(pcfg, layout=decode_layout, tp=decode_tp, num_blocks=20)
    remote = prefill.create(pcfg)
    decode = LoopbackInstance.create("decode", dcfg, fill="sentinel", listen=True)
    layers = [range(i, i + 1) for i in range(pcfg.num_layers)] if groups else None
    try:
        pushes = {"a": ([3, 9, 1], [0, 7, 2]), "b": ([12, 13, 14, 15], [10, 11, 19, 4])}
        for rid, (remote_ids, local_ids) in pushes.items():
            reservation = decode.reserve(f"resv-{rid}", local_ids,
                                         len(local_ids) * dcfg.block_size, ttl=30)
            prefill.push(remote["engine_id"], f"lease-{rid}", reservation, remote_ids,
                         groups=layers)
        assert wait_released(decode, {"resv-a", "resv-b"}) == {"resv-a": "done",
                                                              "resv-b": "done"}
        check_blocks(decode, pcfg, [*pushes["a"][1], *pushes["b"][1]],
                     [*pushes["a"][0], *pushes["b"][0]])
        assert prefill.wait_released(remote["engine_id"], {"lease-a", "lease-b"}) == \
            {"lease-a": "done", "lease-b": "done"}
        assert prefill.leases(remote["engine_id"]) == [0] * prefill_tp
        assert leases(decode) == [0] * decode_tp
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


@pytest.mark.parametrize(("prefill_bs", "decode_bs", "cached", "tp"), [
    (16, 32, 0, (1, 2)), (32, 8, 0, (2, 1)),
    (32, 16, 16, (1, 1)), (32, 16, 48, (1, 2)), (16, 32, 32, (2, 1)), (16, 16, 48, (1, 1))])
def test_a_push_across_block_sizes_moves_every_token_to_its_place(
        prefill: PrefillProcess, prefill_bs: int, decode_bs: int, cached: int,
        tp: tuple[int, int]) -> None:
    """Tokens pair in order across block sizes. A decode whose prefix cache holds a
    prompt's first ``cached`` tokens reserves blocks for the rest only: the prefill writes
    the tokens after them, from inside one of its blocks where its blocks are larger, and
    never a block the decode holds already."""
    tokens = 77  # a last block partly filled on both sides
    pcfg = CacheConfig(layout="LBHNC", block_size=prefill_bs, num_blocks=24, tp=tp[0])
    dcfg = replace(pcfg, layout="BLHNC", block_size=decode_bs, tp=tp[1])
    remote = prefill.create(pcfg)
    decode = LoopbackInstance.create("decode", dcfg, fill="sentinel", listen=True)
    try:
        remote_ids = [5, 1, 17, 9, 12][:-(-tokens // prefill_bs)]
        local_ids = [2, 20, 7, 11, 3, 8, 14, 0, 6, 15][:-(-tokens // decode_bs)]
        reserved = local_ids[cached // decode_bs:]  # the blocks before hold the cached prefix
        reservation = decode.reserve("resv", reserved, tokens, ttl=30, cached_tokens=cached)
        prefill.push(remote["engine_id"], "lease", reservation, remote_ids,
                     groups=[range(0, 1), range(1, pcfg.num_layers)])
        assert wait_released(decode, {"resv"}) == {"resv": "done"}
        seen = replace(pcfg, tp=dcfg.tp)
        others = sorted(set(range(dcfg.num_blocks)) - set(reserved))
        for rank, caches in enumerate(decode.caches):
            for layer, view in enumerate(caches.values()):
                got = dcfg.logical(view)
                want = tokens_of(pattern(seen, rank, layer), remote_ids, tokens)
                assert torch.equal(tokens_of(got, local_ids, tokens)[:, cached:],
                                   want[:, cached:]), (rank, layer)
                assert (got[others] == -1).all(), "a cached block (or another) was written"
        assert prefill.wait_released(remote["engine_id"], {"lease"}) == {"lease": "done"}
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


def untouched(decode: LoopbackInstance) -> bool:
    return all(bool((view == -1).all()) for caches in decode.caches for view in caches.values())


@pytest.mark.parametrize("forgery", ["other blocks", "later deadline", "no ticket", "wrong key"])
def test_a_reservation_that_does_not_verify_is_never_written(prefill: PrefillProcess,
                                                             forgery: str) -> None:
    """With a key, a prefill writes only into a reservation exactly as the decode signed
    it: an altered or unsigned one fails the push (the lease ends "failed") and no byte
    of the decode changes."""
    cfg = CacheConfig(num_blocks=16, key=KEY)
    remote = prefill.create(cfg)
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel", listen=True)
    try:
        # refused at the claim, at once: the hold need not outlast the refusal by much
        real = decode.reserve("resv", [1, 2], 2 * cfg.block_size, ttl=2, grace=0.5)
        forged = {
            "other blocks": msgspec.structs.replace(real, block_ids=(3, 4)),
            "later deadline": msgspec.structs.replace(real, expires_at=real.expires_at + 60),
            "no ticket": msgspec.structs.replace(real, ticket=None),
            "wrong key": msgspec.structs.replace(real, ticket=None).signed(b"guess" * 8),
        }[forgery]
        prefill.push(remote["engine_id"], "lease", forged, [5, 6])
        assert prefill.wait_released(remote["engine_id"], {"lease"}) == {"lease": "failed"}
        assert untouched(decode)
        # the decode's hold ends at its own deadline, unwritten
        assert wait_released(decode, {"resv"}, timeout=10) == {"resv": "expired"}
        assert untouched(decode)
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


def test_a_reservation_another_engine_claimed_first_is_never_written(
        prefill: PrefillProcess) -> None:
    """The prefill claims a reservation before its first WRITE; a decode grants the claim
    to the first engine only, so a reservation claimed by someone else fails the push
    (its lease ends "failed") with no byte of its blocks changed, and the "gave up" the
    prefill then sends ends nothing there (it is not the claimer). The decode is
    connected already (a first push landed), so only the claim keeps the WRITEs back."""
    from kvxfer.transfer.side_channel.client import SideChannelClient

    cfg = CacheConfig(num_blocks=16, key=KEY)
    remote = prefill.create(cfg)
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel", listen=True)
    try:
        first = decode.reserve("first", [1, 2], 2 * cfg.block_size, ttl=30)
        prefill.push(remote["engine_id"], "lease-1", first, [5, 6])
        assert wait_released(decode, {"first"}) == {"first": "done"}
        taken = decode.reserve("resv", [3, 4], 2 * cfg.block_size, ttl=5, grace=0.5)
        with SideChannelClient("first-claimer", cfg.compat(), cfg.hmac_key) as other:
            assert other.renew("127.0.0.1", decode.port, "resv", claim=True).found
        prefill.push(remote["engine_id"], "lease-2", taken, [7, 8])
        assert prefill.wait_released(remote["engine_id"], {"lease-1", "lease-2"}) == {
            "lease-1": "done", "lease-2": "failed"}
        assert all(bool((view[3:5] == -1).all())
                   for caches in decode.caches for view in caches.values())
        time.sleep(1.0)  # the prefill's "gave up" came, and changed nothing here
        assert decode.workers[0].lease_claimer("resv") == "first-claimer"
        assert decode.released() == {} and leases(decode) == [1]
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


def test_an_expired_reservation_is_never_written(prefill: PrefillProcess) -> None:
    cfg = CacheConfig(num_blocks=16)
    remote = prefill.create(cfg)
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel", listen=True)
    try:
        real = decode.reserve("resv", [1, 2], 2 * cfg.block_size, ttl=5, grace=0.5)
        late = msgspec.structs.replace(real, expires_at=time.time() - 1)
        prefill.push(remote["engine_id"], "lease", late, [5, 6])
        assert prefill.wait_released(remote["engine_id"], {"lease"}) == {"lease": "failed"}
        assert untouched(decode)
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


def test_a_reservation_a_prefill_claimed_outlives_its_deadline_and_names_its_claimer() -> None:
    """The prefill claims the reservation before its first WRITE, then dies after WRITing
    some layers, before its "done". Only a writer can say that its WRITEs ended (over TCP,
    a cut link delivers what it held back once it is back), so the claimed reservation
    is not ended by its deadline: it names its claimer, which the decode's sidecar asks
    whether it still runs (``Claimers``), and holds up to the stale limit."""
    cfg = CacheConfig(num_blocks=16, num_layers=3)
    proc = PrefillProcess()
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel", listen=True)
    try:
        remote = proc.create(cfg)
        reservation = decode.reserve("resv", [1, 2], 2 * cfg.block_size, ttl=2, grace=1)
        proc.push(remote["engine_id"], "lease", reservation, [5, 6], groups=[range(0, 1)],
                  seal=False)
        view = next(iter(decode.caches[0].values()))  # layer 0
        deadline = time.monotonic() + 10
        while bool((view[1] == -1).all()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not bool((view[1] == -1).all()), "layer 0 was never written"
        assert decode.workers[0].lease_claimer("resv") == remote["engine_id"]
        proc.kill()
        time.sleep(max(0.0, reservation.expires_at + 1.5 - time.time()))  # past the grace
        assert decode.released() == {} and leases(decode) == [1]
        assert decode.workers[0].end_lease("resv", "abandoned")
        assert wait_released(decode, {"resv"}, timeout=10) == {"resv": "abandoned"}
    finally:
        decode.close()
        proc.close()


def test_a_decode_killed_before_the_push_fails_it_and_frees_the_prefill(
        prefill: PrefillProcess) -> None:
    """The decode process that reserved is gone when the prefill pushes: the handshake
    finds nobody, the push fails and the prefill's lease ends "failed" at once (not at
    its TTL)."""
    cfg = CacheConfig(num_blocks=16)
    decode_proc = PrefillProcess()
    local = LoopbackInstance.create("prefill", cfg)
    try:
        remote = decode_proc.create(cfg, fill="sentinel", role="decode")
        reservation = decode_proc.reserve(remote["engine_id"], "resv", [1, 2],
                                          2 * cfg.block_size, ttl=30)
        decode_proc.kill()
        from kvxfer.wire.reservations import parse_reservation

        started = time.monotonic()
        local.push("lease", parse_reservation(reservation), [5, 6])
        assert wait_released(local, {"lease"}, timeout=30) == {"lease": "failed"}
        assert time.monotonic() - started < 30
        assert leases(local) == [0]
    finally:
        local.close()
        decode_proc.close()


def test_a_decode_sees_a_writer_that_gave_up_as_failed_not_landed(prefill: PrefillProcess
                                                                  ) -> None:
    """A prefill that gives the request up after some layers tells the decode: its
    reservation ends "failed" at once, never "done"."""
    cfg = CacheConfig(num_blocks=16)
    remote = prefill.create(cfg)
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel", listen=True)
    try:
        reservation = decode.reserve("resv", [1, 2], 2 * cfg.block_size, ttl=30)
        prefill.push(remote["engine_id"], "lease", reservation, [5, 6], groups=[range(0, 1)],
                     seal=False)
        view = next(iter(decode.caches[0].values()))
        deadline = time.monotonic() + 10
        while bool((view[1] == -1).all()) and time.monotonic() < deadline:
            time.sleep(0.005)
        prefill.give_up(remote["engine_id"], "lease")
        assert wait_released(decode, {"resv"}, timeout=10) == {"resv": "failed"}
        assert prefill.wait_released(remote["engine_id"], {"lease"}) == {"lease": "failed"}
        assert torch.equal(view[0], torch.full_like(view[0], -1))
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


REPAIR_S = 5.0  # a lost "done" is repaired within this; the reservation's deadline is 30 s


@pytest.mark.parametrize("gives_up", [False, True], ids=["landed", "gave-up"])
def test_a_lost_done_notification_is_repaired_over_the_side_channel(
        prefill: PrefillProcess, monkeypatch: pytest.MonkeyPatch, gives_up: bool) -> None:
    """Every NIXL notification to the decode is lost (its ranks drop them uncounted). The
    writer's report over the decode's side channel ends the reservation all the same,
    within REPAIR_S, far below its deadline: "done" with the bytes in place, or "failed"
    for a writer that gave up once its WRITEs had completed."""
    pcfg = CacheConfig(layout="LBHNC", num_blocks=16, key=KEY)
    dcfg = replace(pcfg, tp=2)
    remote = prefill.create(pcfg)
    decode = LoopbackInstance.create("decode", dcfg, fill="sentinel", listen=True)
    for worker in decode.workers:
        monkeypatch.setattr(worker._leases, "receive", lambda _notifications: None)
    try:
        reservation = decode.reserve("resv", [1, 2], 2 * pcfg.block_size, ttl=30)
        prefill.push(remote["engine_id"], "lease", reservation, [5, 6],
                     groups=[range(0, 1)], seal=not gives_up)
        if gives_up:
            view = next(iter(decode.caches[0].values()))
            deadline = time.monotonic() + 10
            while bool((view[1] == -1).all()) and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.2)  # its WRITE completes at the writer
            prefill.give_up(remote["engine_id"], "lease")
        outcome = "failed" if gives_up else "done"
        assert wait_released(decode, {"resv"}, timeout=REPAIR_S) == {"resv": outcome}
        if not gives_up:
            check_blocks(decode, pcfg, [1, 2], [5, 6])
        assert prefill.wait_released(remote["engine_id"], {"lease"}) == {"lease": outcome}
        assert leases(decode) == [0, 0]
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


def test_only_a_rank_every_write_of_which_completed_gets_the_side_channel_copy() -> None:
    """The side-channel copy of a push's "done" or "failed" goes only to a decode rank
    every WRITE of which completed (or nothing was written into): a WRITE that failed, or
    is still in flight, may land later over TCP, and only the NIXL notification is ordered
    behind it."""
    import numpy as np

    from kvxfer.transfer.pushes.pusher import Pusher, _Push
    from kvxfer.wire.notification import ReadDone
    from kvxfer.wire.reservations import Reservation

    class Write:
        def __init__(self, state: str) -> None:
            self._state = state

        def state(self) -> str:
            if self._state == "ERR":
                raise RuntimeError("the WRITE failed")
            return self._state

    reported: list[int] = []

    class Reports:  # the instance's, as the pusher queues its reports there
        def done(self, host: str, port: int, report: Any, lease_ends: float) -> bool:
            reported.append(report.prefill_rank)
            return True

    pusher = Pusher(None, None, None, 2, Reports())  # type: ignore[arg-type]  # reports only
    reservation = Reservation("resv-x", "decode-x", "127.0.0.1", 5555, 4, (1,), 16, 16,
                              time.time() + 30)
    push = _Push("lease-x", reservation, np.array([0]), 0)
    push.told = {rank: ReadDone("resv-x", "prefill-x", 0, 1, False) for rank in range(4)}
    push.inflight = {0: [Write("DONE"), Write("DONE")], 1: [Write("DONE"), Write("ERR")],
                     2: [Write("DONE"), Write("PROC")]}  # rank 3: nothing written into it
    pusher._report(push)
    assert sorted(reported) == [0, 3]


def test_a_reservation_that_does_not_verify_ends_no_real_one(prefill: PrefillProcess) -> None:
    """A forged reservation naming a real one's id (the prefill already connected to that
    decode) is refused without a word to the decode: the real reservation stays held and
    a genuine push still lands in it."""
    cfg = CacheConfig(num_blocks=16, key=KEY)
    remote = prefill.create(cfg)
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel", listen=True)
    try:
        first = decode.reserve("resv-a", [1], cfg.block_size, ttl=30)
        prefill.push(remote["engine_id"], "lease-a", first, [5])
        assert wait_released(decode, {"resv-a"}) == {"resv-a": "done"}
        assert prefill.wait_released(remote["engine_id"], {"lease-a"}) == {"lease-a": "done"}
        real = decode.reserve("resv-b", [2], cfg.block_size, ttl=30)
        prefill.push(remote["engine_id"], "lease-forged", msgspec.structs.replace(
            real, ticket=None), [6])
        assert prefill.wait_released(remote["engine_id"], {"lease-forged"}) == \
            {"lease-forged": "failed"}
        time.sleep(0.2)  # a wrongly signed "failed" would have arrived by now
        assert decode.released() == {} and leases(decode) == [1]
        prefill.push(remote["engine_id"], "lease-b", real, [6])
        assert wait_released(decode, {"resv-b"}) == {"resv-b": "done"}
        check_blocks(decode, cfg, [1, 2], [5, 6])
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


def test_a_push_whose_lease_ended_stops_and_tells_the_decode() -> None:
    """The prefill's lease of the pushed blocks ends mid-push (its blocks may be another
    request's then): the push writes nothing more, never says "done", and tells the
    decode it gave up."""
    cfg = CacheConfig(num_blocks=16, num_layers=3)
    decode_proc = PrefillProcess()
    local = LoopbackInstance.create("prefill", cfg)
    try:
        remote = decode_proc.create(cfg, fill="sentinel", role="decode")
        from kvxfer.wire.reservations import parse_reservation

        reservation = parse_reservation(decode_proc.reserve(
            remote["engine_id"], "resv", [1, 2], 2 * cfg.block_size, ttl=30))
        local.push("lease", reservation, [5, 6], groups=[range(0, 1)], seal=False)
        assert local.workers[0].end_lease("lease", "abandoned")
        local.workers[0].seal_push("lease")
        assert decode_proc.wait_released(remote["engine_id"], {"resv"}) == {"resv": "failed"}
        assert wait_released(local, {"lease"}) == {"lease": "abandoned"}
        assert leases(local) == [0]
    finally:
        local.close()
        decode_proc.close()


def test_a_reservation_outlives_its_deadline_by_the_grace() -> None:
    """A reservation nobody finished is held past its deadline for the grace (a WRITE cut
    off at the deadline may still land meanwhile), then ends "expired"."""
    cfg = CacheConfig(num_blocks=8)
    decode = LoopbackInstance.create("decode", cfg, fill="sentinel", listen=True)
    try:
        reservation = decode.reserve("resv", [1], cfg.block_size, ttl=0.5, grace=2.0)
        time.sleep(max(0.0, reservation.expires_at + 0.5 - time.time()))
        assert decode.released() == {} and leases(decode) == [1]
        assert wait_released(decode, {"resv"}, timeout=10) == {"resv": "expired"}
    finally:
        decode.close()


def test_bench_push_times_push_and_pull_of_the_same_bytes_side_by_side() -> None:
    """``kvxfer bench push`` runs every mode of every case and reports each against pull
    measured in the same run; a bad case list is refused with the form it expects."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return preloaded.run("kvxfer.cli", ["bench", "push", *args], root, timeout=180)

    out = bench("--cases", "LBHNC:1:1,BLHNC:2:1", "--tokens", "40", "--layers", "2",
                "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)["rows"]
    assert [(r["layout"], r["prefill_tp"], r["decode_tp"]) for r in rows] == \
        [("LBHNC", 1, 1), ("BLHNC", 2, 1)]
    for row in rows:
        assert row["bytes"] == 40 * 2 * 8 * 2 * 128 * 2  # tokens x layers x heads x K,V
        assert min(row["pull_ms"], row["push_ms"], row["push_layer_ms"]) > 0
        # from the unrounded times
        assert row["push_vs_pull"] == pytest.approx(row["pull_ms"] / row["push_ms"], abs=0.02)
    bad = bench("--cases", "LBHNC-1-1")
    assert bad.returncode != 0 and "LAYOUT:PREFILL_TP:DECODE_TP" in bad.stderr


def test_a_pair_nothing_can_place_tells_the_decode_at_once(prefill: PrefillProcess) -> None:
    """Caches no push can place (block sizes neither of which divides the other): the push
    writes nothing and tells every decode rank it gave up, so the reservation ends
    "failed" now, not at its deadline."""
    pcfg = CacheConfig(layout="LBNHC", num_blocks=16)
    dcfg = replace(pcfg, tp=2, block_size=6)
    remote = prefill.create(pcfg)
    decode = LoopbackInstance.create("decode", dcfg, fill="sentinel", listen=True)
    try:
        reservation = decode.reserve("resv", [1, 2], 2 * dcfg.block_size, ttl=60)
        prefill.push(remote["engine_id"], "lease", reservation, [5, 6, 7])
        assert wait_released(decode, {"resv"}, timeout=10) == {"resv": "failed"}
        assert prefill.wait_released(remote["engine_id"], {"lease"}) == {"lease": "failed"}
        assert untouched(decode)
    finally:
        decode.close()
        prefill.drop(remote["engine_id"])


def test_a_converted_push_gives_its_shadows_back_for_the_next() -> None:
    """A converted push WRITEs from shadows of the prefill rank's staging pool: each is
    given back once the push ended, "done" or failed, and the next push reuses it (the
    pool allocates nothing more)."""
    pcfg = CacheConfig(layout="LBNHC", num_blocks=16, key=KEY)
    dcfg = replace(pcfg, layout="LBHNC", tp=2)
    writer = LoopbackInstance.create("prefill", pcfg)
    decode = LoopbackInstance.create("decode", dcfg, fill="sentinel", listen=True)
    pool = writer.workers[0]._staging  # the rank's pool (the shadows' only owner)
    try:
        sizes = []
        for n, ok in enumerate((True, True, False)):
            blocks = [1, 2, 3] if ok else [8, 9, 10]
            reservation = decode.reserve(f"resv-{n}", blocks, 3 * pcfg.block_size, ttl=30)
            writer.push(f"lease-{n}", reservation, [5, 6, 7], groups=[range(0, 1)], seal=ok)
            if not ok:  # given up once its first layer landed (its shadows were taken)
                first = decode.caches[0]["model.layers.0.self_attn"]
                deadline = time.monotonic() + 20
                while (first[blocks[0]] == -1).all() and time.monotonic() < deadline:
                    time.sleep(0.002)
                writer.give_up(f"lease-{n}")
            outcome = "done" if ok else "failed"
            assert wait_released(writer, {f"lease-{n}"}) == {f"lease-{n}": outcome}
            assert wait_released(decode, {f"resv-{n}"}) == {f"resv-{n}": outcome}
            sizes.append((pool.allocated, pool.free, pool.held))
            if n == 1:  # two pushes landed in the same blocks, nothing else written
                check_blocks(decode, pcfg, [1, 2, 3], [5, 6, 7])
        assert sizes[0][0] > 0 and sizes == [sizes[0]] * 3, sizes  # reused, none held
        assert sizes[0][1] == 2  # a shadow per decode rank, both back in the pool
    finally:
        decode.close()
        writer.close()


def test_a_converted_push_waits_for_shadows_a_push_ending_gives_back() -> None:
    """With room in the staging pool for one push's shadows, a second converted push waits
    (it writes nothing meanwhile), and goes on once the first ended and gave them back."""
    from kvxfer.transfer.pushes.pusher import SHADOW_GRANULE

    pcfg = CacheConfig(layout="LBNHC", num_blocks=16, key=KEY)
    dcfg = replace(pcfg, layout="LBHNC", tp=2)
    writer = LoopbackInstance.create("prefill", pcfg)
    decode = LoopbackInstance.create("decode", dcfg, fill="sentinel", listen=True)
    writer.workers[0]._staging.limit = 2 * SHADOW_GRANULE  # a shadow per decode rank, once
    first_layer = decode.caches[0]["model.layers.0.self_attn"]
    try:
        first = decode.reserve("resv-a", [1, 2], 2 * pcfg.block_size, ttl=30)
        writer.push("lease-a", first, [5, 6], groups=[range(0, 1)], seal=False)
        deadline = time.monotonic() + 20
        while (first_layer[1] == -1).all() and time.monotonic() < deadline:
            time.sleep(0.002)  # push a holds its shadows: its first layer landed
        second = decode.reserve("resv-b", [3, 4], 2 * pcfg.block_size, ttl=30)
        # handed a layer, not sealed: nothing polls it, only push a's end wakes it
        writer.push("lease-b", second, [7, 8], groups=[range(0, 1)], seal=False)
        time.sleep(0.5)
        assert (first_layer[3:5] == -1).all(), "push b wrote without a shadow"
        for worker in writer.workers:
            worker.seal_push("lease-a")
        assert wait_released(decode, {"resv-a"}) == {"resv-a": "done"}
        deadline = time.monotonic() + 5
        while (first_layer[3] == -1).all() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert not (first_layer[3] == -1).all(), "push b's first layer did not go on"
        for worker in writer.workers:
            worker.seal_push("lease-b")
        assert wait_released(decode, {"resv-b"}) == {"resv-b": "done"}
        check_blocks(decode, pcfg, [1, 2, 3, 4], [5, 6, 7, 8])
    finally:
        decode.close()
        writer.close()
