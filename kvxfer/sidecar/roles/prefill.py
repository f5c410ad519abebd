"""``PrefillSide``: a prefill's role: leases out (pull) and pushes out (push).

A request of kind :class:`~kvxfer.sidecar.request_kinds.LeaseOut` is computed and its
blocks are leased to the decode that reads them; one of kind
:class:`~kvxfer.sidecar.request_kinds.PushOut` is WRITten into a decode's reservation as
it is computed (:class:`~kvxfer.sidecar.roles.pushes_out.PushesOut`). Either way the
blocks stay held under a lease id on every rank, and are freed once every rank ended
that lease. Engine-loop thread, except :meth:`PrefillSide.release_handed_out` and the
listener's answers. Design: docs/design/sidecar-roles.md#the-prefill-side
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvxfer.sidecar.request_kinds import LeaseOut, PushOut
from kvxfer.sidecar.roles.pushes_out import PushesOut
from kvxfer.sidecar.roles.role import AbortOutcome, Role, RoleEvents
from kvxfer.transfer.leases import LeaseAnswers
from kvxfer.transfer.ranks import Answering
from kvxfer.wire.reservations import RESERVATION_ID_KEY
from kvxfer.wire.tickets import TICKET_KEY, LeaseClaims, sign_ticket, verify_ticket

if TYPE_CHECKING:
    from kvxfer.engine import LLMEngine, Logprob, RequestOutput
    from kvxfer.sidecar.request_kinds import Kind, Submission
    from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
    from kvxfer.transfer.ranks import Ranks
    from kvxfer.transfer.results import Released
    from kvxfer.transfer.transfer_config import TransferConfig
    from kvxfer.wire.params import RemoteParams

log = logging.getLogger(__name__)

PARAMS_HOLDER = "params-holder"  # who releases through release_handed_out (no decode engine)


@dataclass
class _Held:
    """A request whose blocks some ranks still hold under a lease (pulled or pushed)."""

    request_id: str
    ranks_left: set[int]
    reasons: set[str] = field(default_factory=set)


class PrefillSide(Role):
    """Leases out and pushes out the prompts it computes (see the module docstring)."""

    kinds = (LeaseOut, PushOut)

    def __init__(self, engine: LLMEngine, ranks: Ranks, metrics: SidecarMetrics,
                 config: TransferConfig) -> None:
        self.engine, self.ranks, self.metrics, self.config = engine, ranks, metrics, config
        self.answers = LeaseAnswers(ranks.workers, ttl=config.lease_ttl, max_age=config.max_age)
        self.pushes = PushesOut(ranks.workers, config.kv_key)
        engine.layer_hook = self.pushes.on_layer
        self._held: dict[str, _Held] = {}  # by lease id
        self._lease_of: dict[str, str] = {}  # request id -> lease id
        self._at: tuple[str, int] = ("", 0)  # the side channel decodes reach this one at

    @property
    def answering(self) -> Answering:
        """The side channel's answers about the leases this side handed out."""
        return Answering(self.answers, owns=self._held.__contains__)

    def serving_at(self, host: str, port: int) -> None:
        """The side channel peers reach this instance at (what lease params and pushes'
        claims name)."""
        self._at = self.pushes.answers_at = (host, port)

    # -- admission and ends -----------------------------------------------------------------
    def admit(self, submission: Submission) -> None:
        kind = submission.kind
        if isinstance(kind, PushOut):  # refused before the prompt is computed for nothing
            self.pushes.check(kind.reservation)
        self.engine.add_held_request(submission.request_id, submission.prompt,
                                     submission.params)
        if isinstance(kind, PushOut):
            self.pushes.expect(submission.request_id, kind.reservation)

    def finished(self, output: RequestOutput, kind: Kind) -> dict[str, Any] | None:
        """A held request ended: its blocks are leased out or their push sealed (the
        answer's params); one that did not finish normally gives up its push."""
        request_id = output.request_id
        if output.finish_reason not in ("stop", "length"):
            if isinstance(kind, PushOut):
                self.pushes.give_up(request_id)
            return None
        # the first token, when it is the only one (a decode continues from it)
        first = output.logprobs[0] if len(output.token_ids) == 1 and \
            len(output.logprobs) == 1 else None
        if isinstance(kind, PushOut):
            lease_id = self.pushes.seal(request_id, output.block_ids)
            self._add(lease_id, _Held(request_id, set(range(len(self.ranks.workers)))))
            return {"do_remote_decode": False, "do_remote_prefill": True,
                    RESERVATION_ID_KEY: kind.reservation.reservation_id,
                    **_first_token(first)}
        return self._lease_out(request_id, output.block_ids, output.num_prompt_tokens, first)

    def _lease_out(self, request_id: str, block_ids: list[int], num_prompt_tokens: int,
                   first: Logprob | None) -> dict[str, Any]:
        """Lease a finished request's blocks on every rank: the ``kv_transfer_params`` a
        decode reads them with. ``remote_block_ids`` are the prompt's blocks; the lease id
        (``remote_request_id``) is 128 random bits: unique, so a late or repeated "done"
        for an ended lease can never release a new one, and unguessable, so nobody can
        name a lease they were not handed. With a key, ``lease_ticket`` signs the params
        (:mod:`kvxfer.wire.tickets`)."""
        ttl = self.config.lease_ttl
        lease_id = secrets.token_urlsafe(16)
        expires_at = time.time() + ttl  # before hold: never later than enforced
        holding: set[int] = set()
        try:
            for rank, worker in enumerate(self.ranks.workers):
                worker.hold(lease_id, block_ids, readers=None, ttl=ttl)
                holding.add(rank)
        except Exception:
            # Ranks that hold a lease free it at expiry; without any, free now.
            if holding:
                self._add(lease_id, _Held(request_id, holding))
            else:
                self.engine.release(request_id)
            raise
        self._add(lease_id, _Held(request_id, holding))
        prompt_blocks = -(-num_prompt_tokens // self.engine.block_size)
        host, port = self._at
        claims = LeaseClaims(self.ranks.engine_id, host, port, lease_id,
                             tuple(block_ids[:prompt_blocks]), num_prompt_tokens, self.engine.tp,
                             expires_at)
        params = {"do_remote_decode": False, "do_remote_prefill": True,
                  "remote_engine_id": self.ranks.engine_id, "remote_host": host,
                  "remote_port": port, "remote_block_ids": list(claims.block_ids),
                  "remote_request_id": lease_id, "remote_num_tokens": num_prompt_tokens,
                  "remote_block_size": self.engine.block_size,
                  "tp_size": self.engine.tp, "lease_expires_at": claims.expires_at}
        if self.config.kv_key is not None:
            params[TICKET_KEY] = sign_ticket(self.config.kv_key, claims)
        return {**params, **_first_token(first)}

    def _add(self, lease_id: str, held: _Held) -> None:
        self._held[lease_id] = held
        self._lease_of[held.request_id] = lease_id

    def in_use(self, request_id: str) -> bool:
        return request_id in self._lease_of

    def abort(self, request_id: str) -> AbortOutcome | None:
        """The client of ``request_id`` left before its answer (the lease's params)
        reached it, so nobody can read the lease: end it now on every rank
        (``abandoned``) instead of at its TTL."""
        lease_id = self._lease_of.get(request_id)
        if lease_id is None:
            return None
        log.info("request %s: its client left before it got the params of lease %s; "
                 "freeing its blocks", request_id, lease_id)
        for worker in self.ranks.workers:
            worker.end_lease(lease_id, "abandoned")
        return AbortOutcome.LEASED

    def release_handed_out(self, remote: RemoteParams, reason: str) -> bool:
        """Any thread: end a lease this prefill handed out, unclaimed by any decode, for a
        caller that shows its params (the proxy, when no decode will read them); queued
        for the engine loop, as a decode's release. ValueError for another prefill's
        params or, with a key, params this prefill did not sign; whether it was held
        and unclaimed."""
        if remote.remote_engine_id != self.ranks.engine_id:
            raise ValueError(f"the params name prefill {remote.remote_engine_id}, this is "
                             f"{self.ranks.engine_id}")
        if self.config.kv_key is not None:
            verify_ticket(self.config.kv_key, remote.claims(), remote.lease_ticket)
        # a lease a decode claimed is that decode's to end early: refused (logged) then
        return self.answers.on_release(remote.remote_request_id, PARAMS_HOLDER, reason)

    # -- leases ending -----------------------------------------------------------------------
    def poll(self, events: RoleEvents) -> None:
        self.answers.take_releases()  # ends them on the ranks: lease_ended reports each
        self.metrics.leases_held.set(len(self._held))

    def lease_ended(self, rank: int, item: Released, events: RoleEvents) -> bool:
        """Once every rank ended a lease ("done" by all its readers, "abandoned" by a
        release, "expired"), free its request's blocks and count it once, by reason."""
        if self.pushes.ended_unheld(item.request_id):
            return True  # a given-up push's: the engine freed its blocks with the request
        held = self._held.get(item.request_id)
        if held is None:
            return False
        held.ranks_left.discard(rank)
        held.reasons.add(item.reason)
        if not held.ranks_left:
            del self._held[item.request_id]
            del self._lease_of[held.request_id]
            self.engine.release(held.request_id)
            self.metrics.leases_released.labels(_lease_end_reason(held.reasons)).inc()
            events.released.append(held.request_id)
        return True

    def gauges(self) -> dict[str, int]:
        return {"leases": len(self._held)}

    @property
    def waiting(self) -> bool:
        return bool(self._held)


def _first_token(first: Logprob | None) -> dict[str, Any]:
    """The ``first_token`` param of a prefill's answer (none without a first token)."""
    if first is None:
        return {}
    return {"first_token": {"id": first.token_id, "logprob": first.logprob,
                            "top": [list(pair) for pair in first.top]}}


def _lease_end_reason(reasons: set[str]) -> str:
    """One label for a lease whose ranks ended it for ``reasons``: a rank that expired
    means a reader was lost, a release means nobody read; "done" only when all read."""
    for reason in ("expired", "abandoned", "failed", "cached", "answered"):
        if reason in reasons:
            return reason
    return "done"
