"""What the scheduler-side connector tells the worker-side one each step (pure).

vLLM runs the two halves of a connector in different processes: the scheduler
decides, and once per step hands the worker a :class:`StepPlan` inside the
step's connector metadata (pickled with the scheduler output). The worker
answers through ``get_finished`` (request ids) and the load-error block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Hold:
    """Prefill: lease ``block_ids`` under ``lease_id`` once this step's forward wrote them.

    ``expires_at`` is wall-clock seconds, the same instant the scheduler puts in the
    request's ``kv_transfer_params``; the worker holds the blocks at least that long.
    """

    request_id: str
    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: int  # the prompt's tokens, whose KV the blocks hold
    expires_at: float


@dataclass(frozen=True)
class Load:
    """Decode: read the prefill's KV named by ``params`` into ``local_block_ids``.

    The first ``skip_blocks`` blocks of the prompt were found in this instance's
    prefix cache: the READ covers the prefill's blocks past their tokens only (its
    blocks may be of another size: :meth:`kvxfer.wire.params.RemoteParams.tokens`).
    """

    request_id: str
    params: dict[str, Any]
    local_block_ids: tuple[int, ...]
    skip_blocks: int = 0


@dataclass
class StepPlan:
    holds: list[Hold] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    # prefill: leases whose request vLLM freed without handing its params out (aborted)
    drop_leases: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.holds or self.loads or self.drop_leases)
