"""One sidecar instance: engine, roles (over its ranks: workers, listener), engine loop,
metrics, KV event stream, and its drain (:class:`Sidecar`)."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from kvxfer.net.hosts import bare_host
from kvxfer.sidecar.engine_loop import EngineLoop
from kvxfer.sidecar.kv_event_publisher import KVEventPublisher
from kvxfer.sidecar.openai_api.answers import TokenText
from kvxfer.sidecar.openai_api.prepared import ModelInfo
from kvxfer.sidecar.roles.composition import Roles, new_engine_id
from kvxfer.sidecar.settings import Settings
from kvxfer.sidecar.sidecar_metrics import SidecarMetrics
from kvxfer.transfer.converted.mapped_reads import shared_zeros

if TYPE_CHECKING:
    from kvxfer.engine import LLMEngine

log = logging.getLogger(__name__)

# A draining sidecar exits only after this long without a new request: longer than the
# proxy keeps an idle pooled connection (4 s), so none is reused as the socket closes.
DRAIN_QUIET_S = 5.0


class Sidecar:
    """One instance: engine, metrics, KV event stream (with ``kv_events_port``), roles
    (workers + listener) and engine loop.

    Built in that order; :meth:`close` undoes it. The loop thread starts with
    :meth:`start` (the app's lifespan does it).
    """

    def __init__(self, settings: Settings) -> None:
        from kvxfer.engine import LLMEngine

        self.settings = settings
        transfer = settings.transfer
        # checked first: a wildcard side channel without --advertise-host fails fast
        self.side_channel_advertised = settings.side_channel_advertised() \
            if settings.advertises else bare_host(transfer.side_channel_host)
        self.http_host = settings.http_advertised()
        self.draining_since: float | None = None  # monotonic time of the SIGTERM
        self.http_in_flight = 0  # completion requests being answered (streams included)
        self.last_request = 0.0  # monotonic time the last completion request arrived
        self.engine: LLMEngine = LLMEngine.from_model_arg(
            settings.model, seed=settings.seed, tp=settings.tp, layout=settings.kv_cache_layout,
            block_size=settings.block_size, num_blocks=settings.num_blocks,
            dtype=settings.dtype, device=settings.device, kv_packing=settings.kv_packing,
            enable_prefix_caching=settings.enable_prefix_caching,
            # a decode on this host may map a prefill's cache
            # (kvxfer.transfer.converted.mapped_reads)
            cache_zeros=shared_zeros if transfer.host_reads and settings.role != "decode"
            and settings.device == "cpu" else None)
        self.served_names = settings.served_model_names or (self.engine.model_name,)
        self.engine_id = new_engine_id(settings.role)
        self.metrics = SidecarMetrics(role=settings.role, engine_id=self.engine_id,
                                      model=self.served_names[0],
                                      layout=self.engine.layout.name, tp=self.engine.tp)
        self.kv_events = None if settings.kv_events_port is None else KVEventPublisher(
            transfer.side_channel_host, settings.kv_events_port, transfer.kv_key)
        try:
            self.roles = Roles.start(self.engine, settings.role, self.metrics, transfer,
                                     self.engine_id, self.side_channel_advertised)
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.close()
            raise
        self.loop = EngineLoop(self.engine, self.roles, self.metrics, self.kv_events)
        self.info = ModelInfo(self.served_names, self.engine.tokenizer,
                              self.engine.config.vocab_size, self.engine.max_model_len,
                              self.engine.block_size, settings.role, self.engine.num_blocks)
        self.token_text = TokenText(self.engine.tokenizer)

    def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()
        self.loop.start()

    def close(self) -> None:
        """Stop the engine loop, then the KV event stream, the roles and their ranks
        (idempotent)."""
        self.loop.stop()
        if self.kv_events is not None:
            self.kv_events.close()
        self.roles.close()

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def begin_drain(self) -> None:
        """Stop taking new requests; :meth:`drained` says when to exit (idempotent)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            log.info("kvxfer serve: draining (SIGTERM): no new requests; exiting when "
                     "in-flight requests and leases are done, at most in %g s",
                     self.settings.drain_timeout)

    def drained(self) -> bool:
        """Draining and done: nothing in flight, no lease held, no request for
        :data:`DRAIN_QUIET_S`; or ``drain_timeout`` has passed."""
        if self.draining_since is None:
            return False
        now, limit = time.monotonic(), self.settings.drain_timeout
        if now - self.draining_since >= limit:
            log.warning("kvxfer serve: drain timeout (%g s): exiting with %s", limit,
                        self.loop.snapshot())
            return True
        snap = self.loop.snapshot()
        busy = self.http_in_flight or snap.get("requests_in_flight") or snap.get("leases")
        quiet = now - max(self.draining_since, self.last_request) >= min(DRAIN_QUIET_S, limit)
        if not busy and quiet:
            log.info("kvxfer serve: drained in %.1f s", now - self.draining_since)
            return True
        return False

    def describe(self, http_port: int) -> str:
        """The start-up line: role, model, layout, TP, ports, engine id."""
        side = self.roles.side_channel_port
        bound = self.settings.transfer.side_channel_host
        return (f"role={self.settings.role} model={self.served_names[0]} "
                f"(id {self.engine.model_id}) layout={self.engine.layout.name} "
                f"tp={self.engine.tp} http={self.settings.host}:{http_port} side_channel="
                f"{f'{bound}:{side}' if side else 'none'} "
                f"advertised={self.side_channel_advertised} "
                f"{f'kv_events={bound}:{self.kv_events.port} ' if self.kv_events else ''}"
                f"engine_id={self.engine_id}")

    def health(self) -> dict[str, Any]:
        return {"status": "draining" if self.draining else "ok", "role": self.settings.role,
                "engine_id": self.engine_id, "pid": os.getpid(),
                "model": self.served_names[0], "layout": self.engine.layout.name,
                "tp": self.engine.tp, "block_size": self.engine.block_size,
                "max_model_len": self.engine.max_model_len,
                "side_channel_host": self.side_channel_advertised,
                "http_host": self.http_host,
                "side_channel_port": self.roles.side_channel_port,
                "kv_load_failure_policy": self.settings.transfer.kv_load_failure_policy,
                "prefix_caching": self.settings.enable_prefix_caching,
                **({} if self.kv_events is None else {"kv_events": self.kv_events.discovery(
                    self.side_channel_advertised, self.engine.block_size)}),
                **self.loop.snapshot()}
