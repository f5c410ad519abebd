"""What one rank's :class:`~kvxfer.transfer.worker.TransferWorker` reports to its caller.

Pure: the standard library and the wire types. :class:`PollResult` (reads that ended, with their
:class:`ReadStats` and each path's :class:`PathStats`), :class:`Released` (leases that
ended), :class:`WorkerCounts` (events only metrics care about, :class:`PathTraffic` among
them), :class:`TransferError`, and the two thread-safe boxes the worker's thread fills and
the caller's thread empties: :class:`ReadResults` and :class:`Tally`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

# how long a transfer given up in flight (a READ, or a WRITE) is waited for at most:
# longer than Linux keeps retransmitting on a connection whose peer stopped answering
# (tcp_retries2 = 15: about 15.4 minutes), after which nothing of it can land
STALE_LIMIT_S = 20 * 60.0

Span = tuple[float, float]
"""A READ as NIXL timed it: (posted, seen done), in seconds of the monotonic clock."""


def merge_spans(spans: Iterable[Span | None]) -> Span | None:
    """The span from the first post to the last completion of ``spans``; None when any
    is None (one READ NIXL did not time) or there is none."""
    listed = list(spans)
    known = [span for span in listed if span is not None]
    if not listed or len(known) < len(listed):
        return None
    return min(s for s, _ in known), max(e for _, e in known)


class TransferError(RuntimeError):
    """A read failed; the message names the peer and the reason."""


@dataclass(frozen=True)
class PathStats:
    """What one path of a read moved: ``path`` names it (:data:`kvxfer.transfer.routes.PATHS`),
    ``seconds`` run from its post until it landed (None: it never landed)."""

    path: str
    num_bytes: int
    seconds: float | None


@dataclass(frozen=True)
class ReadStats:
    """What one finished read moved, for metrics and the demo."""

    num_bytes: int
    descriptors: int
    seconds: float
    lanes: int = 1  # agents (threads) that copied it; see kvxfer.transfer.lanes
    # prefill ranks read on this host (kvxfer.transfer.converted.host_reads) instead of staging
    host_ranks: int = 0
    # in-process decode ranks that shared its converted reads, host or staged (1: alone)
    members: int = 0
    mapped_ranks: int = 0  # of host_ranks, those read from their mapped cache (mapped_reads)
    staged_ranks: int = 0  # prefill ranks read through staging (kvxfer.plan.staging)
    paths: tuple[PathStats, ...] = ()  # each path the read took, in posting order
    # from posting its paths (building and prepping NIXL's descriptor lists, signing its
    # notifications) until they were seen landed; ``seconds`` also holds the wait to be
    # posted (planning, staging space, a handshake)
    posted_seconds: float | None = None
    # where NIXL alone moved its bytes: NIXL's own timing (telemetry, xferDuration) from
    # inside its first post to the last completion seen, the span vLLM's NixlConnector
    # reports (bench vllm, 100 tokens: ~0.13 ms after the post began, ~0.15 ms before the
    # reader saw it); None for copies on this host and staged reads
    nixl_seconds: float | None = None

    @property
    def transfer_seconds(self) -> float:
        """Its transfer time: NIXL's telemetry where NIXL moved it (what NixlConnector
        reports), else from its post until it landed, else its whole time."""
        for seconds in (self.nixl_seconds, self.posted_seconds):
            if seconds is not None:
                return seconds
        return self.seconds

    @property
    def path_names(self) -> tuple[str, ...]:
        """The paths the read took, each once, in posting order."""
        return tuple(dict.fromkeys(p.path for p in self.paths))


@dataclass
class PollResult:
    """Reads that ended since the last :meth:`TransferWorker.poll`.

    ``unnotified`` holds the requests, failed or finished, whose prefill was neither told
    nor can be (its connection was dropped before it was known): the caller releases their
    leases over the side channel (the "done" reports of the others went out from the
    worker, next to their NIXL notifications). ``quarantined`` holds the failed
    requests whose READs were given up while in flight: their bytes may still land in the
    request's blocks (see :class:`~kvxfer.transfer.reads.path.Stale`), so the caller keeps
    those blocks from any other use until the request is named in ``settled``.
    """

    finished: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stats: dict[str, ReadStats] = field(default_factory=dict)
    unnotified: set[str] = field(default_factory=set)
    quarantined: set[str] = field(default_factory=set)
    settled: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.finished or self.failed or self.settled)


@dataclass(frozen=True)
class PathTraffic:
    """One decode rank's reads of one prefill engine over one path: bytes placed and the
    seconds its paths ran (post to landed; GB/s = bytes / seconds / 1e9), and ``ceiling``,
    the bytes per second the path's probe reached when the peer connected (None: not
    measured, :mod:`kvxfer.transfer.routes`)."""

    num_bytes: int = 0
    seconds: float = 0.0
    ceiling: float | None = None

    def __add__(self, other: PathTraffic) -> PathTraffic:
        return PathTraffic(self.num_bytes + other.num_bytes, self.seconds + other.seconds,
                           other.ceiling if other.ceiling is not None else self.ceiling)


@dataclass
class WorkerCounts:
    """Events since the last :meth:`TransferWorker.take_counts`, by reason (the labels of
    the sidecar's metrics, :mod:`kvxfer.sidecar.sidecar_metrics`), one per handshake or
    notification."""

    # decode: a handshake (after its retries) or the NIXL connection after it failed:
    # handshake.failure_reason's words, "mismatch" for a peer this rank cannot read, "connect"
    handshake_failures: Counter[str] = field(default_factory=Counter)
    # "unsent" (decode: NIXL refused to send it), "bad_signature" or "malformed" (prefill:
    # ignored, it did not verify or decode)
    notifications_failed: Counter[str] = field(default_factory=Counter)
    # prefill: a verified "done" for a lease not held, by how that lease had ended
    # ("done", "abandoned", "expired"), "unknown" when not remembered (or never held)
    notifications_late: Counter[str] = field(default_factory=Counter)
    # decode: by (prefill engine, path), what finished reads moved over it and the ceiling
    # the path reached when the peer connected
    paths: dict[tuple[str, str], PathTraffic] = field(default_factory=dict)


@dataclass(frozen=True)
class Released:
    request_id: str
    # "done" (every reader said so), "failed" (all said it, one or more that it gave up),
    # "abandoned" (end_lease: the decode will not read),
    # "cached" (released: the decode's prefix cache held it all) or "expired" (ran out)
    reason: str


class ReadResults:
    """Reads that ended, gathered on the worker's thread until the caller takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results = PollResult()
        self._ready = threading.Event()  # set when a read finished or failed

    def finished(self, request_id: str, stats: ReadStats, unnotified: bool) -> None:
        with self._lock:
            self._results.finished.append(request_id)
            self._results.stats[request_id] = stats
            self._end(request_id, unnotified)
        self._ready.set()

    def failed(self, request_id: str, reason: str, unnotified: bool,
               quarantined: bool = False) -> None:
        with self._lock:
            self._results.failed[request_id] = reason
            if quarantined:
                self._results.quarantined.add(request_id)
            self._end(request_id, unnotified)
        self._ready.set()

    def settled(self, request_id: str) -> None:
        """A quarantined read's READs all ended: its blocks are safe to use again."""
        with self._lock:
            self._results.settled.append(request_id)
        self._ready.set()

    def _end(self, request_id: str, unnotified: bool) -> None:
        if unnotified:
            self._results.unnotified.add(request_id)

    def take(self) -> PollResult:
        """Everything since the last call (any thread)."""
        with self._lock:
            out, self._results = self._results, PollResult()
            self._ready.clear()
        return out

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until a read ended since the last :meth:`take`."""
        return self._ready.wait(timeout)


class Tally:
    """:class:`WorkerCounts` counted from any thread, taken by the caller's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = WorkerCounts()

    def handshake_failed(self, reason: str) -> None:
        with self._lock:
            self._counts.handshake_failures[reason] += 1

    def notifications_failed(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self._counts.notifications_failed[reason] += count

    def notification_late(self, ended: str) -> None:
        with self._lock:
            self._counts.notifications_late[ended] += 1

    def path_used(self, engine: str, path: str, traffic: PathTraffic) -> None:
        """Prefill ``engine`` was connected over ``path`` (a ceiling), or read (bytes)."""
        with self._lock:
            paths = self._counts.paths
            paths[engine, path] = paths.get((engine, path), PathTraffic()) + traffic

    def take(self) -> WorkerCounts:
        with self._lock:
            out, self._counts = self._counts, WorkerCounts()
        return out
