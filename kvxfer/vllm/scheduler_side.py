"""The scheduler-side half of ``KvxferConnector`` (pure: no vLLM, no I/O).

vLLM calls it in its engine-core process, through ``kvxfer.vllm.connector``, with plain
values. Prefill: a lease (``Hold``) is added in the step whose forward computes the prompt's
last token, so it exists before its id is handed out. Decode: the blocks not prefix-cached
are loaded once per request (``Load``). Validating the params is the worker's.

Design: docs/design/vllm-connector.md#the-scheduler-side
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.transfer.transfer_config import TransferConfig
from kvxfer.vllm.step_plan import Hold, Load, StepPlan
from kvxfer.wire.tickets import TICKET_KEY, LeaseClaims, sign_ticket


@dataclass(frozen=True)
class BlockRef:
    """One block of an allocation: its id, and whether it came from the prefix cache."""

    block_id: int
    cached: bool


class SchedulerSide:
    def __init__(self, config: TransferConfig, engine_id: str, block_size: int,
                 tp_size: int) -> None:
        self.config, self.engine_id = config, engine_id
        self.block_size, self.tp_size = block_size, tp_size
        self._key = config.kv_key
        # each rank's listener port: the config's (rank r on port + r) or vLLM's handshake
        self.side_channel_ports: tuple[int, ...] | None = tuple(
            config.side_channel_port + rank for rank in range(tp_size)) \
            if config.side_channel_port else None
        self._producing: dict[str, int] = {}  # prefill request -> prompt tokens
        self._holds: dict[str, Hold] = {}     # prefill request -> lease sent to the worker
        self._plan = StepPlan()

    # -- both -------------------------------------------------------------------------------
    def set_side_channel_ports(self, ports: Mapping[int, int]) -> None:
        """The port each rank's listener bound, by TP rank (vLLM's handshake-metadata
        path); ValueError unless every rank sent one."""
        if sorted(ports) != list(range(self.tp_size)):
            raise ValueError(f"KvxferConnector: side-channel ports came from TP ranks "
                             f"{sorted(ports)}, not from each of the {self.tp_size}")
        self.side_channel_ports = tuple(ports[rank] for rank in range(self.tp_size))

    def build_plan(self, scheduled: Mapping[str, tuple[int, int]],
                   block_ids: Callable[[str], Sequence[int]],
                   now: float | None = None) -> StepPlan:
        """This step's plan. ``scheduled`` maps each request scheduled now to (tokens
        computed before this step, tokens scheduled in it); ``block_ids(request)`` is
        its current allocation (first KV cache group)."""
        now = time.time() if now is None else now
        for request_id, prompt_tokens in list(self._producing.items()):
            before, count = scheduled.get(request_id, (0, 0))
            if count == 0 or before + count < prompt_tokens:
                continue  # not scheduled, or a chunk short of the prompt's end
            del self._producing[request_id]
            blocks = tuple(block_ids(request_id))[:-(-prompt_tokens // self.block_size)]
            hold = Hold(request_id, secrets.token_urlsafe(16), blocks, prompt_tokens,
                        now + self.config.lease_ttl)
            earlier = self._holds.get(request_id)
            if earlier is not None:  # preempted and computed again: its old lease is void
                self._plan.drop_leases.append(earlier.lease_id)
            self._holds[request_id] = hold
            self._plan.holds.append(hold)
        plan, self._plan = self._plan, StepPlan()
        return plan

    # -- decode -----------------------------------------------------------------------------
    @staticmethod
    def matched_tokens(params: Mapping[str, Any] | None, num_prompt_tokens: int,
                       num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens to load beyond the local hit, asynchronously; (0, False) for none."""
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = params.get("remote_num_tokens")
        tokens = num_prompt_tokens
        if isinstance(remote, int) and not isinstance(remote, bool) and remote > 0:
            tokens = min(remote, num_prompt_tokens)
        count = tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request_id: str, params: dict[str, Any] | None,
                    num_prompt_tokens: int, blocks: Sequence[BlockRef],
                    num_external_tokens: int) -> None:
        """vLLM allocated ``blocks`` (first group) for the request; mutates ``params``."""
        if not params:
            return
        if params.get("do_remote_decode"):
            self._producing[request_id] = num_prompt_tokens
            return
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one load per request, however often called
        if num_external_tokens <= 0:  # nothing to read (a full local hit): free the lease
            self._plan.loads.append(Load(request_id, dict(params), ()))
            return
        cached = sum(1 for b in blocks if b.cached)
        local = tuple(b.block_id for b in blocks if not b.cached)
        # The blocks covering the loaded tokens; vLLM may have allocated more (lookahead).
        needed = -(-(cached * self.block_size + num_external_tokens) // self.block_size)
        self._plan.loads.append(Load(request_id, dict(params), local[:needed - cached], cached))

    # -- both: the end of a request ---------------------------------------------------------
    def finished(self, request_id: str, params: dict[str, Any] | None, completed: bool,
                 ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: whether vLLM must keep the blocks, and the params
        of the answer. ``completed``: it finished normally (length or stop)."""
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # a decode that never reached its load
            params["do_remote_prefill"] = False
            self._plan.loads.append(Load(request_id, dict(params), ()))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        self._producing.pop(request_id, None)
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return False, None  # its prompt was never computed: nothing to hand out
        if not completed or self.side_channel_ports is None:
            self._plan.drop_leases.append(hold.lease_id)
            return False, None
        return True, self._params(hold)

    def _params(self, hold: Hold) -> dict[str, Any]:
        assert self.side_channel_ports is not None
        tokens = hold.num_tokens
        ports = self.side_channel_ports if self.tp_size > 1 else ()  # each rank listens apart
        claims = LeaseClaims(self.engine_id, self.config.advertised,
                             self.side_channel_ports[0], hold.lease_id, hold.block_ids, tokens,
                             self.tp_size, hold.expires_at, ports)
        params: dict[str, Any] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_host": claims.host,
            "remote_port": claims.port, "remote_block_ids": list(hold.block_ids),
            "remote_request_id": hold.lease_id, "remote_num_tokens": tokens,
            "remote_block_size": self.block_size,
            "tp_size": self.tp_size, "lease_expires_at": hold.expires_at}
        if ports:
            params["remote_rank_ports"] = list(ports)
        if self._key is not None:
            params[TICKET_KEY] = sign_ticket(self._key, claims)
        return params
