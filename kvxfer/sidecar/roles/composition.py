"""``Roles``: the roles one sidecar plays, composed over its ranks, as the engine loop
drives them.

``--role prefill`` is the prefill side; ``decode`` the pull decode, and the push decode
with ``--kv-transfer-mode push``; ``both`` the prefill side and the decode's. Each request
goes to the role that admits its kind (a :class:`~kvxfer.sidecar.request_kinds.Plain`
one straight to the engine), each lease a rank ended to the role that owns it. Engine-loop
thread, except :meth:`Roles.not_admitted` and :meth:`Roles.find`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvxfer.sidecar.request_kinds import Plain, PushIn
from kvxfer.sidecar.roles.prefill import PrefillSide
from kvxfer.sidecar.roles.pull_decode import PullDecode
from kvxfer.sidecar.roles.push_decode import PushDecode
from kvxfer.sidecar.roles.role import AbortOutcome, Role, RoleEvents
from kvxfer.wire.compat import CompatInfo

if TYPE_CHECKING:
    from kvxfer.engine import LLMEngine, RequestOutput
    from kvxfer.sidecar.request_kinds import Kind, Submission
    from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
    from kvxfer.transfer.ranks import Ranks
    from kvxfer.transfer.transfer_config import TransferConfig
    from kvxfer.wire.messages import ReleaseOutcome

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
R = TypeVar("R", bound=Role)
# what to start to serve a kind no role here admits
_NOT_SERVED = {PushIn: "kv_transfer_params.kv_reservation_id: this decode takes no pushes "
                       "(start it with --kv-transfer-mode push)"}


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``"float32"``: the canonical name :class:`CompatInfo` carries."""
    return str(dtype).removeprefix("torch.")


def compat_info(engine: LLMEngine) -> CompatInfo:
    """What a peer must share with ``engine`` to exchange KV caches with it."""
    config = engine.config
    # an MLA cache's "head" is its latent (compressed KV, then the RoPE key)
    return CompatInfo(model=engine.model_id, dtype=dtype_name(engine.dtype),
                      cache_dtype=dtype_name(engine.dtype),
                      head_size=engine.cache_spec(0).head_size,
                      total_kv_heads=config.num_key_value_heads,
                      num_layers=config.num_hidden_layers, kv_packing=engine.kv_packing,
                      kv_lora_rank=config.kv_lora_rank)


def new_engine_id(role: str) -> str:
    """A fresh engine id: the role and 12 random hex digits (new on every start)."""
    return f"{role}-{uuid.uuid4().hex[:12]}"


