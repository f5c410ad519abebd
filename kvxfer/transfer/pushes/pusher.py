"""``Pusher``: one prefill rank's pushes, WRITEs of requests' KV into decode reservations.

:meth:`Pusher.start`, :meth:`Pusher.layers` and :meth:`Pusher.seal` may be called from any
thread (the worker queues them); :meth:`Pusher.step` runs on the worker's thread. Block ids
are logical blocks of this rank's cache, in token order. A push holds its blocks as lease
``lease_id`` and ends it itself: "done" once every decode rank was told ``ok``, else "failed";
the caller frees the blocks when it ended. Invariant: a failed push tells the decode
``ok=False`` only once none of its WRITEs is in flight.

Design: docs/design/push.md#the-pusher
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.plan.descriptors import RankDescriptors
from kvxfer.plan.pushes import check_layers
from kvxfer.transfer.converted.staging_pool import Staging
from kvxfer.transfer.handshakes import HandshakeFailed
from kvxfer.transfer.leases import LeaseTable
from kvxfer.transfer.local_rank import LocalRank
from kvxfer.transfer.nixl_agent import in_flight, release_transfers
from kvxfer.transfer.pushes.targets import Target, Targets
from kvxfer.transfer.results import STALE_LIMIT_S, TransferError
from kvxfer.transfer.side_channel.reports import Reports
from kvxfer.wire.messages import DoneReport
from kvxfer.wire.notification import ReadDone, encode_notif
from kvxfer.wire.reservations import PUSH_GRACE_S, Reservation, ReservationError

log = logging.getLogger(__name__)


class PushFailed(TransferError):
    """A push cannot go on; the message names the decode and the reason."""


LEASE_MARGIN_S = 1.0  # a push's lease outlives its reservation's deadline by this much
SHADOW_GRANULE = 4 << 20  # a converted push's shadows are allocated in multiples of this


@dataclass
class _Push:
    """One request's push: what is handed and not yet posted, what is in flight."""

    lease_id: str
    reservation: Reservation
    block_ids: np.ndarray  # this rank's logical blocks holding the tokens it writes
    offset: int  # tokens of the first of them that the decode holds already (cached)
    handed: list[range] = field(default_factory=list)  # layers handed, not posted yet
    posted: set[int] = field(default_factory=set)  # layers posted
    sealed: bool = False
    claimed: bool = False  # the decode granted this prefill its claim of the reservation
    # per decode rank: WRITEs in flight, and the last rows posted (the "done" repeats one)
    inflight: dict[int, list[Any]] = field(default_factory=dict)
    last_rows: dict[int, RankDescriptors] = field(default_factory=dict)
    # per decode rank whose "done" is posted: what it was told (reported again, see _report)
    told: dict[int, ReadDone] = field(default_factory=dict)
    # per decode rank converted into (ConvertedPush): the shadow its WRITEs read, taken
    # from the rank's staging pool before the first, given back at the end
    shadows: dict[int, Staging] | None = None
    failed: str | None = None  # why it failed: it waits for its WRITEs, then tells
    landed: dict[int, int] = field(default_factory=dict)  # per rank: WRITEs seen DONE, in
    # order (the first ones of ``inflight``: each step asks only about the others)

    def polled(self, now: float) -> bool:
        """Whether the worker must progress it without being woken: a WRITE in flight,
        or it is sealed or failed (it finishes). Between two layers, or while its claim
        is on its way, it waits (the engine's hand, the claim's answer wake the worker),
        and it does not poll: a forward pass on a CPU shares its cores with the worker
        thread. Past its deadline it only waits for stale WRITEs: not polled either."""
        if now >= self.reservation.expires_at:
            return False
        return self.sealed or self.failed is not None or any(
            self.landed.get(rank, 0) < len(ts) for rank, ts in self.inflight.items())

    @property
    def engine(self) -> str:
        return self.reservation.engine_id


Command = Callable[[], None]


