"""``Peers``: the prefill engines one decode rank reads from, handshaken and connected.

Threading: the reader asks and connects on the worker's thread (:meth:`Peers.get`,
:meth:`Peers.shake`, :meth:`Peers.finished`, :meth:`Peers.connect`: every NIXL call); a pool
thread fetches metadata and plans (no NIXL); any thread may :meth:`Peers.forget`. A failed
peer is dead for :data:`DEAD_PEER_S`. A dropped peer's agents stay loaded while READs of it
given up in flight have not settled (:meth:`Peers.hold`, :meth:`Peers.unhold`).

Design: docs/design/transfer-worker.md#peers
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvxfer.plan.descriptors import PeerReadPlan, SideGeometry
from kvxfer.plan.staging import StagedRead, plan_reads
from kvxfer.plan.topology import notify_plan, read_plan
from kvxfer.transfer.converted.host_reads import HostRead
from kvxfer.transfer.converted.mapped_reads import MappedRead
from kvxfer.transfer.handshakes import DEAD_PEER_S, HandshakeFailed, Handshakes, fetch_ranks
from kvxfer.transfer.local_rank import LocalRank, memory_kind
from kvxfer.transfer.results import PathTraffic, TransferError
from kvxfer.transfer.routes import Route, candidates, choose
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.wire.messages import DoneReport
from kvxfer.wire.metadata import AgentMetadata
from kvxfer.wire.notification import ReadDone, encode_notif
from kvxfer.wire.params import RemoteParams

__all__ = ["DEAD_PEER_S", "Handshake", "HandshakeFailed", "Peer", "Peers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Handshake:
    """A peer's checked metadata, precomputed read plans and each read prefill rank's
    candidate routes, before NIXL connects."""

    metas: dict[int, AgentMetadata]
    plans: list[PeerReadPlan | StagedRead]
    notify: dict[int, int]  # prefill rank -> decode ranks that read from it
    options: dict[int, tuple[Route, ...]]


@dataclass
class Peer:
    """A handshaken prefill engine as seen by this decode rank."""

    engine_id: str
    address: str
    tp_size: int
    agents: dict[int, str]
    plans: list[PeerReadPlan | StagedRead]
    expected_readers: dict[int, int]
    remote_cuda: dict[int, bool] = field(default_factory=dict)  # each rank's memory kind
    # the path each read prefill rank is read over (kvxfer.transfer.routes)
    routes: dict[int, Route] = field(default_factory=dict)
    shared: set[int] = field(default_factory=set)  # staged ranks read with sibling ranks

    @property
    def host(self) -> dict[int, HostRead | MappedRead]:
        """The ranks copied on this host (host-read or from their mapped cache), by rank."""
        return {rank: route.copy for rank, route in self.routes.items()
                if route.copy is not None}

    def staged(self) -> list[StagedRead]:
        """The converted reads that go through staging (not copied on this host)."""
        return [route.plan for route in self.routes.values()
                if route.path == "staged" and isinstance(route.plan, StagedRead)]

    def done(self, local: LocalRank, lease_id: str, rank: int, ok: bool) -> bytes:
        """The signed "done" notification for prefill rank ``rank``: ``local`` read
        lease ``lease_id`` (``ok``) or gave up on it."""
        return encode_notif(self._read_done(local, lease_id, rank, ok), local.key)

    def reports(self, local: LocalRank, lease_id: str, ok: bool) -> tuple[DoneReport, ...]:
        """The same "done" for every prefill rank ``local`` reads, as side-channel
        reports: the caller sends them, acknowledged, so that a lost notification (or a
        read no READ told) still ends the lease."""
        return tuple(DoneReport(rank, self._read_done(local, lease_id, rank, ok))
                     for rank in sorted(self.agents))

    def _read_done(self, local: LocalRank, lease_id: str, rank: int, ok: bool) -> ReadDone:
        return ReadDone(request_id=lease_id, reader_engine_id=local.engine_id,
                        reader_rank=local.rank, expected_readers=self.expected_readers[rank],
                        ok=ok)

    def tell(self, local: LocalRank, lease_id: str, ranks: Sequence[int], ok: bool) -> bool:
        """Send "done" to prefill ``ranks`` (those not told by a READ, or all when a read
        failed); whether every notification was handed to NIXL."""
        sent = True
        for rank in ranks:
            try:
                local.agent.send_notif(self.agents[rank], self.done(local, lease_id, rank, ok))
            except Exception as exc:
                sent = False
                local.tally.notifications_failed("unsent")
                log.info("could not notify prefill %s rank %d: %s", self.engine_id, rank, exc)
        return sent


class Peers:
    """The prefill engines this decode rank reads from: handshakes, connections, plans,
    routes and dead peers. ``total_kv_heads`` and both instances' TP sizes say which
    heads this rank reads from which prefill rank; ``host_reads`` whether a prefill on
    this host may be copied from (mapped, host-read) instead of read over NIXL."""

    def __init__(self, local: LocalRank, client: SideChannelClient, *, total_kv_heads: int,
                 host_reads: bool) -> None:
        self._local, self._client = local, client
        self.total_kv_heads = total_kv_heads
        self.host_reads = host_reads
        self._peers: dict[str, Peer] = {}
        self._shakes: Handshakes[Handshake] = Handshakes(f"kvxfer-handshake-r{local.rank}",
                                                         local.wake, local.tally)
        self._shaking: dict[str, RemoteParams] = {}  # the params that started each handshake
        self._lock = threading.Lock()
        self._forget: set[str] = set()
        self._holds: Counter[str] = Counter()  # by engine: its stale reads not settled
        self._unremoved: dict[str, set[str]] = {}  # by engine: agents dropped while held

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._peers

    def get(self, engine_id: str) -> Peer | None:
        return self._peers.get(engine_id)

    def dead(self, engine_id: str) -> str | None:
        """Why ``engine_id`` failed moments ago (within :data:`DEAD_PEER_S`), or None."""
        return self._shakes.dead(engine_id)

    def shake(self, remote: RemoteParams) -> None:
        """Start handshaking with ``remote``'s engine on a pool thread (once: the caller
        parks later reads of it until :meth:`finished` names it)."""
        self._shaking[remote.remote_engine_id] = remote
        self._shakes.start(remote.remote_engine_id, remote.address,
                           lambda: self._plan(remote))

    def finished(self) -> list[RemoteParams]:
        """The remotes whose handshake ended since the last call (worker thread); each
        is :meth:`connect`-ed next."""
        return [self._shaking[engine] for engine in self._shakes.finished()]

    def connect(self, remote: RemoteParams) -> Peer:
        """Worker thread: the peer whose handshake ended, connected; raises
        :class:`HandshakeFailed` (the engine is then dead for a moment)."""
        del self._shaking[remote.remote_engine_id]
        return self._shakes.connect(remote.remote_engine_id,
                                    lambda shake: self._connect(remote, shake))

    def forget_dead(self, engine_id: str, reason: str) -> None:
        """A READ of ``engine_id`` failed: drop it and fail fast for a moment before
        handshaking again."""
        self.drop(engine_id)
        self._shakes.mark_dead(engine_id, reason)

    def forget(self, engine_id: str) -> None:
        """Any thread: drop ``engine_id``'s cached handshake or failure at the next
        :meth:`drop_forgotten`."""
        with self._lock:
            self._forget.add(engine_id)

    def drop_forgotten(self) -> None:
        """Worker thread: drop the engines :meth:`forget` named."""
        with self._lock:
            forget, self._forget = self._forget, set()
        for engine_id in forget:
            self.drop(engine_id)
            self._shakes.revive(engine_id)

    def drop(self, engine_id: str) -> None:
        """Worker thread: remove ``engine_id``'s agents and end what was shared of it."""
        peer = self._peers.pop(engine_id, None)
        local = self._local
        local.shares.leave(local.engine_id, engine_id, local.rank)
        if peer is not None:
            for name in peer.agents.values():
                self._quietly_remove(engine_id, name)
        if not self._holds[engine_id]:
            local.staging.drop_held(engine_id)

    def hold(self, engine_id: str) -> None:
        """Worker thread: a read of ``engine_id`` was given up with READs in flight; its
        agents and held staging stay until as many :meth:`unhold` calls (a reconnect
        loads the same agents again, which NIXL takes as it is)."""
        self._holds[engine_id] += 1

    def unhold(self, engine_id: str) -> None:
        """Worker thread: one held read's READs settled (landed, failed, or past the
        reader's ceiling); after the last, do what dropping the engine put off."""
        self._holds[engine_id] -= 1
        if self._holds[engine_id] > 0:
            return
        del self._holds[engine_id]
        names = self._unremoved.pop(engine_id, set())
        peer = self._peers.get(engine_id)
        for name in names - set(peer.agents.values() if peer is not None else ()):
            self._quietly_remove(engine_id, name)
        if peer is None:
            self._local.staging.drop_held(engine_id)

    def close(self) -> None:
        """End every share with sibling ranks and stop the handshakes."""
        for engine_id in list(self._peers):
            self._local.shares.leave(self._local.engine_id, engine_id, self._local.rank)
        self._shakes.close()

    # -- pool thread: handshake and plan, no NIXL ------------------------------------------
    def _plan(self, remote: RemoteParams) -> Handshake:
        """Handshake with ``remote``'s engine and plan the reads."""
        local = self._local
        slices = read_plan(local.rank, local.tp_size, remote.tp_size, self.total_kv_heads)
        notify = notify_plan(local.rank, local.tp_size, remote.tp_size, self.total_kv_heads)
        metas = fetch_ranks(self._client, remote.remote_host,
                            remote.side_channels(tuple(sorted(notify))),
                            engine_id=remote.remote_engine_id, tp_size=remote.tp_size,
                            timeout=local.deadlines.handshake_timeout,
                            retries=local.deadlines.handshake_retries,
                            backends=local.agent.backends, roles=("prefill", "decode"))
        geometries = {rank: SideGeometry.from_plan(meta.plan, meta.kv_packing)
                      for rank, meta in metas.items()}
        # a host cache converts reads cut at every block (staging and mapped caches are
        # host memory)
        plans = plan_reads(local.geometry, geometries, slices, local_tp=local.tp_size,
                           remote_tp=remote.tp_size, convert_cut=not local.is_cuda)
        staged = [p for p in plans if isinstance(p, StagedRead)]
        if staged and any(m.is_cuda for m in local.plan.memory):
            raise TransferError(f"decode layout {local.geometry.layout} and prefill layout "
                                f"{staged[0].remote.layout} need a converted read, which only "
                                f"host (CPU) caches support so far")
        options = candidates(local, plans, metas, geometries, slices, on_host=self.host_reads)
        for plan in staged:
            if options[plan.remote_rank][0].path != "staged":
                continue
            log.info("rank %d reads prefill %s rank %d through staging (%s -> %s): %d bytes "
                     "per block", local.rank, remote.remote_engine_id, plan.remote_rank,
                     plan.remote.layout, local.geometry.layout, plan.bytes_per_block)
        return Handshake(metas, plans, notify, options)

    # -- worker thread: NIXL ---------------------------------------------------------------
    def _connect(self, remote: RemoteParams, shake: Handshake) -> Peer:
        """Load the peer's agents and warm each connection; TransferError when NIXL
        cannot."""
        local = self._local
        # the kind each rank's READs name for its side (sent in the handshake's plan)
        kinds = {rank: memory_kind(shake.metas[rank].plan.memory, f"prefill rank {rank}")
                 for rank in shake.notify}
        agents: dict[int, str] = {}
        rank = -1
        try:
            for rank in sorted(shake.notify):
                meta = shake.metas[rank]
                agents[rank] = local.agent.add_remote(meta.agent_blob)
                local.agent.connect(agents[rank], probe=meta.plan.memory[0])
                if local.lanes is not None:
                    local.lanes.connect(meta.agent_blob, agents[rank], meta.plan.memory[0])
        except Exception as exc:
            for name in agents.values():
                self._quietly_remove(remote.remote_engine_id, name)
            raise TransferError(f"NIXL could not connect to rank {rank}: {exc}") from exc
        routes = self._choose(remote, shake, agents)
        peer = Peer(remote.remote_engine_id, remote.address, remote.tp_size, agents,
                    shake.plans, shake.notify, kinds, routes)
        self._peers[peer.engine_id] = peer
        # in-process siblings share host reads, and the staged reads of pages that hold
        # every head
        peer.shared = {plan.remote_rank for plan in peer.staged()
                       if not plan.remote.heads_contiguous}
        local.shares.join(local.engine_id, peer.engine_id, local.rank,
                          [r for r, runs in peer.host.items() if isinstance(runs, HostRead)],
                          sorted(peer.shared))
        log.info("rank %d connected to %s at %s (ranks %s)", local.rank, peer.engine_id,
                 peer.address, sorted(agents))
        return peer

    def _choose(self, remote: RemoteParams, shake: Handshake, agents: dict[int, str]
                ) -> dict[int, Route]:
        """Each read prefill rank's route, from a probe of its candidates (connected)."""
        local, routes = self._local, {}
        for rank, options in sorted(shake.options.items()):
            route, rates = choose(local, options, agents[rank], shake.metas[rank].plan.memory[0])
            routes[rank] = route
            local.tally.path_used(remote.remote_engine_id, route.path,
                                  PathTraffic(ceiling=route.ceiling))
            probed = ", ".join(f"{path} {rate / 1e9:.2f} GB/s" for path, rate in rates.items())
            log.info("rank %d reads prefill %s rank %d over %s (probed at connect: %s)",
                     local.rank, remote.remote_engine_id, rank, route.path,
                     probed or "not probed")
        return routes

    def _quietly_remove(self, engine_id: str, name: str) -> None:
        """Remove agent ``name`` of ``engine_id``, unless a stale read of it is held."""
        if self._holds[engine_id]:
            self._unremoved.setdefault(engine_id, set()).add(name)
            return
        self._local.agent.drop_remote(name)
        if self._local.lanes is not None:
            self._local.lanes.remove(name)
