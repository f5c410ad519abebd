"""Reads on one host from the prefill's cache mapped into the decode (converted and direct).

Prefill side: :func:`shared_zeros` allocates a cache buffer in a sealed memfd, kept out of the
fd table, and :func:`shared_offer` offers it. Decode side: :func:`map_prefill` takes each
offered buffer's descriptor (after the canary check), checks its seals and size and maps it
read-only, once per peer; a request is then one local copy. The mapping lives as long as the
peer.

Design: docs/design/host-reads.md#mapped-reads
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import itertools
import logging
import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from kvxfer.plan.regions import MemoryRegion
from kvxfer.plan.staging import StagedRead, as_numpy, chunk_view, fixed_strides, kernel_rows
from kvxfer.transfer.converted.fd_handover import HANDOVER, take
from kvxfer.transfer.converted.host_reads import Canary, HostReadError, verify_canary
from kvxfer.transfer.converted.stream_copy import stream_copy
from kvxfer.transfer.threads import DeferringLock, run_pulled
from kvxfer.wire.metadata import HostReads, SharedRegion

log = logging.getLogger(__name__)

# A shared cache buffer's memfd name: ``/memfd:<name>`` in /proc/<pid>/maps and fd links
CACHE_MEMFD_NAME = "kvxfer-kv-cache"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# No write and no writable shared mapping after the prefill's own (Linux 5.1; Python has
# no name for it before 3.13): whoever is handed the memfd later can read it at most.
FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
# A copy's shares per copy thread: enough that a thread slowed down takes fewer (see
# run_pulled), few enough that each is a few MiB of a large request
SHARES_PER_THREAD = 4


def share_count(threads: int) -> int:
    """Shares to cut a copy on ``threads`` threads into: one alone (each share costs its
    own planning, ~0.1 ms on a one-block read of a 30-layer vLLM cache), else
    :data:`SHARES_PER_THREAD` per thread."""
    return threads * SHARES_PER_THREAD if threads > 1 else 1

# -- the prefill side: caches in memory a reader can map ---------------------------------

# The process's shared buffers, buffer id -> (address, size) of its mapping. One registry
# per process, not per worker, on purpose: its keys are this process's buffers (kept by its
# one Handover) and addresses, which any of its ranks may offer (a reader takes them by
# id), and the caches are allocated before any worker exists (the engine's, through
# shared_zeros).
_buffers: dict[int, tuple[int, int]] = {}


def _forgotten(buffer_id: int) -> None:
    _buffers.pop(buffer_id, None)
    HANDOVER.drop(buffer_id)


# a buffer's finalizer forgets it, and may run inside any allocation, where this thread may
# already hold the lock (shared_regions listing the buffers): it defers, never waits
_guard = DeferringLock(_forgotten)
os.register_at_fork(after_in_child=_guard.after_fork)


def shared_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes in a sealed memfd mapping, offered to readers on this host
    (:func:`shared_regions`). The descriptor is not left in this process's fd table: the
    handover keeps it in flight until the memory is freed. Plain memory where this system
    has no memfd."""
    try:
        fd = os.memfd_create(CACHE_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):
        return torch.zeros(nbytes, dtype=torch.uint8)
    try:
        os.ftruncate(fd, nbytes)
        memory = _map(fd, nbytes, writable=True)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | FUTURE_WRITE)
        except OSError:  # a kernel before 5.1: shrink and grow sealed all the same
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    try:
        buffer_id = HANDOVER.keep(fd)  # closes fd: from here, not in the fd table
    except OSError as exc:  # no socket for it (out of descriptors): not offered
        log.warning("a shared cache buffer is not offered to readers: %s", exc)
        return tensor
    with _guard.held():
        _buffers[buffer_id] = (tensor.data_ptr(), nbytes)
    weakref.finalize(memory, _forget, buffer_id)
    return tensor


@cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _map(fd: int, length: int, offset: int = 0, writable: bool = False
         ) -> ctypes.Array[ctypes.c_ubyte]:
    """``length`` bytes of ``fd`` from ``offset``, mapped shared (read-only unless
    ``writable``) until the returned array is freed. Not :class:`mmap.mmap`: it keeps a
    duplicate of the descriptor open while the mapping lives, in the fd table, where
    ``/proc/<pid>/fd`` shows it to any process that may inspect this one."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    addr = _libc().mmap(None, length, prot, mmap.MAP_SHARED, fd, offset)
    if addr is None or addr == ctypes.c_void_p(-1).value:  # MAP_FAILED
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    memory = (ctypes.c_ubyte * length).from_address(addr)
    weakref.finalize(memory, _libc().munmap, addr, length)
    return memory


def _forget(buffer_id: int) -> None:
    """A buffer's finalizer (see ``_guard``)."""
    _guard.defer(buffer_id)


