"""Converted reads on one host: ``process_vm_readv`` copies the prefill's bytes straight into
their places, the conversion done by the copy.

A prefill rank offers it in its handshake (:class:`~kvxfer.wire.metadata.HostReads`: host
identity, pid, canary); a decode rank with a host cache takes it only after the canary proved
the pid, and reads the canary again after every copy. It needs what NIXL's cma transport
needs: the same user, or ptrace rights over the prefill.

Design: docs/design/host-reads.md#host-reads
"""

from __future__ import annotations

import ctypes
import errno as errno_codes
import functools
import itertools
import os
import secrets
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from functools import cache

import numpy as np
import torch

from kvxfer.plan.staging import StagedRead
from kvxfer.transfer.converted.siblings import Meeting, Siblings
from kvxfer.transfer.threads import run_all
from kvxfer.wire.metadata import HostReads, SharedRegion

IOV_MAX = 1024  # iovecs per side in one call (Linux UIO_MAXIOV)
MIN_RUN_BYTES = 128  # shorter average runs: per-run costs make staging cheaper
BRIDGE_BYTES = 4096  # remote gaps up to this are read through (see _bridged)
CANARY_BYTES = 16


class HostReadError(RuntimeError):
    """A host read failed; ``gone`` when the prefill process is not there any more."""

    def __init__(self, message: str, gone: bool = False) -> None:
        super().__init__(message)
        self.gone = gone


@cache
def _readv() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]
    return fn


