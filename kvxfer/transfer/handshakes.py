"""``Handshakes``: one rank's handshakes with other engines, each on a pool thread.

Shared by a decode rank's :class:`~kvxfer.transfer.peers.Peers` and a prefill rank's push
:class:`~kvxfer.transfer.pushes.targets.Targets`. The worker's thread starts, collects and
connects them (:meth:`Handshakes.start`, :meth:`Handshakes.finished`,
:meth:`Handshakes.connect`: NIXL is called there only); pool threads fetch and check
metadata. A failed engine is dead for :data:`DEAD_PEER_S`.

Design: docs/design/transfer-worker.md#handshakes
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from kvxfer.transfer.results import Tally, TransferError
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.transfer.side_channel.failures import failure_reason
from kvxfer.wire.metadata import AgentMetadata
from kvxfer.wire.protocol_errors import SideChannelError

log = logging.getLogger(__name__)

DEAD_PEER_S = 5.0         # after a failed handshake, connection or transfer, fail fast this long

T = TypeVar("T")
R = TypeVar("R")


class HandshakeFailed(TransferError):
    """An engine could not be handshaken or connected; ``label`` is the reason's word in
    :attr:`~kvxfer.transfer.results.WorkerCounts.handshake_failures`."""

    def __init__(self, message: str, label: str) -> None:
        super().__init__(message)
        self.label = label


class Handshakes(Generic[T]):
    """Handshakes in flight on a pool, finished ones, and engines dead for a moment.
    ``name`` names the pool's threads; ``wake`` is set when a
    handshake ends; ``tally`` counts the failures."""

    def __init__(self, name: str, wake: threading.Event, tally: Tally) -> None:
        self._wake, self._tally = wake, tally
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=name)
        self._shaking: dict[str, Future[T]] = {}
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._dead: dict[str, tuple[float, str]] = {}  # engine -> (until, why)

    def start(self, engine_id: str, address: str, job: Callable[[], T]) -> None:
        """Run ``job`` (the handshake with ``engine_id`` at ``address``) on a pool thread."""
        future = self._pool.submit(self._run, address, job)
        self._shaking[engine_id] = future

        def ended(_: Future[T]) -> None:
            self._ended.put(engine_id)
            self._wake.set()

        future.add_done_callback(ended)

    def finished(self) -> list[str]:
        """The engines whose handshake ended since the last call (worker thread);
        :meth:`connect` each next."""
        done: list[str] = []
        while True:
            try:
                engine = self._ended.get_nowait()
            except queue.Empty:
                return done
            if engine in self._shaking:
                done.append(engine)

    def connect(self, engine_id: str, connect: Callable[[T], R]) -> R:
        """Worker thread: ``connect`` (NIXL) with the ended handshake's value; raises
        :class:`HandshakeFailed` when the handshake failed or ``connect`` raised
        TransferError (counted "connect"): the engine is then dead for a moment."""
        future = self._shaking.pop(engine_id)
        try:
            shaken = future.result()
            try:
                connected = connect(shaken)
            except TransferError as exc:
                self._tally.handshake_failed("connect")
                raise HandshakeFailed(str(exc), "connect") from exc
        except HandshakeFailed as exc:
            self.mark_dead(engine_id, str(exc))
            raise
        self.revive(engine_id)
        return connected

    def dead(self, engine_id: str) -> str | None:
        """Why ``engine_id`` failed moments ago (within :data:`DEAD_PEER_S`), or None."""
        dead = self._dead.get(engine_id)
        return dead[1] if dead is not None and time.monotonic() < dead[0] else None

    def mark_dead(self, engine_id: str, reason: str) -> None:
        self._dead[engine_id] = (time.monotonic() + DEAD_PEER_S, reason)

    def revive(self, engine_id: str) -> None:
        """Forget a failure of ``engine_id``: the next request handshakes again."""
        self._dead.pop(engine_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, address: str, job: Callable[[], T]) -> T:
        """Pool thread: ``job``, its failure as a counted :class:`HandshakeFailed`."""
        try:
            return job()
        except SideChannelError as exc:
            failed = HandshakeFailed(str(exc), failure_reason(exc))
        except (TransferError, ValueError) as exc:  # answered, but not a peer we can use
            failed = HandshakeFailed(str(exc), "mismatch")
        except Exception as exc:  # unexpected: still answer the waiting requests
            log.exception("handshake with %s failed unexpectedly", address)
            failed = HandshakeFailed(f"{type(exc).__name__}: {exc}", "error")
        self._tally.handshake_failed(failed.label)
        raise failed


def fetch_ranks(client: SideChannelClient, host: str, ports: Mapping[int, Sequence[int]], *,
                engine_id: str, tp_size: int, timeout: float, retries: int,
                backends: Sequence[str], roles: tuple[str, str],
                named_by: str = "kv_transfer_params say") -> dict[int, AgentMetadata]:
    """The metadata of engine ``engine_id``'s ranks, by rank, fetched from the side channel
    at ``host`` on each port for the ranks it serves (``ports``: one, unless the ranks
    listen apart). Checks that each answer is that engine at TP ``tp_size`` and every
    rank shares a NIXL backend with ``backends``; TransferError says what differs.
    ``roles``: (the other engine's, this one's) and ``named_by`` (what named the engine's
    TP size), for the messages."""
    theirs, ours = roles
    metas: dict[int, AgentMetadata] = {}
    for port, served in ports.items():
        answer = client.fetch(host, port, served, timeout=timeout, retries=retries)
        if answer.engine_id != engine_id:
            raise TransferError(f"the side channel at port {port} belongs to engine "
                                f"{answer.engine_id!r}, not {engine_id!r}")
        if answer.tp_size != tp_size:
            raise TransferError(f"engine reports TP {answer.tp_size} but {named_by} "
                                f"tp_size={tp_size}")
        metas.update((m.tp_rank, m) for m in answer.ranks if m.tp_rank in served)
    missing = {rank for served in ports.values() for rank in served} - set(metas)
    if missing:
        raise TransferError(f"handshake answer lacks ranks {sorted(missing)}")
    for rank, meta in metas.items():
        if not set(meta.backends) & set(backends):
            raise TransferError(
                f"{theirs} rank {rank} runs NIXL backends {', '.join(meta.backends)} and "
                f"this {ours} {', '.join(backends)}: no backend in common; start both with "
                f"a shared --nixl-backends")
    return metas