def shared_regions(memory: Sequence[MemoryRegion]) -> tuple[SharedRegion, ...]:
    """The shared buffers (:func:`shared_zeros`) that registered ``memory`` lies in."""
    with _guard.held():
        buffers = list(_buffers.items())
    return tuple(SharedRegion(i, addr, size) for i, (addr, size) in buffers
                 if any(addr <= m.addr and m.addr + m.nbytes <= addr + size for m in memory))


def shared_offer(canary: Canary, memory: Sequence[MemoryRegion]) -> HostReads | None:
    """``canary``'s offer with the shared buffers ``memory`` lies in and where a reader
    takes them (the handover's listener starts with the first buffer offered)."""
    regions = shared_regions(memory)
    if not regions:
        return canary.offer()
    try:
        handover, proof_addr = HANDOVER.address()
    except OSError as exc:
        log.warning("shared cache buffers are not offered to readers: %s", exc)
        return canary.offer()
    return canary.offer(regions, handover, proof_addr)


# -- the decode side: the prefill's buffers, mapped -------------------------------------

class _Mapping:
    """A window of one of a prefill's shared buffers, mapped read-only here: its bytes
    ``[start, start + len(bytes))`` in the prefill's addresses."""

    def __init__(self, offer: HostReads, region: SharedRegion, offset: int, length: int
                 ) -> None:
        verify_canary(offer)  # the pid is the prefill's, and this process may read it
        fd = take(offer, region.id)
        where = f"buffer {region.id} of process {offer.pid}"
        try:
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                raise HostReadError(f"{where} is not sealed: it could shrink under a reader")
            if os.fstat(fd).st_size < max(region.size, offset + length):
                raise HostReadError(f"{where} holds {os.fstat(fd).st_size} bytes, not "
                                    f"{region.size}")
            # not MAP_POPULATE: faulting a page the prefill never touched would allocate
            # it here; a page is faulted in once, when a lease first reads it
            memory = _map(fd, length, offset)
        except OSError as exc:
            raise HostReadError(f"mapping {where}: {exc}") from exc
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only memory: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(memoryview(memory).cast("B").toreadonly(),
                                          dtype=torch.uint8)
        self.start = region.addr + offset


