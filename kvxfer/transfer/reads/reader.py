"""``Reader``: one decode rank's reads, from queued to reported.

:meth:`Reader.submit` from any thread; :meth:`Reader.step` on the worker's thread, every turn
(peers, posting, progress, finishing, telling liveness what is in flight). Every failure ends
in :meth:`Reader._fail`. READs given up in flight are kept until they settle (or
:data:`~kvxfer.transfer.results.STALE_LIMIT_S`): the failure is reported *quarantined* at
once where they land in the read's blocks, and *settled* after.

Design: docs/design/reads.md#the-readers-turn
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

from kvxfer.plan.descriptors import PeerReadPlan, build_requests_descriptors
from kvxfer.plan.span_probe import span_descriptors
from kvxfer.plan.staging import StagedRead
from kvxfer.transfer.converted.host_reads import HostRead
from kvxfer.transfer.converted.mapped_reads import MappedRead
from kvxfer.transfer.local_rank import LocalRank
from kvxfer.transfer.peers import HandshakeFailed, Peer, Peers
from kvxfer.transfer.reads.direct import DirectPath
from kvxfer.transfer.reads.host import HostPath, MappedPath
from kvxfer.transfer.reads.over_lanes import LanesPath
from kvxfer.transfer.reads.path import LANDED, ReadFailed, ReadPath, Stale, Waiting
from kvxfer.transfer.reads.read import Read
from kvxfer.transfer.reads.staged import StagedPath
from kvxfer.transfer.results import STALE_LIMIT_S, PathTraffic, ReadResults, TransferError
from kvxfer.transfer.side_channel.reports import Reports

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """A failed read's READs that were still in flight, waited for until ``until``."""

    request_id: str
    engine: str
    stales: list[Stale]
    until: float

    @property
    def blocks(self) -> bool:
        return any(stale.blocks for stale in self.stales)