class Pusher:
    """One prefill rank's pushes in flight, stepped on the worker's thread; ``leases`` is
    the rank's lease table (a push holds and
    ends its lease there)."""

    def __init__(self, local: LocalRank, targets: Targets, leases: LeaseTable,
                 num_layers: int, reports: Reports) -> None:
        self._local, self._targets, self._leases = local, targets, leases
        self._num_layers = num_layers
        self._reports = reports  # the instance's sender of side-channel "done" reports
        self._closed = False
        self._pushes: dict[str, _Push] = {}
        self._waiting: dict[str, list[_Push]] = {}  # by decode engine: parked on a handshake
        self._queued: queue.SimpleQueue[Command] = queue.SimpleQueue()

    @property
    def busy(self) -> bool:
        now = time.time()
        return any(push.polled(now) for push in self._pushes.values())

    @property
    def holding(self) -> int:
        """Leases of the rank's table that are pushes' own and within the deadline they
        were held with (:meth:`LeaseTable.awaited` counts them): no reader's notification
        is awaited for them."""
        now = time.time()
        return sum(now < push.reservation.expires_at + LEASE_MARGIN_S and
                   self._leases.holds(push.lease_id) for push in self._pushes.values())

    # -- any thread ------------------------------------------------------------------------
    def start(self, lease_id: str, reservation: Reservation, block_ids: np.ndarray,
              answers_at: tuple[str, int] = ("", 0)) -> None:
        """Hold the lease now (ValueError when ``lease_id`` holds one), push later; the
        claim names ``answers_at``, this instance's side channel."""
        ttl = max(reservation.expires_at - time.time(), 0.0) + LEASE_MARGIN_S
        self._leases.hold(lease_id, block_ids.tolist(), None, ttl)
        self._submit(lambda: self._start(lease_id, reservation, block_ids, answers_at))

    def layers(self, lease_id: str, layers: range) -> None:
        self._submit(lambda: self._hand(lease_id, layers))

    def seal(self, lease_id: str, ok: bool = True) -> None:
        self._submit(lambda: self._seal(lease_id, ok))

    def _submit(self, command: Command) -> None:
        self._queued.put(command)
        self._local.wake.set()

    # -- worker thread ---------------------------------------------------------------------
    def step(self) -> None:
        for reservation in self._targets.finished():
            self._connected(reservation)
        while True:
            try:
                command = self._queued.get_nowait()
            except queue.Empty:
                break
            command()
        now = time.time()
        for push in list(self._pushes.values()):
            if now >= push.reservation.expires_at + STALE_LIMIT_S:
                self._cut_off(push, f"its WRITEs were still in flight {STALE_LIMIT_S:g} s "
                                    f"after the reservation's deadline")
                continue
            if now >= push.reservation.expires_at and push.failed is None:
                self._fail(push, f"the reservation expired before the push finished "
                                 f"({len(push.posted)} of {self._num_layers} layers posted)")
                continue
            try:
                self._progress(push)
            except Exception as exc:  # a WRITE or a decode failed: this push only
                self._fail(push, str(exc))

    def close(self) -> None:
        """The worker is closing: cut every push off."""
        for push in list(self._pushes.values()):
            self._cut_off(push, f"prefill rank {self._local.rank} is closing")
        self._targets.close()
        self._closed = True  # no report from now on (one of a push cut off above still goes)

    def _start(self, lease_id: str, reservation: Reservation, block_ids: np.ndarray,
               answers_at: tuple[str, int]) -> None:
        try:
            reservation.check(self._local.key)
            size = self._local.geometry.block_size
            need = -(-reservation.num_tokens // size)
            if len(block_ids) < need:
                raise PushFailed(f"this prefill holds {len(block_ids)} blocks of the request, "
                                 f"{need} needed for the reservation's "
                                 f"{reservation.num_tokens} tokens")
        except (ReservationError, PushFailed) as exc:  # nothing to tell anyone
            log.warning("push of request %s refused: %s", lease_id, exc)
            self._leases.end(lease_id, "failed")
            return
        # the decode's cached prefix is written by nobody: the WRITEs start after it
        skip, offset = divmod(reservation.cached_tokens, size)
        push = _Push(lease_id, reservation, block_ids[skip:need], offset)
        self._pushes[lease_id] = push
        self._targets.claim(reservation, answers_at, lambda refused: self._submit(
            lambda: self._claimed(lease_id, refused)))
        if self._targets.get(push.engine) is not None:
            return
        dead = self._targets.dead(push.engine)
        if dead is not None:
            self._fail(push, f"{dead} (failed moments ago; not retried yet)")
            return
        self._waiting.setdefault(push.engine, []).append(push)
        if not self._targets.shaking(push.engine):
            self._targets.shake(reservation)

    def _connected(self, reservation: Reservation) -> None:
        """A decode's handshake ended: its parked pushes go on, or fail with it."""
        parked = self._waiting.pop(reservation.engine_id, [])
        try:
            self._targets.connect(reservation)
        except HandshakeFailed as exc:
            for push in parked:
                self._fail(push, str(exc))

    def _claimed(self, lease_id: str, refused: str | None) -> None:
        """The decode answered the claim of ``lease_id``'s reservation (``refused``: why
        not, or why no answer came)."""
        push = self._pushes.get(lease_id)
        if push is None or push.failed is not None:
            return
        if refused is not None:
            self._fail(push, f"decode {push.engine} did not grant the claim of reservation "
                             f"{push.reservation.reservation_id}: {refused}")
        else:
            push.claimed = True

    def _hand(self, lease_id: str, layers: range) -> None:
        push = self._pushes.get(lease_id)
        if push is None or push.failed is not None:
            return  # refused or failed (the caller learns it from the lease's end)
        try:
            check_layers(layers, self._num_layers)
            if push.posted.intersection(layers) or \
                    any(set(h).intersection(layers) for h in push.handed):
                raise ValueError(f"layers {layers.start}..{layers.stop - 1} handed twice")
        except ValueError as exc:
            self._fail(push, str(exc))
            return
        push.handed.append(layers)

    def _seal(self, lease_id: str, ok: bool) -> None:
        push = self._pushes.get(lease_id)
        if push is None or push.failed is not None:
            return  # refused or failed: its lease ends (or ended) with it
        if not ok:
            self._fail(push, "the prefill gave the request up")
            return
        push.sealed = True
        rest = sorted(set(range(self._num_layers)) - push.posted -
                      {layer for h in push.handed for layer in h})
        push.handed.extend(range(start, stop) for start, stop in _runs(rest))

    def _progress(self, push: _Push) -> None:
        if push.failed is not None:
            self._drain(push)
            return
        target = self._targets.get(push.engine)
        if target is None:
            if self._targets.shaking(push.engine):
                return
            raise PushFailed(f"the connection to decode {push.engine} ended (another push "
                             f"into it failed)")
        if target.refused is not None:
            raise PushFailed(f"decode {push.engine} at {target.address}: {target.refused}")
        if not self._leases.holds(push.lease_id):
            raise PushFailed("its lease ended before the push finished (its blocks may be "
                             "another request's now)")
        if not push.claimed:
            return  # nothing is written into a reservation the decode does not know claimed
        if push.handed and not self._take_shadows(push, target):
            return  # the staging pool is full: a push that ends gives some back, and wakes
        while push.handed:
            self._post(push, target, push.handed.pop(0))
        for rank in target.plans:
            transfers = push.inflight.get(rank, [])
            try:
                done = push.landed.get(rank, 0)
                while done < len(transfers) and transfers[done].state() == "DONE":
                    done += 1
                push.landed[rank] = done
                landed = done == len(transfers)
            except Exception as exc:
                self._targets.forget_dead(push.engine, str(exc))
                raise PushFailed(f"decode {push.engine} at {target.address} rank {rank}: "
                                 f"WRITE failed: {exc}") from exc
            if landed and push.sealed and rank not in push.told:
                release_transfers(transfers, push.lease_id)
                self._tell(push, target, rank)
        if push.sealed and push.told.keys() >= set(target.writers) and \
                all(_settled(ts) for ts in push.inflight.values()):
            self._end(push, "done")

    def _take_shadows(self, push: _Push, target: Target) -> bool:
        """Whether ``push`` holds a shadow for each decode rank it converts into (taken at
        once, all or none; raises StagingTooSmall where they never fit)."""
        if push.shadows is None:
            count = len(push.reservation.block_ids)
            needs = {rank: plan.shadow_bytes(count) for rank, plan in target.plans.items()}
            needs = {rank: need for rank, need in needs.items() if need}
            taken = self._local.staging.buffers(list(needs.values()), SHADOW_GRANULE) \
                if needs else []
            if taken is None:
                return False
            push.shadows = dict(zip(needs, taken, strict=True))
        return True

    def _post(self, push: _Push, target: Target, layers: range) -> None:
        shadows = push.shadows or {}
        for rank, plan in target.plans.items():
            shadow = shadows.get(rank)
            rows = plan.build(push.block_ids, push.reservation.block_ids, layers, push.offset,
                              None if shadow is None else shadow.buffer)
            if not len(rows):
                continue
            push.inflight.setdefault(rank, []).append(self._write(push, target, rank, rows))
            push.last_rows[rank] = rows
        push.posted.update(layers)

    def _write(self, push: _Push, target: Target, rank: int, rows: RankDescriptors,
               notif: bytes = b"") -> Any:
        try:
            return self._local.agent.write(target.agents[rank], rows.local, rows.remote, notif,
                                           local_is_cuda=self._local.is_cuda,
                                           remote_is_cuda=target.cuda[rank])
        except Exception as exc:
            raise PushFailed(f"decode {push.engine} at {target.address} rank {rank}: WRITE "
                             f"could not be posted: {exc}") from exc

    def _tell(self, push: _Push, target: Target, rank: int, ok: bool = True) -> None:
        """Post decode rank ``rank``'s "done": on a WRITE of its last rows' first row where
        there was one (delivered after its bytes), else, and for ``ok=False``, as a bare
        notification."""
        note = ReadDone(push.reservation.reservation_id, self._local.engine_id,
                        self._local.rank, target.writers[rank], ok)
        done = encode_notif(note, self._local.key)
        push.told[rank] = note
        rows = push.last_rows.get(rank)
        if rows is None or not ok:
            self._local.agent.send_notif(target.agents[rank], done)
            return
        first = RankDescriptors(rank, rows.local[:1], rows.remote[:1])
        push.inflight[rank] = [self._write(push, target, rank, first, done)]

    def _fail(self, push: _Push, reason: str) -> None:
        """``push`` failed: post nothing more; its WRITEs are waited for (:meth:`_drain`)."""
        if push.failed is None:
            log.warning("push of request %s into decode %s failed: %s", push.lease_id,
                        push.engine, reason)
            push.failed = reason
            push.handed.clear()
            parked = self._waiting.get(push.engine, [])
            if push in parked:
                parked.remove(push)
        self._drain(push)

    def _drain(self, push: _Push) -> None:
        """A failed push whose WRITEs all completed or failed tells each decode rank it
        gave up, then ends its lease "failed"."""
        if not all(_settled(ts) for ts in push.inflight.values()) or \
                self._targets.shaking(push.engine):
            return  # (a decode still handshaking is told once connected)
        self._tell_gave_up(push, "failed")
        self._end(push, "failed")

    def _cut_off(self, push: _Push, reason: str) -> None:
        """The stale limit past the reservation's deadline passed (or the worker closes):
        release what is in flight; tell only the decode ranks none of whose WRITEs may
        still land."""
        if push.failed is None:
            log.warning("push of request %s into decode %s cut off: %s", push.lease_id,
                        push.engine, reason)
        self._tell_gave_up(push, "cut-off")
        parked = self._waiting.get(push.engine, [])
        if push in parked:
            parked.remove(push)
        self._end(push, "failed")

    def _tell_gave_up(self, push: _Push, which: str) -> None:
        """Tell each decode rank none of whose WRITEs may still land that the push gave
        up (one that fails to hear it frees at its own deadline)."""
        target = self._targets.get(push.engine)
        if target is None:
            return
        for rank in target.writers:
            if _settled(push.inflight.get(rank, [])):
                try:
                    self._tell(push, target, rank, ok=False)
                except Exception as exc:
                    log.info("telling decode %s rank %d of the %s push failed: %s",
                             push.engine, rank, which, exc)

    def _end(self, push: _Push, reason: str) -> None:
        try:
            self._report(push)
        except Exception as exc:  # best effort: the lease ends all the same
            log.warning("could not report the end of push %s to decode %s: %s",
                        push.lease_id, push.engine, exc)
        settled = all(_settled(ts) for ts in push.inflight.values())
        for transfers in push.inflight.values():
            release_transfers(transfers, push.lease_id)
        if push.shadows:  # a WRITE cut off may still read one: held till the decode drops
            self._local.staging.give(list(push.shadows.values()),
                                     None if settled else push.engine)
            push.shadows = None
            self._local.wake.set()  # a push waiting for room goes on
        if self._pushes.get(push.lease_id) is push:
            del self._pushes[push.lease_id]
        if not self._leases.end(push.lease_id, reason) and reason == "done":
            log.warning("push of %s finished, but its lease had ended", push.lease_id)


    def _report(self, push: _Push) -> None:
        """Send each decode rank what its NIXL notification told it once more, over its
        side channel (:class:`Reports`: resent while unanswered until the reservation's
        deadline and grace, when the decode would end it anyway), so that a lost
        notification costs the decode no deadline; the decode counts the copy that comes
        second as nothing. None once the rank closed. Only to a rank every
        WRITE of which completed: NIXL completes a WRITE once its endpoint was flushed,
        its bytes placed, while one that failed may still land over TCP (a cut link), and
        only the notification, behind it on the same connection, comes after it then."""
        if self._closed:
            return
        reservation = push.reservation
        ends = time.monotonic() + reservation.expires_at + PUSH_GRACE_S - time.time()
        for rank, note in push.told.items():
            if _completed(push.inflight.get(rank, [])):
                self._reports.done(reservation.host, reservation.port, DoneReport(rank, note),
                                   ends)


def _completed(transfers: list[Any]) -> bool:
    """Whether every WRITE of ``transfers`` completed (none failed or is in flight)."""
    try:
        return all(transfer.state() == "DONE" for transfer in transfers)
    except Exception:  # a failed one
        return False


def _settled(transfers: list[Any]) -> bool:
    """Whether no WRITE of ``transfers`` can still land: each completed or failed."""
    return not in_flight(transfers)


def _runs(layers: list[int]) -> list[tuple[int, int]]:
    """Sorted ``layers`` as (start, stop) runs of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs
