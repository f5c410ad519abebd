"""``PushDecode``: a decode's role for requests whose prompt KV a prefill WRITEs into blocks
reserved here (push mode).

:meth:`PushDecode.reserve` (``POST /v1/kv/reserve``) holds blocks for a prompt on every
rank as a lease under a fresh, unguessable reservation id, until every prefill rank
writing into it said "done" (or gave up), or its deadline plus
:data:`~kvxfer.wire.reservations.PUSH_GRACE_S`; the request of kind
:class:`~kvxfer.sidecar.request_kinds.PushIn` that names it parks in those blocks and
runs once every rank's lease ended "done" (anything else: recomputed or failed by the
failure policy). Engine-loop thread; the listener's thread only answers claims.

Invariant: a reserved block is never freed or reused while a rank's lease of its
reservation is held (an overdue one's blocks stay quarantined until its writers' WRITEs
ended). Design: docs/design/sidecar-roles.md#the-push-decode
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.sidecar.request_kinds import PushIn, first_logprob
from kvxfer.sidecar.roles.claimers import Claimers
from kvxfer.sidecar.roles.role import AbortOutcome, Role, RoleEvents
from kvxfer.transfer.leases import ReservationAnswers
from kvxfer.transfer.ranks import Answering
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.wire.reservations import PUSH_GRACE_S, Reservation

if TYPE_CHECKING:
    from kvxfer.engine import LLMEngine, Logprob, SamplingParams
    from kvxfer.sidecar.request_kinds import Submission
    from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
    from kvxfer.transfer.ranks import Ranks
    from kvxfer.transfer.results import Released
    from kvxfer.transfer.transfer_config import TransferConfig

log = logging.getLogger(__name__)

ENDED_KEPT = 4096  # reservations that ended unused, remembered to say so to a late request
WRITERS_CHECKED_EVERY_S = 0.5  # a held reservation asks this often whether a writer is gone


@dataclass
class _Reserved:
    """One reservation: its blocks, which ranks still hold it, and the request using it."""

    reservation: Reservation
    ranks_left: set[int]
    reasons: set[str] = field(default_factory=set)
    request_id: str | None = None  # the generation request that adopted the blocks
    attached: float = 0.0  # when it did (monotonic)
    aborted: bool = False
    cached: list[int] = field(default_factory=list)  # prefix-cache blocks, until adopted
    # n > 1: each further sample's blocks (and its cached tokens), nobody writes into them;
    # once adopted, the ids of the samples parked in them
    spare: list[tuple[list[int], int]] = field(default_factory=list)
    siblings: list[str] = field(default_factory=list)
    blocks: list[int] | None = None  # overdue: the quarantined blocks, held until it ends
    released: str = ""  # why the caller holding it said no request will use it
    writers_checked: float = 0.0  # when its writers were last asked after (monotonic)

    def unadopted(self) -> list[list[int]]:
        """Blocks it holds that no request adopted, and nobody writes into: one list per
        holder (the samples share cached blocks, each held once per sample)."""
        return [self.cached, *(blocks for blocks, _ in self.spare)]

    @property
    def landed(self) -> bool:
        return not self.ranks_left and self.reasons == {"done"}


class PushDecode(Role):
    """A decode's reservations and the requests pushed into them (see the module
    docstring); a reservation is valid for ``config.lease_ttl`` seconds."""

    kinds = (PushIn,)

    def __init__(self, engine: LLMEngine, ranks: Ranks, metrics: SidecarMetrics,
                 config: TransferConfig) -> None:
        self.engine, self.workers, self.metrics = engine, ranks.workers, metrics
        self.claimers = Claimers(SideChannelClient(ranks.engine_id, ranks.compat,
                                                   hmac_key=config.kv_key))
        self.answers = ReservationAnswers(ranks.workers, config.lease_ttl)
        self.engine_id, self._key = ranks.engine_id, config.kv_key
        self.host, self.port = "", 0  # the side channel prefills claim at (serving_at)
        self.ttl, self.failure_policy = config.lease_ttl, config.kv_load_failure_policy
        self._reserved: dict[str, _Reserved] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # ended unused: id -> why
        self._transfer_errors: dict[str, str] = {}
        # bytes of one reserved block on every rank, every layer: what a push writes into it
        self._block_bytes = engine.config.num_hidden_layers * sum(
            engine.cache_spec(rank).real_page_size_bytes for rank in range(engine.tp))

    def __len__(self) -> int:
        """Reservations held: written into, waiting for their request, or both."""
        return len(self._reserved)

    @property
    def answering(self) -> Answering:
        """The side channel's answers about reservations: writers' claims and reports."""
        return Answering(self.answers, owns=self._reserved.__contains__)

    def serving_at(self, host: str, port: int) -> None:
        """The side channel prefills reach this instance at (what reservations name)."""
        self.host, self.port = host, port

    def claimed_by(self, engine_id: str, side_channel: tuple[str, int]) -> None:
        self.claimers.heard(engine_id, side_channel)

    def gauges(self) -> dict[str, int]:
        return {"reservations": len(self._reserved),
                "quarantined_blocks": self.quarantined_blocks}


    @property
    def busy(self) -> bool:
        """Reservations a prefill may be writing into before their deadline."""
        return any(r.ranks_left and r.blocks is None for r in self._reserved.values())

    @property
    def quarantined_blocks(self) -> int:
        """Blocks of overdue reservations, out of use until their writers' WRITEs ended."""
        return sum(len(r.blocks) for r in self._reserved.values() if r.blocks is not None)

    def holds(self, reservation_id: str) -> bool:
        return reservation_id in self._reserved

    def reserve(self, prompt: list[int], n: int = 1) -> Reservation:
        """Blocks for ``prompt``'s KV past its cached prefix, held for a push, and for
        ``n - 1`` further samples that start from a copy of it (NoFreeBlocks when they
        are not free: nothing is held then)."""
        size = self.engine.block_size
        spare: list[tuple[list[int], int]] = []
        try:
            for _ in range(n - 1):
                hit, fresh = self.engine.reserve_blocks(prompt)
                spare.append(([*hit, *fresh], len(hit) * size))
            cached, blocks = self.engine.reserve_blocks(prompt)
        except Exception:
            for blocks, _ in spare:
                self.engine.free_blocks(blocks)
            raise
        reservation_id = f"resv-{secrets.token_urlsafe(16)}"
        expires_at = time.time() + self.ttl
        held: set[int] = set()
        try:
            for rank, worker in enumerate(self.workers):
                worker.hold(reservation_id, blocks, readers=None, ttl=self.ttl + PUSH_GRACE_S)
                held.add(rank)
        except Exception:
            for rank in held:
                self.workers[rank].end_lease(reservation_id, "abandoned")
            for blocks_of in (cached, *(bs for bs, _ in spare), blocks):  # never published:
                self.engine.free_blocks(blocks_of)  # nobody claimed or wrote into them
            raise
        reservation = Reservation(reservation_id, self.engine_id, self.host, self.port,
                                  self.engine.tp, tuple(blocks), size, len(prompt),
                                  expires_at, len(cached) * size).signed(self._key)
        self._reserved[reservation_id] = _Reserved(reservation, held, cached=cached,
                                                   spare=spare)
        return reservation

    def admit(self, submission: Submission) -> None:
        """Park the generation request in the blocks of the reservation it names, and its
        further samples in the blocks reserved for them; ValueError (a 400) for a
        reservation this decode does not hold, one used already, or one for another
        number of tokens or samples."""
        kind = submission.kind
        assert isinstance(kind, PushIn)
        request_id, prompt, params = submission.request_id, submission.prompt, submission.params
        reservation_id, first = kind.pushed.kv_reservation_id, first_logprob(kind.first_token)
        siblings = [(sample.request_id, sample.params) for sample in kind.samples]
        reserved = self._reserved.get(reservation_id)
        ended = self._ended.get(reservation_id)
        if reserved is not None and reserved.blocks is not None and \
                reserved.request_id is None:  # overdue before its request came
            reserved, ended = None, ("was claimed by a prefill that did not finish writing "
                                     "it in time (its blocks are quarantined)")
        elif reserved is not None and reserved.released:
            reserved, ended = None, f"was released: {reserved.released}"
        if reserved is None and ended is not None and self.failure_policy == "recompute":
            log.warning("request %s: its reservation %s %s; recomputing its prompt",
                        request_id, reservation_id, ended)
            self.metrics.recomputes.inc()
            for member, member_params in [(request_id, params), *siblings]:
                self.engine.add_request(member, prompt, member_params)
            return
        if reserved is None:
            raise ValueError(f"kv_transfer_params.kv_reservation_id {reservation_id!r} names "
                             f"no reservation of this decode: "
                             f"{ended or 'never made, or used already'}")
        if reserved.request_id is not None:
            raise ValueError(f"kv_reservation {reservation_id} is used by another request")
        if reserved.reservation.num_tokens != len(prompt) or \
                len(reserved.spare) != len(siblings):
            raise ValueError(f"kv_reservation {reservation_id} holds "
                             f"{reserved.reservation.num_tokens} tokens for "
                             f"{len(reserved.spare) + 1} samples but the request has "
                             f"{len(prompt)} for {len(siblings) + 1}")
        self._park(reserved, request_id, prompt, params, first, siblings)
        reserved.request_id = request_id
        reserved.attached = time.monotonic()
        if not reserved.ranks_left:
            self._resolve(reservation_id)

    def _park(self, reserved: _Reserved, request_id: str, prompt: list[int],
              params: SamplingParams, first: Logprob | None,
              siblings: Sequence[tuple[str, SamplingParams]]) -> None:
        """The samples first, in blocks nobody writes into: one that cannot be parked is
        aborted with its blocks (the writers' blocks stay the reservation's)."""
        parked: list[str] = []
        try:
            for (member, member_params), (blocks, cached) in zip(siblings, reserved.spare,
                                                                 strict=True):
                self.engine.add_awaiting_kv_in(member, prompt, member_params, blocks, cached)
                parked.append(member)
            self.engine.add_awaiting_kv_in(
                request_id, prompt, params, [*reserved.cached, *reserved.reservation.block_ids],
                reserved.reservation.cached_tokens, first=first)
        except Exception:
            for member in parked:
                self.engine.abort(member)
            del reserved.spare[:len(parked)]
            raise
        reserved.cached, reserved.spare, reserved.siblings = [], [], parked  # theirs now

    def lease_ended(self, rank: int, item: Released, events: RoleEvents) -> bool:
        """A rank's lease ended; False when ``item`` is no reservation of this decode."""
        reserved = self._reserved.get(item.request_id)
        if reserved is None:
            return False
        reserved.ranks_left.discard(rank)
        reserved.reasons.add(item.reason)
        if not reserved.ranks_left and reserved.released and reserved.request_id is None:
            self._give_back(item.request_id, reserved, f"was released ({reserved.released}) "
                                                       f"and its writers ended")
        elif not reserved.ranks_left and reserved.blocks is not None:
            del self._reserved[item.request_id]
            self.engine.free_blocks(reserved.blocks)
            log.info("reservation %s: its writers' WRITEs ended (%s): its %d quarantined "
                     "blocks are free", item.request_id, ", ".join(sorted(reserved.reasons)),
                     len(reserved.blocks))
        elif not reserved.ranks_left and reserved.request_id is not None:
            self._resolve(item.request_id)
        return True

    def poll(self, events: RoleEvents) -> None:
        """Give back the blocks of reservations no request came for, once over; set
        those of overdue ones aside."""
        now = time.time()
        for reservation_id, reserved in list(self._reserved.items()):
            if reserved.blocks is not None:
                self._check_claimer(reservation_id, reserved)
            elif now < reserved.reservation.expires_at + PUSH_GRACE_S:
                if reserved.ranks_left and (gone := self._writer_gone(reservation_id,
                                                                      reserved)):
                    self._overdue(reservation_id, reserved, gone)
            elif reserved.ranks_left:  # unclaimed ranks end at their own deadline
                if any(self.workers[rank].lease_claimer(reservation_id)
                       for rank in reserved.ranks_left):
                    left = sorted(reserved.ranks_left)
                    self._overdue(reservation_id, reserved, f"ranks {left} still held "
                                  f"{PUSH_GRACE_S:g} s after its deadline (a writer may "
                                  f"still be writing)")
            elif reserved.request_id is None:
                self._give_back(reservation_id, reserved,
                                f"ended unused at its deadline "
                                f"({', '.join(sorted(reserved.reasons))}), before its request "
                                f"came")

    def release(self, reservation: Reservation, why: str) -> bool:
        """The caller holding ``reservation`` (the proxy, whose prefill failed) says no
        request will use it: a rank no prefill claimed ends now, a claimed one once its
        writer's WRITEs ended, and then the blocks are free, long before the deadline.
        ValueError for another decode's reservation or, with a key, one it did not sign;
        whether it was held and unused."""
        if reservation.engine_id != self.engine_id:
            raise ValueError(f"kv_reservation {reservation.reservation_id} is decode "
                             f"{reservation.engine_id}'s, not this one's ({self.engine_id})")
        reservation.verify(self._key)
        reserved = self._reserved.get(reservation.reservation_id)
        if reserved is None or reserved.reservation != reservation or reserved.released \
                or reserved.request_id is not None or reserved.blocks is not None:
            return False
        reserved.released = why
        if not reserved.ranks_left:  # written already: nobody will end a lease of it
            self._give_back(reservation.reservation_id, reserved, f"was released ({why})")
        for rank in sorted(reserved.ranks_left):  # a claim may come as this runs: unended
            self.workers[rank].end_lease(reservation.reservation_id, "abandoned",
                                         claimers=(None,))
        return True

    def _give_back(self, reservation_id: str, reserved: _Reserved, why: str) -> None:
        """Free an unused reservation whose every lease ended."""
        del self._reserved[reservation_id]
        self.engine.free_blocks(reserved.reservation.block_ids)
        self._free_unadopted(reserved)
        self._end_unused(reservation_id, why)

    def _free_unadopted(self, reserved: _Reserved) -> None:
        for blocks in reserved.unadopted():
            self.engine.free_blocks(blocks)
        reserved.cached, reserved.spare = [], []

    def _end_unused(self, reservation_id: str, why: str) -> None:
        log.info("reservation %s %s", reservation_id, why)
        self._ended[reservation_id] = why
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    def _writer_gone(self, reservation_id: str, reserved: _Reserved) -> str | None:
        """Why a prefill that claimed a rank of ``reserved`` and has not said it finished
        is known gone (its "done" will never come), or None; asked at most every
        :data:`WRITERS_CHECKED_EVERY_S` per reservation."""
        now = time.monotonic()
        if now < reserved.writers_checked + WRITERS_CHECKED_EVERY_S:
            return None
        reserved.writers_checked = now
        for engine, gone in self._claimers_of(reservation_id, reserved).items():
            if gone is not None:
                return f"its writer {engine} {gone[0]}"
        return None

    def _claimers_of(self, reservation_id: str, reserved: _Reserved
                     ) -> dict[str, tuple[str, float] | None]:
        """The engines that claimed a rank ``reserved`` still holds, each with why and
        since when it is known gone (None: not known)."""
        claimed = {engine for rank in reserved.ranks_left
                   if (engine := self.workers[rank].lease_claimer(reservation_id))}
        return {engine: self.claimers.gone(engine) for engine in claimed}

    def _overdue(self, reservation_id: str, reserved: _Reserved, why: str) -> None:
        """A writer claimed ``reserved`` and has not said its WRITEs ended (``why``: past
        its deadline and the grace, or the writer is gone): its blocks leave every use
        until it does (or the stale limit, or the grace after the writer was shown gone); its
        request goes on without them."""
        request_id = reserved.request_id
        if request_id is None:
            self._free_unadopted(reserved)  # nobody writes into those
            reserved.blocks = list(reserved.reservation.block_ids)
            self._end_unused(reservation_id, "was claimed by a prefill that did not finish "
                                             "writing it in time (its blocks are quarantined)")
        else:
            reserved.blocks = self.engine.set_aside_blocks(request_id)
            reserved.reasons.add("overdue")
            self._resolve(reservation_id, keep=True)
        log.warning("reservation %s: %s: %d blocks quarantined until its WRITEs ended",
                    reservation_id, why, len(reserved.blocks))

    def _check_claimer(self, reservation_id: str, reserved: _Reserved) -> None:
        """An overdue reservation: end its leases once the grace passed since the prefill
        that claimed it was shown gone (its WRITEs ended with it)."""
        gone = self._claimers_of(reservation_id, reserved)
        known = [g for g in gone.values() if g is not None]
        if not gone or len(known) < len(gone) or \
                time.monotonic() < max(since for _, since in known) + PUSH_GRACE_S:
            return  # (a rank nobody claimed ends at its own deadline)
        log.warning("reservation %s: its writer %s; its quarantined blocks are freed",
                    reservation_id, "; ".join(why for why, _ in known))
        for rank in sorted(reserved.ranks_left):
            self.workers[rank].end_lease(reservation_id, "abandoned")

    def _resolve(self, reservation_id: str, keep: bool = False) -> None:
        """Every rank's lease of an adopted reservation ended (or, ``keep``, it is
        overdue and stays held, its blocks set aside): run its request, or recompute or
        fail it."""
        reserved = self._reserved[reservation_id] if keep else \
            self._reserved.pop(reservation_id)
        request_id = reserved.request_id
        assert request_id is not None
        group = [request_id, *reserved.siblings]
        if reserved.aborted:
            self.metrics.transfers.labels("aborted").inc()
            for member in group:
                self.engine.abort(member)
        elif reserved.landed:  # the transfer's time: what the request waited for it
            self.metrics.transfers.labels("ok").inc()
            self.metrics.transfer_seconds.observe(time.monotonic() - reserved.attached)
            self.metrics.transfer_bytes.inc(len(reserved.reservation.block_ids) *
                                            self._block_bytes)
            self.engine.finish_kv_load(request_id, ok=True)
            if reserved.siblings:
                self.engine.start_siblings(request_id, reserved.siblings)
                self.metrics.sibling_copies.inc(len(reserved.siblings))
        else:
            self.metrics.transfers.labels("failed").inc()
            self.metrics.transfer_failures.inc()
            why = (f"the push into reservation {reservation_id} ended "
                   f"{', '.join(sorted(reserved.reasons))}")
            if self.failure_policy == "recompute":
                log.warning("request %s: %s; recomputing its prompt", request_id, why)
                self.metrics.recomputes.inc()
                for member in group:
                    self.engine.finish_kv_load(member, ok=False, recompute=True)
            else:
                for member in group:
                    self._transfer_errors[member] = f"KV push failed: {why}"
                    self.engine.finish_kv_load(member, ok=False, recompute=False, reason=why)

    def transfer_error(self, request_id: str) -> str | None:
        return self._transfer_errors.pop(request_id, None)

    def abort(self, request_id: str) -> AbortOutcome | None:
        """Defer the abort of a request whose reservation is still held; NOT_MINE for a
        parked sample of one (the engine aborts it); None when ``request_id`` uses no
        reservation still held (the engine aborts it)."""
        for reserved in self._reserved.values():
            if reserved.request_id == request_id and reserved.blocks is None:
                reserved.aborted = True
                return AbortOutcome.DEFERRED
            if request_id in reserved.siblings:  # parked: the engine aborts it, and frees
                reserved.siblings.remove(request_id)
                return AbortOutcome.NOT_MINE
        return None

    def close(self) -> None:
        self._reserved.clear()
        self.claimers.close()