class Reader:
    """One decode rank's reads: queued, parked behind handshakes or staging, in flight,
    stale; a read may take ``local.deadlines.read_timeout`` seconds
    once posted (or wait that long for staging before it is), less when its peer falls
    silent (``local.deadlines.liveness``)."""

    def __init__(self, local: LocalRank, peers: Peers, results: ReadResults,
                 reports: Reports) -> None:
        self._local, self._peers, self._results = local, peers, results
        self._reports = reports
        self.inflight: list[Read] = []
        self.staging_wait: list[tuple[Read, Peer]] = []  # converted reads short of staging
        self._queued: queue.SimpleQueue[Read] = queue.SimpleQueue()
        self._handshaking: dict[str, list[Read]] = {}  # by engine: reads parked on it
        self.held: list[_Held] = []  # failed reads whose READs may still land

    @property
    def read_timeout(self) -> float:
        return self._local.deadlines.read_timeout

    def submit(self, read: Read) -> None:
        """Any thread: queue ``read`` for the worker's thread."""
        self._queued.put(read)
        self._local.wake.set()

    @property
    def busy(self) -> bool:
        """Reads in flight: the worker's thread should turn quickly."""
        return bool(self.inflight)

    def step(self) -> None:
        """Worker thread: one turn: drop forgotten peers, connect handshaken ones, retry
        reads waiting for staging, route new reads, progress and finish, tell liveness,
        settle stale READs."""
        self._peers.drop_forgotten()
        self._connect_handshaken()
        if self.staging_wait:
            self._retry_staged()
        while True:
            try:
                read = self._queued.get_nowait()
            except queue.Empty:
                break
            self._begin(read)
        self._progress()
        self._watch()
        if self.held:
            self._settle()

    def close(self) -> None:
        """The worker is closing (its thread stopped): abandon every read, so that
        siblings stop waiting for this rank's shares and writing into its views."""
        reason = f"decode rank {self._local.rank} is closing"
        for read in [*self.inflight, *(read for read, _ in self.staging_wait)]:
            for path in read.paths:
                stale = path.abandon(reason)
                if stale is not None:  # the agents close next: nothing lands after that
                    stale.release()
        for held in self.held:
            for stale in held.stales:
                stale.release()
        self.held.clear()

    # -- routing ---------------------------------------------------------------------------
    def _begin(self, read: Read) -> None:
        """Post a new read, park it behind a running handshake, or start one."""
        peer = self._peers.get(read.engine)
        if peer is not None:
            self._post(read, peer)
            return
        dead = self._peers.dead(read.engine)
        if dead is not None:
            self._fail(read, ReadFailed(f"prefill {read.engine} at {read.remote.address}: "
                                        f"{dead} (failed moments ago; not retried yet)",
                                        notify=False))
            return
        waiting = self._handshaking.get(read.engine)
        if waiting is not None:
            waiting.append(read)
            return
        self._handshaking[read.engine] = [read]
        self._peers.shake(read.remote)

    def _connect_handshaken(self) -> None:
        """Connect NIXL to the handshaken peers, then post their parked reads."""
        for remote in self._peers.finished():
            reads = self._handshaking.pop(remote.remote_engine_id, [])
            try:
                peer = self._peers.connect(remote)
            except HandshakeFailed as exc:
                for read in reads:
                    self._fail(read, ReadFailed(f"prefill {remote.remote_engine_id} at "
                                                f"{remote.address}: {exc}", notify=False))
                continue
            for read in reads:
                self._post(read, peer)

    # -- posting ---------------------------------------------------------------------------
    def _post(self, read: Read, peer: Peer, *, retried: bool = False) -> None:
        """Plan the read's paths (once), reserve and post them. A converted read queues
        behind those already waiting for staging, unless it is one of them (``retried``)."""
        if self.staging_wait and not retried and peer.staged():
            self.staging_wait.append((read, peer))
            return
        try:
            if not read.paths:
                read.paths = paths_for(self._local, peer, read)
            # only staging may be short; nothing is taken then (see _retry_staged)
            reserved = all(path.reserve() for path in read.paths)
        except Exception as exc:  # bad params or plans, or NIXL refusing a staging buffer
            self._fail(read, ReadFailed(f"prefill {peer.engine_id} at {peer.address}: {exc}"))
            return
        if not reserved:
            self.staging_wait.append((read, peer))
            return
        read.posted = time.monotonic()  # the read timeout counts from here
        self.inflight.append(read)
        self._watch()  # heartbeats from now: a path may copy for a while in its post
        try:
            for path in read.paths:
                path.start()
        except ReadFailed as failure:
            self.inflight.remove(read)
            self._fail(read, failure)

    def _retry_staged(self) -> None:
        """Post converted reads that waited for staging, oldest first; fail those that
        waited past the read timeout, or whose peer was dropped meanwhile."""
        waiting, self.staging_wait = self.staging_wait, []
        now = time.monotonic()
        for read, peer in waiting:
            if now > read.deadline(self.read_timeout).at:
                self._fail(read, ReadFailed(f"prefill {peer.engine_id} at {peer.address}: no "
                                            f"staging space for the converted read within "
                                            f"{self.read_timeout:.0f} s"))
            elif self._peers.get(peer.engine_id) is not peer:
                self._fail(read, ReadFailed(f"prefill {peer.engine_id} at {peer.address}: the "
                                            f"connection ended while the read waited for "
                                            f"staging space", notify=False))
            else:
                self._post(read, peer, retried=True)

    # -- in flight -------------------------------------------------------------------------
    def _progress(self) -> None:
        """Finish the reads whose paths all landed; fail those that failed or are past
        their deadline."""
        now = time.monotonic()
        for read in list(self.inflight):
            try:
                outcome = read.progress()
                if isinstance(outcome, Waiting):
                    failure = read.overdue(outcome, self.read_timeout,
                                           self._local.deadlines.liveness, now)
                    if failure is not None:
                        raise failure
            except ReadFailed as failure:
                self.inflight.remove(read)
                self._fail(read, failure)
                continue
            if outcome is LANDED:
                self.inflight.remove(read)
                # seen landed now, not at the pass's start: a READ NIXL saw complete
                # within read.progress() ended after that (its own span would be longer)
                self._finish(read, time.monotonic())

    def _watch(self) -> None:
        """Heartbeats go to the side channels of the reads in flight (none: no more)."""
        liveness = self._local.deadlines.liveness
        if liveness is not None:
            liveness.watch(self, {channel for read in self.inflight
                                  for channel in read.side_channels}, time.monotonic())

    def _finish(self, read: Read, now: float) -> None:
        """Every path landed: give back what they hold, count what each moved (metrics),
        tell the prefill ranks no READ told, send the side-channel "done" reports, and
        report the read."""
        for path in read.paths:
            path.finish()
            self._local.tally.path_used(read.engine, path.name,
                                        PathTraffic(path.num_bytes, path.seconds or 0.0))
        peer = self._peers.get(read.engine)
        if peer is None:  # dropped meanwhile: ranks read through staging or on this host
            # were not told with a READ, and nobody can be now: the caller releases
            self._results.finished(read.request_id, read.stats(now),
                                   unnotified=any(not path.notifies for path in read.paths))
            return
        told = read.told  # ranks nobody reads still hold the blocks: tell them too
        peer.tell(self._local, read.lease_id,
                  [rank for rank in peer.agents if rank not in told], ok=True)
        self._report(read, peer, ok=True)
        self._results.finished(read.request_id, read.stats(now), unnotified=False)

    def _fail(self, read: Read, failure: ReadFailed) -> None:
        """Fail one read, the one failure path: abandon its paths, tell its prefill ranks
        where possible, keep its stale READs, take a peer at fault for dead."""
        # siblings fail too, and nothing is placed here any more; READs still in flight
        # are held until they settle
        stales = [stale for path in read.paths
                  if (stale := path.abandon(str(failure))) is not None]
        held = None
        if stales:
            held = _Held(read.request_id, read.engine, stales,
                         time.monotonic() + STALE_LIMIT_S)
            self.held.append(held)
            self._peers.hold(read.engine)
        quarantined = held is not None and held.blocks
        log.warning("read for request %s failed%s: %s", read.request_id,
                    " (its blocks may still be written: quarantined)" if quarantined else "",
                    failure)
        peer = self._peers.get(read.engine)
        if peer is None:
            self._results.failed(read.request_id, str(failure), unnotified=True,
                                 quarantined=quarantined)
        else:
            if failure.notify:
                peer.tell(self._local, read.lease_id, list(peer.agents), ok=False)
            self._report(read, peer, ok=False)
            self._results.failed(read.request_id, str(failure), unnotified=False,
                                 quarantined=quarantined)
        if failure.peer_gone is not None and peer is not None:
            self._peers.forget_dead(read.engine, failure.peer_gone)

    def _report(self, read: Read, peer: Peer, ok: bool) -> None:
        """Send each prefill rank read the same "done" as its notification once more, over
        the side channel serving it (acknowledged: a lost notification, or a rank no
        READ told, still ends the lease)."""
        host = read.remote.remote_host
        for report in peer.reports(self._local, read.lease_id, ok):
            for port in read.remote.side_channels([report.prefill_rank]):
                self._reports.done(host, port, report, read.lease_ends)

    def _settle(self) -> None:
        """Release the held reads whose READs all ended (or that reached the stale limit)."""
        now = time.monotonic()
        for held in list(self.held):
            if now < held.until and not all(stale.settled() for stale in held.stales):
                continue
            if now >= held.until:
                log.warning("read for request %s: READs given up %.0f s ago still did not "
                            "end; nothing of them can land any more, releasing them",
                            held.request_id, STALE_LIMIT_S)
            else:
                log.info("read for request %s: the READs given up in flight ended",
                         held.request_id)
            self.held.remove(held)
            for stale in held.stales:
                stale.release()
            self._peers.unhold(held.engine)
            if held.blocks:
                self._results.settled(held.request_id)