class Roles:
    """The roles of one instance over its :class:`~kvxfer.transfer.ranks.Ranks`."""

    def __init__(self, engine: LLMEngine, ranks: Ranks, roles: list[Role],
                 metrics: SidecarMetrics) -> None:
        self.engine, self.ranks, self.roles, self.metrics = engine, ranks, roles, metrics

    @classmethod
    def start(cls, engine: LLMEngine, role: str, metrics: SidecarMetrics,
              config: TransferConfig, engine_id: str, advertised: str) -> Roles:
        """The roles ``role`` plays, their ranks registered with ``engine``'s caches and,
        where peers dial this instance, its side channel served (peers told
        ``advertised``)."""
        from kvxfer.transfer.ranks import Ranks

        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        reads = role in ("decode", "both")
        ranks = Ranks(engine_id, compat_info(engine), config, ranks=range(engine.tp),
                      tp_size=engine.tp, total_kv_heads=engine.config.num_key_value_heads,
                      reads=reads)
        made = cls(engine, ranks, [], metrics)
        try:
            for rank in range(engine.tp):
                ranks.register(rank, engine.kv_caches[rank], engine.cache_spec(rank),
                               engine.num_blocks, engine.layout)
            kinds: list[Callable[..., Role]] = []
            if role in ("prefill", "both"):
                kinds.append(PrefillSide)
            if reads:
                kinds.append(PullDecode)
                if config.kv_transfer_mode == "push":
                    kinds.append(PushDecode)
            made.roles.extend(make(engine, ranks, metrics, config) for make in kinds)
            answering = [a for r in made.roles if (a := r.answering) is not None]
            if answering:  # peers dial this instance
                port = ranks.serve(config.side_channel_port, answering, made._claimed_by)
                for serving in made.roles:
                    serving.serving_at(advertised, port)
        except BaseException:
            made.close()
            raise
        return made

    # -- finding roles ----------------------------------------------------------------------
    def find(self, kind: type[R]) -> R | None:
        """Any thread: the role of type ``kind`` this instance plays, if any."""
        for role in self.roles:
            if isinstance(role, kind):
                return role
        return None

    def _serving(self, kind: Kind) -> Role | None:
        for role in self.roles:
            if isinstance(kind, role.kinds):
                return role
        return None

    @property
    def side_channel_port(self) -> int | None:
        return self.ranks.port

    def _claimed_by(self, engine_id: str, side_channel: tuple[str, int]) -> None:
        for role in self.roles:
            role.claimed_by(engine_id, side_channel)

    # -- requests ---------------------------------------------------------------------------
    def admit(self, submission: Submission) -> None:
        """Hand a request to the role that admits its kind (ValueError: refused)."""
        kind = submission.kind
        if isinstance(kind, Plain):
            self.engine.add_request(submission.request_id, submission.prompt,
                                    submission.params)
            return
        role = self._serving(kind)
        if role is None:
            raise ValueError(_NOT_SERVED.get(type(kind), f"this instance does not serve "
                                                         f"{type(kind).__name__} requests"))
        role.admit(submission)

    def not_admitted(self, kind: Kind, reason: str, outcome: ReleaseOutcome) -> None:
        """Any thread: a request of ``kind`` will never be admitted (see
        :meth:`Role.not_admitted`)."""
        role = self._serving(kind)
        if role is not None:
            role.not_admitted(kind, reason, outcome)

    def finished(self, output: RequestOutput, kind: Kind) -> dict[str, Any] | None:
        role = self._serving(kind)
        return None if role is None else role.finished(output, kind)

    def transfer_error(self, request_id: str, kind: Kind) -> str | None:
        role = self._serving(kind)
        return None if role is None else role.transfer_error(request_id)

    def abort(self, request_id: str) -> AbortOutcome:
        """The client left: drop, defer or leave the request (see :class:`AbortOutcome`)."""
        for role in self.roles:
            outcome = role.abort(request_id)
            if outcome is not None:
                return outcome
        return AbortOutcome.NOT_MINE

    def in_use(self, request_id: str) -> bool:
        return any(role.in_use(request_id) for role in self.roles)

    # -- polling ----------------------------------------------------------------------------
    def poll(self) -> RoleEvents:
        """Hand every lease a rank ended to its role, then let each role follow its
        transfers and admit what waits; the metrics of what the ranks counted."""
        events = RoleEvents()
        for rank, item in self.ranks.lease_ends():
            if not any(role.lease_ended(rank, item, events) for role in self.roles):
                log.warning("rank %d released unknown lease %s", rank, item.request_id)
        for role in self.roles:
            role.poll(events)
        self._count_worker_events()
        return events

    def _count_worker_events(self) -> None:
        m = self.metrics
        for counts in self.ranks.take_counts():
            for metric, counted in ((m.handshake_failures, counts.handshake_failures),
                                    (m.notifications_failed, counts.notifications_failed),
                                    (m.notifications_late, counts.notifications_late)):
                for reason, count in counted.items():
                    metric.labels(reason).inc(count)
            for (peer, path), moved in counts.paths.items():
                m.count_path(peer, path, moved.num_bytes, moved.seconds, moved.ceiling)

    def gauges(self) -> dict[str, int]:
        """Leases, reservations and quarantined blocks, summed over the roles."""
        out = {"leases": 0, "reservations": 0, "quarantined_blocks": 0}
        for role in self.roles:
            for name, value in role.gauges().items():
                out[name] = out.get(name, 0) + value
        return out

    @property
    def busy(self) -> bool:
        return any(role.busy for role in self.roles)

    @property
    def claiming(self) -> bool:
        return any(role.claiming for role in self.roles)

    @property
    def waiting(self) -> bool:
        return any(role.waiting for role in self.roles)

    def close(self) -> None:
        """Stop the ranks, then let every role release what it still holds, then send
        that for about a second (idempotent). Call after the loop stopped."""
        self.ranks.stop()
        for role in self.roles:
            role.close()
        self.ranks.close()