def host_identity() -> str | None:
    """This process's host and pid namespace ("" parts where /proc lacks them); None where
    host reads are not possible at all (no /proc, not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


class Canary:
    """Random bytes at a fixed address of this process, offered in the handshake so a
    reader can prove that the pid it was given is this process and it may read it."""

    def __init__(self) -> None:
        self.value = secrets.token_bytes(CANARY_BYTES)
        self._buffer = np.frombuffer(bytearray(self.value), dtype=np.uint8)

    def offer(self, memory: tuple[SharedRegion, ...] = (), handover: str = "",
              proof_addr: int = 0) -> HostReads | None:
        """The offer of this process, with the shared buffers a reader may map and where
        it takes them (:func:`~kvxfer.transfer.converted.mapped_reads.shared_offer`)."""
        host = host_identity()
        if host is None:
            return None
        return HostReads(host=host, pid=os.getpid(), canary_addr=self._buffer.ctypes.data,
                         canary=self.value, memory=memory, proof_addr=proof_addr,
                         handover=handover)


def check_offer(offer: HostReads | None) -> str | None:
    """None when this process can host-read the offering one, else why not."""
    if offer is None:
        return "the prefill does not offer host reads"
    if offer.host != host_identity():
        return "the prefill runs on another host or in another pid namespace"
    try:
        verify_canary(offer)
    except HostReadError as exc:
        return str(exc)
    return None


def verify_canary(offer: HostReads) -> None:
    """Raise :class:`HostReadError` unless process ``offer.pid`` holds the offer's canary:
    it is still the process that offered it (a pid of a process that ended may be
    reused), and this one may read it."""
    got = np.zeros(len(offer.canary), dtype=np.uint8)
    copy_vectors(offer.pid, np.array([[got.ctypes.data, got.nbytes]], dtype=np.uint64),
                 np.array([[offer.canary_addr, got.nbytes]], dtype=np.uint64))
    if got.tobytes() != offer.canary:
        raise HostReadError(f"pid {offer.pid} is not the prefill process (its canary differs)",
                            gone=True)


def copy_vectors(pid: int, local: np.ndarray, remote: np.ndarray, want: int | None = None
                 ) -> None:
    """One ``process_vm_readv`` of ``remote`` ranges of ``pid`` into ``local`` ranges
    (``[n, 2]`` uint64 (address, length) arrays, C order, at most IOV_MAX rows each,
    equal byte totals, ``want`` when the caller knows it); raises
    :class:`HostReadError` unless every byte was copied."""
    want = int(local[:, 1].sum()) if want is None else want
    got = _readv()(pid, local.ctypes.data, len(local), remote.ctypes.data, len(remote), 0)
    if got == want:
        return
    if got < 0:
        code = ctypes.get_errno()
        why = {errno_codes.EPERM: "not permitted (another user, or ptrace is restricted)",
               errno_codes.ESRCH: "no such process",
               errno_codes.EFAULT: "an address is not mapped"}.get(code, os.strerror(code))
        raise HostReadError(f"reading process {pid}: {why}",
                            gone=code in (errno_codes.ESRCH, errno_codes.EFAULT))
    raise HostReadError(f"reading process {pid}: copied {got} of {want} bytes (its memory "
                        f"is no longer mapped there)", gone=True)


@dataclass(frozen=True)
class Rows:
    """One side of a logical block's ranges: row ``i`` is ``length[i]`` bytes at
    ``off[i] + block_id * step[i]``."""

    off: np.ndarray
    step: np.ndarray
    length: np.ndarray

    def at(self, ids: np.ndarray) -> np.ndarray:
        """``[len(ids) * rows, 2]`` uint64 (address, length) iovecs, block by block."""
        addr = self.off[None] + np.asarray(ids, dtype=np.int64)[:, None] * self.step[None]
        out = np.empty((addr.size, 2), dtype=np.uint64)
        out[:, 0] = addr.reshape(-1)
        out[:, 1] = np.tile(self.length, len(addr))
        return out


@dataclass(frozen=True)
class HostRead:
    """One prefill rank's converted read as ranges per logical block: ``local`` and
    ``remote`` rows, two byte streams of equal length, cut into ``cuts`` (row bounds
    on each side, one pair per system call) of at most IOV_MAX rows each. Remote gaps
    of up to BRIDGE_BYTES between wanted ranges are read too, into ``sink``."""

    remote_rank: int
    offer: HostReads  # the prefill process, checked again after every copy
    local: Rows
    remote: Rows
    cuts: tuple[tuple[int, int], ...]  # (local row, remote row) bounds, first (0, 0)
    sink: np.ndarray
    runs: tuple[np.ndarray, ...]  # the wanted runs before bridging (see merged)

    @property
    def runs_per_block(self) -> int:
        return len(self.local.off)

    @property
    def bytes_per_block(self) -> int:
        """Bytes placed into the views."""
        return int(self.runs[4].sum())

    @property
    def read_per_block(self) -> int:
        """Bytes read from the prefill: those placed and the bridged gaps."""
        return int(self.remote.length.sum())

    def copy(self, local_ids: np.ndarray, remote_ids: np.ndarray,
             pool: Executor | None = None, threads: int = 1) -> tuple[int, int]:
        """Copy the request's ranges; (bytes placed, calls). With ``pool``, the blocks are
        cut into ``threads`` shares, all but the first copied there, the first here (the
        call releases the GIL); this returns once every share ended. Raises
        HostReadError."""
        bounds = np.linspace(0, len(local_ids), max(1, threads if pool else 1) + 1)
        shares = [(a, b) for a, b in itertools.pairwise(bounds.astype(int)) if b > a]

        def run(lo: int, hi: int) -> int:
            local, remote = self.local.at(local_ids[lo:hi]), self.remote.at(remote_ids[lo:hi])
            calls = self.copy_calls(hi - lo)
            wants = np.add.reduceat(local[:, 1], [c[0] for c in calls]).tolist()
            for (l0, l1, r0, r1), want in zip(calls, wants, strict=True):
                copy_vectors(self.offer.pid, local[l0:l1], remote[r0:r1], int(want))
            return len(calls)

        calls = sum(run_all([functools.partial(run, *share) for share in shares], pool))
        verify_canary(self.offer)  # the bytes came from the prefill, not a pid's new owner
        return len(local_ids) * self.bytes_per_block, calls

    def copy_calls(self, count: int) -> list[tuple[int, int, int, int]]:
        """(local rows, remote rows) bounds of each call for ``count`` blocks' rows."""
        nl, nr = len(self.local.off), len(self.remote.off)
        if len(self.cuts) == 2:  # a block fits one call: as many blocks as fit
            per = max(1, IOV_MAX // max(nl, nr))
            return [(b * nl, e * nl, b * nr, e * nr)
                    for b, e in ((b, min(b + per, count)) for b in range(0, count, per))]
        return [(b * nl + l0, b * nl + l1, b * nr + r0, b * nr + r1) for b in range(count)
                for (l0, r0), (l1, r1) in itertools.pairwise(self.cuts)]


def plan_host_read(plan: StagedRead, groups: Sequence[tuple[int, torch.Tensor]],
                   offer: HostReads, min_run_bytes: int = MIN_RUN_BYTES) -> HostRead | None:
    """``plan``'s ranges from the offering process into this rank's view ``groups``
    (:func:`kvxfer.plan.staging.layer_groups`), or None where host reads would not pay
    (elements of odd size, runs shorter than ``min_run_bytes`` on average) or where the
    two sides' logical block sizes differ."""
    if plan.local.block_size != plan.remote.block_size:
        return None  # a block's runs are not one template shifted by its id
    runs = _runs(plan, groups)
    if runs is None or runs[4].mean() < min_run_bytes:
        return None
    return _assembled(plan.remote_rank, offer, runs)


def merged(reads: Sequence[HostRead]) -> HostRead:
    """One read of several ranks' reads of one prefill rank (in-process TP ranks of one
    decode instance, the same block ids): their runs in prefill order, so that the
    heads one rank would skip are the next rank's, not a sink's."""
    runs = [np.concatenate([r.runs[i] for r in reads]) for i in range(5)]
    order = np.argsort(runs[0], kind="stable")
    return _assembled(reads[0].remote_rank, reads[0].offer, tuple(r[order] for r in runs))


def _assembled(remote_rank: int, offer: HostReads, runs: tuple[np.ndarray, ...]) -> HostRead:
    sink = np.zeros(BRIDGE_BYTES or 1, dtype=np.uint8)
    roff, rstep, loff, lstep, length = runs
    roff, rstep, loff, lstep, length = _bridged(roff, rstep, loff, lstep, length,
                                                sink.ctypes.data)
    cuts, lstart, rstart = _cut(roff, rstep, loff, lstep, length)
    local, remote = _rows(loff, lstep, length, lstart), _rows(roff, rstep, length, rstart)
    return HostRead(remote_rank, offer, local, remote, cuts, sink, runs)


def _runs(plan: StagedRead, groups: Sequence[tuple[int, torch.Tensor]]
          ) -> tuple[np.ndarray, ...] | None:
    """A logical block's runs (remote offset, remote step, local offset, local step,
    length; bytes), contiguous on both sides, in staged order; None for elements of odd
    size. Found by running the conversion on integer stand-ins: staging holds each staged
    element's index (8 bytes each), the views' stand-ins one logical block."""
    elem = groups[0][1].element_size()
    if 8 % elem:
        return None
    geo, r_out = plan.remote, plan.local.kernel_ratio
    stand_in = replace(plan, remote=replace(geo, chunk_len=geo.chunk_len * (8 // elem)))
    staged = torch.arange(plan.bytes_per_block // elem, dtype=torch.int64)
    targets = [(layer, torch.full((r_out, *g.shape[1:]), -1, dtype=torch.int64))
               for layer, g in groups]
    stand_in.convert(staged.view(torch.uint8), targets, torch.zeros(1, dtype=torch.int64),
                     geo.kv_packing, plan.local.kv_packing)
    source, local_off, local_step = [], [], []
    for (_, view), (_, target) in zip(groups, targets, strict=True):
        offsets = _element_offsets(target.shape, view.stride())
        placed = target >= 0
        source.append(target[placed].numpy())
        local_off.append(view.data_ptr() + offsets[placed].numpy() * elem)
        local_step.append(np.full(int(placed.sum()), r_out * view.stride(0) * elem))
    src = np.concatenate(source)
    order = np.argsort(src, kind="stable")
    src, loff = src[order], np.concatenate(local_off)[order]
    lstep = np.concatenate(local_step)[order]
    # where staged element s comes from (StagedRead.descriptors: kernel block, layer, chunk)
    elems = geo.chunk_len // elem
    chunk_of = src // elems
    chunk = np.asarray(plan.chunks, dtype=np.int64)[chunk_of % len(plan.chunks)]
    layer = (chunk_of // len(plan.chunks)) % geo.num_layers
    kernel = chunk_of // (len(plan.chunks) * geo.num_layers)
    stride = geo.block_stride[layer, chunk]
    roff = geo.base[layer, chunk] + kernel * stride + (src % elems) * elem
    rstep = geo.kernel_ratio * stride
    # a run goes on while both sides step by one element within one staged chunk
    same = (np.diff(src) == 1) & (np.diff(chunk_of) == 0) & (np.diff(loff) == elem) & \
        (np.diff(lstep) == 0)
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    length = np.diff(np.append(starts, len(src))) * elem
    return roff[starts], rstep[starts], loff[starts], lstep[starts], length.astype(np.int64)


def _bridged(roff: np.ndarray, rstep: np.ndarray, loff: np.ndarray, lstep: np.ndarray,
             length: np.ndarray, sink: int) -> tuple[np.ndarray, ...]:
    """The runs with every remote gap of at most BRIDGE_BYTES between neighbours (of one
    block's memory) filled by a run into ``sink``: one range more on the local side
    costs less than one more on the remote side, whose pages the kernel pins per range."""
    gap = roff[1:] - (roff[:-1] + length[:-1])
    fill = np.flatnonzero((gap > 0) & (gap <= BRIDGE_BYTES) & (rstep[1:] == rstep[:-1]))
    if len(fill) == 0:
        return roff, rstep, loff, lstep, length
    position = np.concatenate([np.arange(len(roff)) * 2, fill * 2 + 1])
    order = np.argsort(position, kind="stable")
    zeros = np.zeros(len(fill), dtype=np.int64)
    return (np.concatenate([roff, roff[fill] + length[fill]])[order],
            np.concatenate([rstep, rstep[fill]])[order],
            np.concatenate([loff, zeros + sink])[order],
            np.concatenate([lstep, zeros])[order],
            np.concatenate([length, gap[fill]])[order])


def _cut(roff: np.ndarray, rstep: np.ndarray, loff: np.ndarray, lstep: np.ndarray,
         length: np.ndarray) -> tuple[tuple[tuple[int, int], ...], np.ndarray, np.ndarray]:
    """Cut a block's runs into calls of at most IOV_MAX ranges a side, neighbours that
    touch joined on each side within a call; (row bounds per call, local and remote
    row starts per run)."""
    joins_l = np.concatenate([[False], (loff[:-1] + length[:-1] == loff[1:])
                              & (lstep[:-1] == lstep[1:])])
    joins_r = np.concatenate([[False], (roff[:-1] + length[:-1] == roff[1:])
                              & (rstep[:-1] == rstep[1:])])
    lstart, rstart = ~joins_l, ~joins_r
    calls, rows_l, rows_r = [0], 0, 0  # the first run of each call
    for run in range(len(length)):
        if run and (rows_l + lstart[run] > IOV_MAX or rows_r + rstart[run] > IOV_MAX):
            lstart[run] = rstart[run] = True  # a call starts a range on both sides
            calls.append(run)
            rows_l = rows_r = 0
        rows_l += int(lstart[run])
        rows_r += int(rstart[run])
    lrow, rrow = np.cumsum(lstart) - 1, np.cumsum(rstart) - 1
    bounds = [(int(lrow[run]), int(rrow[run])) for run in calls]
    bounds.append((int(lrow[-1]) + 1, int(rrow[-1]) + 1))
    return tuple(bounds), lstart, rstart


def _rows(off: np.ndarray, step: np.ndarray, length: np.ndarray, start: np.ndarray) -> Rows:
    """Runs joined into rows where ``start`` is False."""
    first = np.flatnonzero(start)
    return Rows(off[first], step[first], np.add.reduceat(length, first))


def _element_offsets(shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """The element offset of every index of ``shape`` under ``strides``."""
    offsets = torch.zeros(tuple(shape), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        view = [1] * len(shape)
        view[dim] = size
        offsets += torch.arange(size, dtype=torch.int64).view(view) * stride
    return offsets


# -- in-process TP ranks share one copy -------------------------------------------------

SHARES_PER_RANK = 2  # a meeting's blocks are cut into this many shares per member


@dataclass
class _Shares:
    """A closed meeting's copy: the merged read of its members' reads, cut into shares of
    its blocks that the members' threads take in turn."""

    read: HostRead
    shares: list[tuple[int, int]]
    taken: int = 0
    done: int = 0
    error: BaseException | None = None


class SharedCopies:
    """Where the in-process TP ranks of one decode instance meet to host-read one prefill
    rank for one request (:mod:`kvxfer.transfer.converted.siblings`). Alone, each rank would read
    the prefill's split pages whole (its heads into place, the others' into a sink); together,
    one merged copy writes every member's heads and its blocks are cut into shares that
    the members' threads take in turn, so the prefill's bytes are read once. Every rank
    that came copies shares until none is left and waits for the rest; a share that
    fails fails every member. Thread-safe; one per group of ranks that share their reads
    (:class:`~kvxfer.transfer.converted.process_shares.ProcessShares`).
    """

    def __init__(self) -> None:
        self.siblings: Siblings[HostRead] = Siblings()
        # merged reads by their parts' ids; the parts are kept, so no id is reused meanwhile
        self._merged: dict[tuple[int, ...], tuple[tuple[HostRead, ...], HostRead]] = {}

    def register(self, engine: str, prefill: str, prefill_rank: int, rank: int) -> None:
        """Decode rank ``rank`` of ``engine`` host-reads ``prefill_rank`` of ``prefill``."""
        self.siblings.register(engine, prefill, prefill_rank, rank)

    def unregister(self, engine: str, prefill: str, rank: int) -> None:
        self.siblings.unregister(engine, prefill, rank)
        with self.siblings.lock:
            self._merged.clear()

    def copy(self, engine: str, prefill: str, request: str, rank: int, read: HostRead,
             local_ids: np.ndarray, remote_ids: np.ndarray, pool: Executor | None = None,
             threads: int = 1) -> tuple[int, int, int]:
        """Copy this rank's part of ``request``, with its siblings where they come: (bytes
        placed for this rank, calls it made, ranks that copied together; 1: alone)."""
        count = len(local_ids)
        meeting = self.siblings.join((engine, prefill, request, read.remote_rank), rank,
                                     local_ids, remote_ids, read,
                                     lambda m: self._close(m, count))
        if meeting is None or len(meeting.joined) == 1:
            return (*read.copy(local_ids, remote_ids, pool, threads), 1)
        calls = self._take_shares(meeting, local_ids, remote_ids)
        return count * read.bytes_per_block, calls, len(meeting.joined)

    def _close(self, meeting: Meeting[HostRead], count: int) -> None:
        """Merge the members' reads and cut the shares (the siblings' lock is held)."""
        parts = tuple(meeting.joined[r] for r in sorted(meeting.joined))
        cached = self._merged.get(tuple(map(id, parts)))
        if cached is not None and all(a is b for a, b in zip(cached[0], parts, strict=True)):
            read = cached[1]
        elif len(parts) > 1:
            read = merged(parts)
            self._merged[tuple(map(id, parts))] = (parts, read)
        else:
            read = parts[0]
        pieces = min(count, SHARES_PER_RANK * len(parts))
        bounds = np.linspace(0, count, pieces + 1).astype(int)
        meeting.state = _Shares(read, [(a, b) for a, b in itertools.pairwise(bounds) if b > a])

    def _take_shares(self, meeting: Meeting[HostRead], local_ids: np.ndarray,
                     remote_ids: np.ndarray) -> int:
        """Copy shares until none is left, then wait for the others' (calls made here)."""
        work: _Shares = meeting.state
        calls = 0
        while True:
            with self.siblings.lock:
                if work.taken == len(work.shares) or work.error is not None:
                    meeting.cond.wait_for(lambda: work.done == work.taken)
                    if work.error is not None:
                        raise work.error
                    return calls
                lo, hi = work.shares[work.taken]
                work.taken += 1
            try:
                calls += work.read.copy(local_ids[lo:hi], remote_ids[lo:hi])[1]
            except BaseException as exc:
                with self.siblings.lock:
                    work.error = work.error or exc
            with self.siblings.lock:
                work.done += 1
                meeting.cond.notify_all()
