"""Converted reads from a prefill's mapped cache (:mod:`kvxfer.transfer.converted.mapped_reads`):
what a prefill offers, and every way an offer is refused before anything is mapped. The reads
themselves are proven byte-exact in test_staging (every conversion) and across real
processes in test_transfer."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from msgspec.structs import replace
from test_descriptors import make_rank

from kvxfer.plan.layout import CacheSpec, KVCacheLayout
from kvxfer.plan.regions import MemoryRegion
from kvxfer.plan.staging import StagedRead, layer_groups, plan_reads
from kvxfer.plan.topology import read_plan
from kvxfer.transfer.converted.fd_handover import HANDOVER, take
from kvxfer.transfer.converted.host_reads import Canary, HostReadError
from kvxfer.transfer.converted.mapped_reads import (
    CACHE_MEMFD_NAME,
    _Mapping,
    map_prefill,
    shared_offer,
    shared_regions,
    shared_zeros,
)
from kvxfer.wire.metadata import SharedRegion


def cache_memfds(pid: int | str = "self") -> list[str]:
    """The entries of ``/proc/<pid>/fd`` that are a shared cache buffer's memfd."""
    found = []
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
        except FileNotFoundError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(f"/memfd:{CACHE_MEMFD_NAME}"):
            found.append(f"{entry} -> {target}")
    return found


def test_a_shared_buffer_is_offered_while_it_lives() -> None:
    buffer = shared_zeros(1 << 16)
    inside = [MemoryRegion(buffer.data_ptr() + 4096, 8192, 0)]
    (region,) = shared_regions(inside)
    assert (region.addr, region.size) == (buffer.data_ptr(), 1 << 16)
    assert shared_regions([MemoryRegion(buffer.data_ptr() + (1 << 16), 4096, 0)]) == ()
    assert region.id in HANDOVER  # kept
    del buffer
    gc.collect()
    assert shared_regions(inside) == ()
    assert region.id not in HANDOVER  # closed with the memory


def test_no_descriptor_of_a_shared_buffer_stays_in_the_fd_table() -> None:
    """Whoever may inspect a process (ptrace READ rights: with Yama's ptrace_scope 1, any
    process of the same user) can open what its /proc/<pid>/fd entries name, and read
    a memfd there. Neither the prefill's buffer nor a reader's mapping of it leaves one:
    the prefill keeps the descriptor in flight in a socket (whose entry cannot be
    opened), the reader closes its own once mapped."""
    buffer = shared_zeros(1 << 16)
    assert cache_memfds() == []
    canary = Canary()
    offer = shared_offer(canary, [MemoryRegion(buffer.data_ptr(), 1 << 16, 0)])
    assert offer is not None and offer.memory
    mapping = _Mapping(offer, offer.memory[0], 0, 1 << 16)
    assert cache_memfds() == []
    assert mapping.bytes[0] == 0


def test_a_mapping_sees_the_prefills_bytes_as_they_change() -> None:
    buffer = shared_zeros(1 << 16)
    canary = Canary()
    offer = shared_offer(canary, [MemoryRegion(buffer.data_ptr(), 1 << 16, 0)])
    assert offer is not None
    mapping = _Mapping(offer, offer.memory[0], 0, 1 << 16)
    assert mapping.bytes.data_ptr() != buffer.data_ptr()  # a second mapping, not an alias
    buffer[100:103] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert mapping.bytes[100:103].tolist() == [7, 8, 9]


