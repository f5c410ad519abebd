"""What a request asks of an instance's KV transfers, one small class per kind, and the
:class:`Submission` the HTTP layer hands the engine loop (pure data).

A request is :class:`Plain` (computed and answered here), or one end of a P/D transfer:
a prefill's :class:`LeaseOut` (its blocks leased to the decode that reads them, pull) or
:class:`PushOut` (WRITten into a decode's reservation, push); a decode's :class:`PullIn`
(read from a prefill's lease) or :class:`PushIn` (written into a reservation here). Each
role of :mod:`kvxfer.sidecar.roles` admits the kinds it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvxfer.engine import Logprob, SamplingParams
    from kvxfer.wire.params import FirstToken, RemoteParams
    from kvxfer.wire.reservations import PushedParams, Reservation


@dataclass(frozen=True)
class Plain:
    """Computed and answered here, start to end."""


@dataclass(frozen=True)
class LeaseOut:
    """Prefill, pull: compute the prompt, then lease its blocks to the decode that reads
    them (the answer's ``kv_transfer_params`` name the lease)."""


@dataclass(frozen=True)
class PushOut:
    """Prefill, push: compute the prompt and WRITE its KV into ``reservation``, a decode's
    blocks, layer by layer as they are computed."""

    reservation: Reservation


@dataclass(frozen=True)
class Sample:
    """A further sample of a decode's prompt: its own id, choice index and sampling; it
    starts from a copy of the KV its request transfers."""

    request_id: str
    index: int
    params: SamplingParams


@dataclass(frozen=True)
class PullIn:
    """Decode, pull: read the prompt's KV from the prefill lease ``remote`` names."""

    remote: RemoteParams
    samples: tuple[Sample, ...] = ()

    @property
    def first_token(self) -> FirstToken | None:
        return self.remote.first_token


@dataclass(frozen=True)
class PushIn:
    """Decode, push: the prompt's KV is (being) written into this decode's reservation
    ``pushed`` names."""

    pushed: PushedParams
    samples: tuple[Sample, ...] = ()

    @property
    def first_token(self) -> FirstToken | None:
        return self.pushed.first_token


Kind = Plain | LeaseOut | PushOut | PullIn | PushIn
DecodeKind = PullIn | PushIn  # the KV comes from elsewhere; further samples share it
PLAIN = Plain()


@dataclass(frozen=True)
class Submission:
    """One choice of an HTTP request, ready for the engine loop: its id, choice index,
    prompt, sampling and kind (a decode's further samples ride in its kind)."""

    request_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    kind: Kind = PLAIN

    @property
    def samples(self) -> tuple[Sample, ...]:
        return self.kind.samples if isinstance(self.kind, PullIn | PushIn) else ()

    @property
    def ids(self) -> list[str]:
        """This request's id and its further samples' ids."""
        return [self.request_id, *(s.request_id for s in self.samples)]


def first_logprob(first: FirstToken | None) -> Logprob | None:
    """The first token a prefill sampled (``first_token`` of the params), as the engine
    takes it; None when the params bring none (vLLM's prefills, ``n > 1``): then the
    decode samples it from the last prompt token, which it computes again."""
    from kvxfer.engine import Logprob

    return None if first is None else Logprob(first.id, first.logprob, tuple(first.top))
