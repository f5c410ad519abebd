"""``Targets``: the decode engines one prefill rank pushes into, handshaken and connected.

The push side's counterpart of :class:`~kvxfer.transfer.peers.Peers`, over the same
:class:`~kvxfer.transfer.handshakes.Handshakes`: a pool thread fetches a decode's metadata
from the side channel its reservation names and plans what this rank WRITEs into each
decode rank (:func:`~kvxfer.plan.pushes.plan_pushes`, converting on this side where byte
copies cannot place the heads: :class:`~kvxfer.plan.pushes.ConvertedPush`); back on the
worker's thread, :meth:`Targets.connect` loads the decode ranks' agents into this rank's
agent and warms each connection. A decode that failed is dead for a moment
(:data:`~kvxfer.transfer.handshakes.DEAD_PEER_S`). :meth:`Targets.claim` claims one
reservation for this prefill over the decode's side channel, on a pool thread of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvxfer.plan.descriptors import IncompatibleLayoutError, SideGeometry
from kvxfer.plan.pushes import ConvertedPush, PushPlan, PushRefused, plan_pushes, push_targets
from kvxfer.transfer.converted.stream_copy import stream_copy
from kvxfer.transfer.handshakes import Handshakes, fetch_ranks
from kvxfer.transfer.local_rank import LocalRank, memory_kind
from kvxfer.transfer.results import TransferError
from kvxfer.transfer.side_channel.client import SideChannelClient
from kvxfer.wire.metadata import AgentMetadata
from kvxfer.wire.reservations import Reservation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Shaken:
    """A decode's checked metadata and this rank's push plans, before NIXL connects;
    ``writers``: the decode ranks it writes into, each with its count of writers;
    ``refused``: why neither byte copies nor a conversion can place its heads there (no
    plans then)."""

    metas: dict[int, AgentMetadata]
    plans: list[PushPlan | ConvertedPush]
    writers: dict[int, int]
    refused: str | None = None


@dataclass
class Target:
    """A handshaken decode engine as this prefill rank writes into it: a plan, an agent,
    a memory kind and a count of writers per decode rank it writes into (none: it holds
    no head they read). ``refused``: why nothing can be pushed into it, neither byte
    copies nor a conversion placing the heads (its ranks are connected all the same, to
    be told so)."""

    engine_id: str
    address: str
    tp_size: int
    plans: dict[int, PushPlan | ConvertedPush] = field(default_factory=dict)
    agents: dict[int, str] = field(default_factory=dict)
    cuda: dict[int, bool] = field(default_factory=dict)
    writers: dict[int, int] = field(default_factory=dict)
    refused: str | None = None


class Targets:
    """The decode engines this prefill rank pushes into: handshakes, connections, push plans
    and claims. ``total_kv_heads`` and both instances' TP sizes say which
    heads this rank writes into which decode rank."""

    def __init__(self, local: LocalRank, client: SideChannelClient, *,
                 total_kv_heads: int) -> None:
        self._local, self._client = local, client
        self.total_kv_heads = total_kv_heads
        self._targets: dict[str, Target] = {}
        self._shakes: Handshakes[_Shaken] = Handshakes(f"kvxfer-push-handshake-r{local.rank}",
                                                       local.wake, local.tally)
        self._shaking: dict[str, Reservation] = {}
        self._claims = ThreadPoolExecutor(max_workers=8,  # a silent decode holds one a while
                                          thread_name_prefix=f"kvxfer-push-claim-r{local.rank}")

    def get(self, engine_id: str) -> Target | None:
        return self._targets.get(engine_id)

    def dead(self, engine_id: str) -> str | None:
        return self._shakes.dead(engine_id)

    def shaking(self, engine_id: str) -> bool:
        return engine_id in self._shaking

    def shake(self, reservation: Reservation) -> None:
        """Start handshaking with the reservation's decode on a pool thread (once: the
        caller parks later pushes to it until :meth:`finished` names it)."""
        self._shaking[reservation.engine_id] = reservation
        self._shakes.start(reservation.engine_id, reservation.address,
                           lambda: self._plan(reservation))

    def finished(self) -> list[Reservation]:
        """Worker thread: the reservations whose decode's handshake ended; each decode is
        :meth:`connect`-ed next."""
        return [self._shaking[engine] for engine in self._shakes.finished()]

    def connect(self, reservation: Reservation) -> Target:
        """Worker thread: the decode whose handshake ended, connected; raises
        :class:`~kvxfer.transfer.handshakes.HandshakeFailed` (it is dead for a moment)."""
        del self._shaking[reservation.engine_id]
        target = self._shakes.connect(reservation.engine_id,
                                      lambda shaken: self._connect(reservation, shaken))
        self._targets[target.engine_id] = target
        return target

    def claim(self, reservation: Reservation, answers_at: tuple[str, int],
              answered: Callable[[str | None], None]) -> None:
        """Claim ``reservation`` for this prefill at its decode, naming ``answers_at`` (this
        instance's side channel); a pool thread calls ``answered`` with None once the
        decode granted it, or with why not (refused, no answer within the handshake's
        timeout)."""
        def run() -> None:
            try:
                ack = self._client.renew(reservation.host, reservation.port,
                                         reservation.reservation_id, claim=True,
                                         timeout=self._local.deadlines.handshake_timeout,
                                         side_channel=answers_at)
                refused = None if ack.found else ack.reason or "refused"
            except Exception as exc:  # no answer, a dead decode: nothing gets written
                refused = str(exc)
            answered(refused)

        self._claims.submit(run)

    def forget_dead(self, engine_id: str, reason: str) -> None:
        """A WRITE into ``engine_id`` failed: drop it, fail fast for a moment."""
        self.drop(engine_id)
        self._shakes.mark_dead(engine_id, reason)

    def drop(self, engine_id: str) -> None:
        """Worker thread: remove ``engine_id``'s agents; shadows held for WRITEs into it
        that were cut off are freed."""
        target = self._targets.pop(engine_id, None)
        if target is not None:
            for name in target.agents.values():
                self._local.agent.drop_remote(name)
        self._local.staging.drop_held(engine_id)

    def close(self) -> None:
        self._claims.shutdown(wait=False, cancel_futures=True)
        self._shakes.close()

    # -- pool thread: no NIXL ---------------------------------------------------------------
    def _plan(self, reservation: Reservation) -> _Shaken:
        local = self._local
        metas = fetch_ranks(self._client, reservation.host,
                            {reservation.port: tuple(range(reservation.tp_size))},
                            engine_id=reservation.engine_id, tp_size=reservation.tp_size,
                            timeout=local.deadlines.handshake_timeout,
                            retries=local.deadlines.handshake_retries,
                            backends=local.agent.backends, roles=("decode", "prefill"),
                            named_by="its reservation says")
        geometries = {rank: SideGeometry.from_plan(meta.plan, meta.kv_packing)
                      for rank, meta in metas.items()}
        sizes = {meta.block_size for meta in metas.values()}
        shape = {"writer_tp": local.tp_size, "target_tp": reservation.tp_size,
                 "total_kv_heads": self.total_kv_heads}
        writers = {rank: count for rank, (_, count)
                   in push_targets(local.rank, **shape).items()}
        try:
            if sizes != {reservation.block_size}:
                raise IncompatibleLayoutError(
                    f"its reservation counts {reservation.block_size}-token blocks but the "
                    f"decode's cache has {', '.join(map(str, sizes))}-token blocks")
            plans = plan_pushes(local.rank, local.geometry, geometries, **shape,
                                converted=self._converted)
        except IncompatibleLayoutError as exc:  # the decode is told, then it fails
            return _Shaken(metas, [], writers, str(exc))
        return _Shaken(metas, plans, writers)

    def _converted(self, push: PushPlan) -> ConvertedPush:
        """``push``'s pair, converted on this side: from this rank's host cache only."""
        if self._local.is_cuda:
            raise PushRefused("this prefill's cache is in GPU memory, where a push does not "
                              "convert; run the sidecars with --kv-transfer-mode pull")
        return ConvertedPush.of(push, self._local.view_groups[0][1], stream_copy)

    # -- worker thread: NIXL ----------------------------------------------------------------
    def _connect(self, reservation: Reservation, shaken: _Shaken) -> Target:
        local = self._local
        target = Target(reservation.engine_id, reservation.address, reservation.tp_size,
                        {plan.target_rank: plan for plan in shaken.plans},
                        writers=shaken.writers, refused=shaken.refused)
        try:
            for rank in shaken.writers:
                meta = shaken.metas[rank]
                target.cuda[rank] = memory_kind(meta.plan.memory, f"decode rank {rank}")
                target.agents[rank] = local.agent.add_remote(meta.agent_blob)
                local.agent.connect(target.agents[rank], probe=meta.plan.memory[0])
        except Exception as exc:
            for name in target.agents.values():
                self._local.agent.drop_remote(name)
            raise TransferError(f"NIXL could not connect to decode {reservation.engine_id} "
                                f"at {reservation.address}: {exc}") from exc
        log.info("rank %d connected to decode %s at %s to push into ranks %s", local.rank,
                 target.engine_id, target.address, sorted(target.agents))
        return target