def test_only_the_prefills_own_mapping_writes_its_cache() -> None:
    """Whoever is handed the cache's memfd (a reader that proved it may read the
    prefill's memory, as here) can read it, never write it nor map it writable."""
    buffer = shared_zeros(8192)
    canary = Canary()
    offer = shared_offer(canary, [MemoryRegion(buffer.data_ptr(), 8192, 0)])
    assert offer is not None
    buffer[10] = 5
    other = take(offer, offer.memory[0].id)
    try:
        with pytest.raises(PermissionError):
            os.pwrite(other, b"x", 10)
        with pytest.raises(PermissionError):
            mmap.mmap(other, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        readable = mmap.mmap(other, 8192, mmap.MAP_SHARED, mmap.PROT_READ)
        assert readable[10] == 5
        readable.close()
    finally:
        os.close(other)
    buffer[11] = 6  # the prefill's own mapping still writes
    assert buffer[10:12].tolist() == [5, 6]


def test_offers_that_cannot_be_mapped_are_refused_naming_why() -> None:
    canary = Canary()
    sealed = shared_zeros(4096)
    offer = shared_offer(canary, [MemoryRegion(sealed.data_ptr(), 4096, 0)])
    assert offer is not None
    (real,) = offer.memory
    loose = os.memfd_create("unsealed")  # it could shrink under a reader
    os.ftruncate(loose, 4096)
    loose_id = HANDOVER.keep(loose)
    reading, writing = os.pipe()
    pipe_id = HANDOVER.keep(reading)
    try:
        for region, why in (
                (SharedRegion(loose_id, 4096, 4096), f"buffer {loose_id} of process "
                                                     rf"\d+ is not sealed"),
                (replace(real, size=8192), "holds 4096 bytes, not 8192"),
                (SharedRegion(pipe_id, 4096, 4096), f"mapping buffer {pipe_id} of process"),
                (SharedRegion(999_999, 4096, 4096), r"taking buffer 999999 of process \d+: "
                                                    "it holds no such buffer")):
            with pytest.raises(HostReadError, match=why):
                _Mapping(replace(offer, memory=(region,)), region, 0, 4096)
        for changed, why in (
                ({"canary": bytes(16)}, "its canary differs"),
                # another secret than the prefill's (its canary, which is on the wire)
                ({"proof_addr": offer.canary_addr}, "refused the proof that this process"),
                ({"handover": "\0kvxfer-handover-nobody"}, "over its handover socket")):
            with pytest.raises(HostReadError, match=why):
                _Mapping(replace(offer, **changed), real, 0, 4096)
    finally:
        HANDOVER.drop(loose_id)
        HANDOVER.drop(pipe_id)
        os.close(writing)


def test_a_process_that_ended_is_not_mapped() -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    canary = Canary()
    buffer = shared_zeros(4096)
    offer = shared_offer(canary, [MemoryRegion(buffer.data_ptr(), 4096, 0)])
    assert offer is not None
    with pytest.raises(HostReadError, match=f"process {gone.stdout.strip()}") as info:
        _Mapping(replace(offer, pid=int(gone.stdout)), offer.memory[0], 0, 4096)
    assert info.value.gone


def _read(separate: bool, layers: int = 3, local_separate: bool = False
          ) -> tuple[StagedRead, Any, Any, Any]:
    """A TP 1 prefill's LBNHC cache read by rank 0 of a TP 2 decode's LBHNC one: (the read,
    the prefill's rank, the decode's view groups, the decode's rank)."""
    rng = np.random.default_rng(0)
    remote = make_rank(CacheSpec(4, 4, 2, torch.float16), KVCacheLayout.LBNHC, 8, layers,
                       separate, rng, zeros=shared_zeros)
    local = make_rank(CacheSpec(4, 2, 2, torch.float16), KVCacheLayout.LBHNC, 8, layers,
                      local_separate, rng)
    (read,) = plan_reads(local.geometry, {0: remote.geometry}, read_plan(0, 2, 1, 4),
                         local_tp=2, remote_tp=1)
    assert isinstance(read, StagedRead)
    return read, remote, layer_groups(local.views), local


def test_only_a_cache_whose_chunks_lie_at_fixed_strides_in_an_offered_buffer_is_mapped() -> None:
    canary = Canary()
    read, remote, groups, _ = _read(separate=False)
    offer = shared_offer(canary, remote.plan.memory)
    assert offer is not None
    assert map_prefill(read, groups, offer) is not None
    assert map_prefill(read, groups, canary.offer()) is None  # not offered
    # one buffer per layer: no fixed layer stride (host reads or staging instead)
    apart, remote_apart, groups, _ = _read(separate=True)
    offer = shared_offer(canary, remote_apart.plan.memory)
    assert offer is not None and len(offer.memory) == 3
    assert map_prefill(apart, groups, offer) is None


def test_a_short_read_into_a_tensor_per_layer_is_shared_out_by_layers() -> None:
    """A one-block read (a short prompt in vLLM's 128-token CPU blocks) into a view with a
    tensor per layer (vLLM's) is cut by layer groups, so that every copy thread takes part,
    and places what one share does; with many blocks, shares stay whole blocks."""
    read, remote, groups, local = _read(separate=False, layers=6, local_separate=True)
    assert len(groups) == 6  # a tensor per layer
    canary = Canary()  # held: the offer names its bytes in this process
    offer = shared_offer(canary, remote.plan.memory)
    assert offer is not None
    mapped = map_prefill(read, groups, offer)
    assert mapped is not None
    lids, rids = read.ids([5], [2])
    before = [raw.clone() for raw in local.buffers]
    placed = []
    for count in (1, 4):
        for raw, old in zip(local.buffers, before, strict=True):
            raw.copy_(old)
        shares = mapped.shares(lids, rids, count)
        assert len(shares) == count  # 4: each a quarter of the layers (6 over 4 shares)
        for share in shares:
            share()
        placed.append([raw.clone() for raw in local.buffers])
    assert any(not torch.equal(a, b) for a, b in zip(placed[0], before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(placed[0], placed[1], strict=True))
    many_l, many_r = read.ids([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
    assert len(mapped.shares(many_l, many_r, 4)) == 4  # whole blocks: no layer cut


def test_a_buffer_freed_by_the_collector_while_the_buffers_are_listed_hangs_nobody(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer's finalizer runs inside whatever allocation the garbage collector
    interrupts, on any thread, with that thread's locks held. Listing the offered
    buffers (a prefill's handshake listener answering a metadata request) allocates
    under the registry's lock; a finalizer that waited for that lock there waited for
    good, and the listener with it (found by `kvxfer bench transfer`: about 1 run in 6
    ended in "no answer ... within 5 s"). Here the collection happens exactly there."""
    import threading

    from kvxfer.transfer.converted import mapped_reads

    class CollectingDict(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def,override]
            gc.collect()  # as an allocation under the lock may
            return super().items()

    # the registry, swapped for one that collects when listed; every change made to it
    # (earlier tests' buffers freed by these collections too) is copied back below, or the
    # registry would still offer them by their addresses, where new buffers come to lie
    with mapped_reads._guard.held():  # a buffer freed meanwhile is forgotten after the swap
        original = mapped_reads._buffers
        collecting = CollectingDict(original)
        monkeypatch.setattr(mapped_reads, "_buffers", collecting)
    gc.disable()
    try:
        doomed = shared_zeros(1 << 16)
        region = MemoryRegion(doomed.data_ptr(), 1 << 16, 0)
        (offered,) = shared_regions([region])
        cycle: list[Any] = [doomed]
        cycle.append(cycle)  # only the collector frees it now
        del doomed, cycle
        listed: list[Any] = []
        lister = threading.Thread(target=lambda: listed.append(shared_regions([region])),
                                  daemon=True)
        lister.start()
        lister.join(timeout=10)
    finally:
        with mapped_reads._guard.held():  # as above: nothing forgotten in between is lost
            mapped_reads._buffers = original
            original.clear()
            original.update(collecting)
        gc.enable()
    assert not lister.is_alive(), "listing the buffers hung in a buffer's finalizer"
    assert len(listed) == 1  # listed as it was when the listing began
    # and forgotten, its descriptor closed, as the listing left the lock
    assert offered.id not in original and offered.id not in HANDOVER