def paths_for(local: LocalRank, peer: Peer, read: Read) -> list[ReadPath]:
    """The paths ``peer``'s routes call for (:mod:`kvxfer.transfer.routes`: one per prefill
    rank), in the order they are posted: copies on this host, then read lanes or staging,
    then direct READs. Raises TransferError when the read's params disagree with the peer,
    ValueError for block ids out of range."""
    remote = read.remote
    if peer.tp_size != remote.tp_size:
        raise TransferError(f"engine reports TP {peer.tp_size} but kv_transfer_params "
                            f"say tp_size={remote.tp_size}")
    # the ids were counted at this size: a cache of another one would be misread
    for plan in peer.plans[:1]:
        said, cache = remote.remote_block_size, plan.remote.block_size
        if (said or plan.local.block_size) != cache:
            raise TransferError(
                f"its cache has {cache}-token blocks but kv_transfer_params "
                + (f"say remote_block_size={said}" if said else
                   f"do not say remote_block_size, so the ids were counted at this "
                   f"decode's {plan.local.block_size}"))
    local_ids, remote_ids = read.local_block_ids, remote.remote_block_ids
    if read.span_probe:  # each rank's bytes as whole spans from where the request starts
        return [_span_probe_path(local, peer, read)]
    routes = [peer.routes[plan.remote_rank] for plan in peer.plans]
    direct = [r.plan for r in routes if r.path == "nixl" and isinstance(r.plan, PeerReadPlan)]
    descs = build_requests_descriptors(direct, local_ids, remote_ids) if direct else []
    host = [(r.copy, *r.plan.ids(local_ids, remote_ids)) for r in routes
            if isinstance(r.copy, HostRead) and isinstance(r.plan, StagedRead)]
    # a mapped copy orders the ids as its copy plan does (a direct rank's too)
    mapped = [(r.copy, *r.copy.plan.ids(local_ids, remote_ids)) for r in routes
              if isinstance(r.copy, MappedRead)]
    staged_reads = [(r.plan, *r.plan.ids(local_ids, remote_ids)) for r in routes
                    if r.path == "staged" and isinstance(r.plan, StagedRead)]
    paths: list[ReadPath] = []
    if host:
        paths.append(HostPath(local, peer, read, host))
    if mapped:
        paths.append(MappedPath(local, peer, read, mapped))
    staged = StagedPath(local, peer, read, staged_reads) if staged_reads else None
    if staged is not None:
        paths.append(staged)
    if local.lanes is not None and not (staged and staged.has_parts) and \
            local.lanes.pay_for(sum(len(d) for d in descs)):
        paths.append(LanesPath(local, local.lanes, peer, read, descs))
    elif descs:
        paths.append(DirectPath(local, peer, read, descs))
    return paths


def _span_probe_path(local: LocalRank, peer: Peer, read: Read) -> DirectPath:
    """A benchmark's span probe: the same bytes as the direct READs, as one READ of
    whole memory spans per prefill rank (:mod:`kvxfer.plan.span_probe`), whatever the routes."""
    direct = [p for p in peer.plans if isinstance(p, PeerReadPlan)]
    if len(direct) != len(peer.plans):
        raise TransferError("a span probe needs a peer read by direct READs only")
    descs = build_requests_descriptors(direct, read.local_block_ids,
                                       read.remote.remote_block_ids)
    return DirectPath(local, peer, read, [
        span_descriptors(plan.local, plan.remote, rank.num_bytes, plan.remote_rank,
                            local_start=int(rank.local[:, 0].min()),
                            remote_start=int(rank.remote[:, 0].min()))
        for plan, rank in zip(direct, descs, strict=True) if len(rank)])