class Mappings:
    """The prefill windows mapped here, by (host, pid, canary, buffer id, offset, length):
    the decode ranks that share one (:class:`~kvxfer.transfer.converted.process_shares.
    ProcessShares`) map a prefill's buffer once while any of them plans a read from it.
    Thread-safe (handshakes plan reads on pool threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: weakref.WeakValueDictionary[tuple[str, int, bytes, int, int, int],
                                                  _Mapping] = weakref.WeakValueDictionary()

    def window(self, offer: HostReads, region: SharedRegion, start: int, end: int
               ) -> _Mapping:
        """The window of ``region`` that holds prefill addresses ``[start, end)``."""
        offset = (start - region.addr) // mmap.ALLOCATIONGRANULARITY * \
            mmap.ALLOCATIONGRANULARITY
        key = (offer.host, offer.pid, offer.canary, region.id, offset,
               end - region.addr - offset)
        with self._lock:
            found = self._mapped.get(key)
        if found is None:
            found = _Mapping(offer, region, key[4], key[5])
            with self._lock:
                self._mapped[key] = found
        return found


@dataclass(frozen=True)
class MappedRead:
    """One prefill rank's converted read from its mapped cache into this rank's view
    ``groups``: ``source`` is every one of the prefill rank's kernel blocks, as
    ``[kernel blocks, layers, chunks, chunk elements]``."""

    plan: StagedRead
    groups: Sequence[tuple[int, torch.Tensor]]
    source: torch.Tensor
    mapping: _Mapping  # keeps the memory mapped while the read is planned

    @property
    def remote_rank(self) -> int:
        return self.plan.remote_rank

    def copy(self, local_ids: np.ndarray, remote_ids: np.ndarray,
             pool: Executor | None = None, threads: int = 1) -> tuple[int, int]:
        """Copy the request's heads into place; (bytes placed: the paired tokens', copy
        threads). With ``pool``, the copy is cut into :func:`share_count` shares, taken in
        turn by this thread and ``threads - 1`` of the pool
        (:func:`~kvxfer.transfer.threads.run_pulled`); returns once every share ended."""
        threads = max(1, threads if pool else 1)
        run_pulled(self.shares(local_ids, remote_ids, share_count(threads)), pool,
                   threads)
        return self.placed(local_ids, remote_ids), threads

    def shares(self, local_ids: np.ndarray, remote_ids: np.ndarray, count: int
               ) -> list[Callable[[], None]]:
        """The request's copy cut into up to ``count`` shares, each to run on a thread of
        its own (numpy's copy releases the GIL, :func:`copy_alone`): whole blocks, and
        where there are fewer blocks than shares (a short prompt: vLLM's CPU cache holds
        128 tokens a block) and the view has several layer groups (vLLM's: a tensor per
        layer), each block's layer groups are cut too, so that a one-block read is not
        one thread's alone."""
        plan, ratio = self.plan, self.plan.remote.kernel_ratio

        source, all_groups, copy = self._operands

        def run(local: slice, remote: slice, groups: Sequence[tuple[int, Any]]) -> None:
            rows = kernel_rows(remote_ids[remote], ratio)
            plan.place(source, range(source.shape[2]), rows, groups, local_ids[local],
                       plan.remote.kv_packing, plan.local.kv_packing, copy)

        blocks = [share for share in plan.shares(len(local_ids), len(remote_ids), count)
                  if share[1].stop > share[1].start]
        cuts = max(1, min(len(all_groups), count // max(1, len(blocks))))
        bounds = np.linspace(0, len(all_groups), cuts + 1).astype(int)
        layers = [all_groups[lo:hi] for lo, hi in itertools.pairwise(bounds) if hi > lo]
        return [functools.partial(run, local, remote, groups)
                for local, remote in blocks for groups in layers]

    @functools.cached_property
    def _operands(self) -> tuple[Any, Sequence[tuple[int, Any]], Callable[[Any, Any], object]]:
        """(source, groups, copy) for :meth:`StagedRead.place`: numpy views of them with
        :func:`~kvxfer.transfer.converted.stream_copy.stream_copy` where every piece
        moves K and V together (:meth:`StagedRead.kv_together`), else the tensors with
        :func:`copy_alone`. Numpy's slicing costs a fraction of torch's: a one-block read
        of a 30-layer vLLM cache (a view per layer) spent ~0.2 ms of ~0.8 in slicing
        tensors."""
        plan = self.plan
        if not plan.kv_together(plan.remote.kv_packing, plan.local.kv_packing):
            return self.source, self.groups, copy_alone
        return (as_numpy(self.source), [(layer, as_numpy(g)) for layer, g in self.groups],
                stream_copy)

    def placed(self, local_ids: np.ndarray, remote_ids: np.ndarray) -> int:
        """Bytes a copy of these ids places: the paired tokens' (the shorter side's), each
        this rank's heads of every layer."""
        plan = self.plan
        tokens = min(len(local_ids) * plan.local.block_size,
                     len(remote_ids) * plan.remote.block_size)
        return tokens * plan.placed_per_block // plan.remote.block_size


def copy_alone(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` (same shape and dtype) on the calling thread alone. Torch
    shares a large copy out over its intra-op threads; a mapped read's copy threads, and
    the sibling ranks copying beside them, would then oversubscribe the cores (measured on
    2 cores: 10 GB/s for two copy threads of 64 KiB runs through torch, 14 through numpy,
    which copies where it is called and releases the GIL meanwhile), with streaming stores
    where they apply (:func:`~kvxfer.transfer.converted.stream_copy.stream_copy`)."""
    stream_copy(as_numpy(target), as_numpy(source))


def map_prefill(plan: StagedRead, groups: Sequence[tuple[int, torch.Tensor]],
                offer: HostReads, mappings: Mappings | None = None) -> MappedRead | None:
    """``plan``'s read from the offering process's mapped cache into view ``groups``
    (:func:`kvxfer.plan.staging.layer_groups`), or None where its offer holds no buffer around
    the plan's chunks or they do not lie at fixed strides; raises :class:`HostReadError`
    when mapping an offered buffer fails. The window is taken from ``mappings`` (mapped
    there once), or mapped for this read alone."""
    geo, dtype = plan.remote, groups[0][1].dtype
    strides = fixed_strides(geo.base, geo.block_stride)
    size = torch.empty((), dtype=dtype).element_size()
    if strides is None or geo.chunk_len % size:
        return None
    base, layer, chunk, block = strides
    kernels = geo.num_blocks * geo.kernel_ratio
    chunks = geo.base.shape[1]
    end = base + (kernels - 1) * block + (geo.num_layers - 1) * layer + (chunks - 1) * chunk \
        + geo.chunk_len
    region = next((r for r in offer.memory if r.addr <= base and end <= r.addr + r.size), None)
    if region is None or any(x % size for x in (base - region.addr, layer, chunk, block)):
        return None
    mapping = (mappings or Mappings()).window(offer, region, base, end)  # the plan's bytes
    source = chunk_view(mapping.bytes.view(dtype), geo, mapping.start)
    return None if source is None else MappedRead(plan, groups, source, mapping)


def mappable(plan: StagedRead) -> bool:
    """Whether ``plan``'s chunks lie at fixed strides, as one mapping needs (kvxfer's own
    caches: one allocation per rank)."""
    return fixed_strides(plan.remote.base, plan.remote.block_stride) is not None
