"""``KvxferConnector``: kvxfer's transfer as a vLLM (v1) KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_both", "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {...}}'

(keys of ``kv_connector_extra_config``: :mod:`kvxfer.vllm.extra_config`). This class
only adapts vLLM's hooks: the scheduler side is :class:`~kvxfer.vllm.scheduler_side.
SchedulerSide`, the worker side :class:`~kvxfer.vllm.worker_side.WorkerSide`, and
those call kvxfer's own regions, descriptors, handshake, worker and leases.

Pull mode with asynchronous loads, as vLLM's NixlConnector: the decode reads
the prefill's blocks with NIXL READs while vLLM keeps stepping; the prefill
keeps a request's blocks until its reader said "done", a release arrived, or
the lease expired. What it supports today: any TP size that divides the model's KV
heads (each rank, a process of its own, registers its share and serves it on its own
side channel; the params name every rank's port), no pipeline or context
parallelism, one KV cache group, and the layer views every attention
backend of vLLM 0.32 hands a connector, in any of its layouts
(:mod:`kvxfer.vllm.cache_shapes`); on the CPU backend K and V inside a head's
block are stored as its instruction set wants (``CompatInfo.kv_packing``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvxfer.net.hosts import unreachable_advertised
from kvxfer.plan.layout import CacheSpec
from kvxfer.plan.packing import TOKEN_PACKING, VLLM_CPU_PACKING_PREFIX
from kvxfer.vllm.allocation import SharedCacheAllocation
from kvxfer.vllm.cache_shapes import cache_spec
from kvxfer.vllm.extra_config import ConnectorSettings
from kvxfer.vllm.scheduler_side import BlockRef, SchedulerSide
from kvxfer.vllm.step_plan import StepPlan
from kvxfer.vllm.worker_side import StepResult, WorkerSide
from kvxfer.wire.compat import CompatInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker (one TP rank) tells the scheduler at start-up: its listener's port."""

    side_channel_port: int


@dataclass
class KvxferStats(KVConnectorStats):
    """Per-interval READ statistics of a decode (what ``vllm:kvxfer_*`` metrics show)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"transfer_duration": [], "read_duration": [], "bytes_transferred": [],
                     "num_descriptors": [], "num_failed_transfers": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data[key] + value
        return self

    def reduce(self) -> dict[str, int | float]:
        times = self.data["transfer_duration"]
        mib = sum(self.data["bytes_transferred"]) / 2**20
        return {"Num successful transfers": len(times),
                "Avg xfer time (ms)": round(1e3 * float(np.mean(times)), 3) if times else 0,
                "Avg MB per transfer": round(mib / len(times), 3) if times else 0,
                "Num failed transfers": self.data["num_failed_transfers"]}

    def is_empty(self) -> bool:
        return not self.data["transfer_duration"] and not self.data["num_failed_transfers"]


class KvxferPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvxfer_xfer_time_seconds`` (a read NIXL moved: NIXL's telemetry, the span of
    NixlConnector's ``vllm:nixl_xfer_time_seconds``; a copy on this host: posted to landed),
    ``_read_time_seconds`` (queued to landed: the wait to be posted too),
    ``_bytes_transferred``, ``_num_descriptors`` (histograms, one observation per READ) and
    ``_num_failed_transfers``."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], Any],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: list[float]) -> dict[int, PromMetricT]:
            return self._per_engine(self._histogram_cls(name=name, documentation=doc,
                                                        buckets=buckets, labelnames=labelnames))

        seconds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5]
        self.time = histogram("vllm:kvxfer_xfer_time_seconds", "Seconds from posting a KV "
                              "READ to its data landing, per kvxfer transfer.", seconds)
        self.read_time = histogram("vllm:kvxfer_read_time_seconds", "Seconds from queueing a "
                                   "KV READ to its data landing (planning and waits "
                                   "included), per kvxfer transfer.", seconds)
        self.bytes = histogram("vllm:kvxfer_bytes_transferred", "Bytes per kvxfer transfer.",
                               [float(2 ** (10 + i)) for i in range(1, 25, 2)])
        self.descs = histogram("vllm:kvxfer_num_descriptors", "NIXL descriptors per kvxfer "
                               "transfer.", [1, 10, 30, 100, 300, 1000, 3000, 10000, 50000])
        self.failed = self._per_engine(self._counter_cls(
            name="vllm:kvxfer_num_failed_transfers", documentation="Failed kvxfer KV loads "
            "(params, lease, claim or READ).", labelnames=labelnames))

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds, read, size, descs in zip(transfer_stats_data["transfer_duration"],
                                              transfer_stats_data["read_duration"],
                                              transfer_stats_data["bytes_transferred"],
                                              transfer_stats_data["num_descriptors"],
                                              strict=True):
            self.time[engine_idx].observe(seconds)
            self.read_time[engine_idx].observe(read)
            self.bytes[engine_idx].observe(size)
            self.descs[engine_idx].observe(descs)
        if transfer_stats_data["num_failed_transfers"]:
            self.failed[engine_idx].inc(transfer_stats_data["num_failed_transfers"])


def _refuse_unsupported(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    for what, size in (("pipeline_parallel_size", parallel.pipeline_parallel_size),
                       ("decode_context_parallel_size", parallel.decode_context_parallel_size)):
        if size != 1:
            raise ValueError(f"KvxferConnector supports {what} 1 for now, got {size}: use "
                             f"NixlConnector for this setup")
    tp, heads = parallel.tensor_parallel_size, vllm_config.model_config.get_total_num_kv_heads()
    if heads % tp:
        raise ValueError(f"KvxferConnector splits the model's {heads} KV heads over the TP "
                         f"ranks, so tensor_parallel_size must divide {heads}, got {tp} (vLLM "
                         f"would copy heads to several ranks)")


def _settings(vllm_config: VllmConfig) -> ConnectorSettings:
    config = vllm_config.kv_transfer_config
    assert config is not None
    return ConnectorSettings.from_extra_config(config.kv_connector_extra_config)


def _engine_id(vllm_config: VllmConfig) -> str:
    config = vllm_config.kv_transfer_config
    assert config is not None and config.engine_id is not None
    return f"vllm-{config.engine_id}"


class KvxferConnector(KVConnectorBase_V1):
    """vLLM's connector interface over kvxfer (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _refuse_unsupported(vllm_config)
        self._settings = _settings(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._step: StepResult | None = None  # worker: the last poll, until vLLM takes it
        self._load_errors: set[int] = set()
        self._producing: dict[str, Request] = {}
        if role == KVConnectorRole.SCHEDULER:
            transfer = self._settings.transfer
            problem = unreachable_advertised(transfer.side_channel_host, transfer.advertised,
                                             "kv_connector_extra_config.side_channel_host")
            if problem is not None:  # every read of this prefill would fail
                raise ValueError(f"KvxferConnector: {problem}")
            self._scheduler = SchedulerSide(
                transfer, _engine_id(vllm_config), vllm_config.cache_config.block_size,
                vllm_config.parallel_config.tensor_parallel_size)

    # -- worker side --------------------------------------------------------------------------
    def get_mem_pool_context(self) -> SharedCacheAllocation | None:
        """vLLM allocates the CPU cache in shared memory (:mod:`kvxfer.vllm.allocation`), so
        that a decode on this host copies from it mapped; host_reads false keeps vLLM's."""
        from vllm.platforms import current_platform

        if not self._settings.transfer.host_reads or not current_platform.is_cpu():
            return None
        return SharedCacheAllocation()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self._vllm_config.model_config
        first = next(iter(kv_caches.values()))
        spec = cache_spec(first.shape, first.dtype, model.get_head_size(),
                          model.get_num_kv_heads(self._vllm_config.parallel_config),
                          self._num_head_slots())
        num_blocks, block_size = first.shape[0], spec.block_size
        name = self._settings.model_id or _served_name(self._vllm_config)
        rank, tp_size = _tp_rank(), self._vllm_config.parallel_config.tensor_parallel_size
        # the instance's heads: each rank holds an equal share (_refuse_unsupported)
        total_kv_heads = spec.num_kv_heads * tp_size
        compat = CompatInfo(model=name, dtype=str(model.dtype).removeprefix("torch."),
                            cache_dtype=str(first.dtype).removeprefix("torch."),
                            head_size=spec.head_size, total_kv_heads=total_kv_heads,
                            num_layers=len({v.data_ptr() for v in kv_caches.values()}),
                            kv_packing=self._packing(spec))
        self._worker = WorkerSide(self._settings, _engine_id(self._vllm_config), compat,
                                  rank=rank, tp_size=tp_size, total_kv_heads=total_kv_heads)
        self._worker.register(kv_caches, spec, num_blocks)
        log.info("kvxfer: rank %d of %d: %d layers of %d blocks x %d tokens registered; side "
                 "channel on port %d", rank, tp_size, compat.num_layers, num_blocks,
                 block_size, self._worker.port)

    def _num_head_slots(self) -> int | None:
        """The head-slot form the backend gave the cache (its ``customize_spec`` set it on
        the group's spec); None, one slot per KV head, when vLLM passed no cache config."""
        if self._kv_cache_config is None:
            return None
        groups = self._kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"KvxferConnector supports one KV cache group for now; this "
                             f"model has {len(groups)} (a hybrid model): use NixlConnector")
        return getattr(groups[0].kv_cache_spec, "num_head_slots", None)

    def _packing(self, spec: CacheSpec) -> str:
        """vLLM's CPU kernels keep a head's K and V their own way per instruction set; every
        other backend keeps each token's K then its V (or K and V as slots of their own)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or spec.separate_kv_head_groups:
            return TOKEN_PACKING
        return _cpu_packing(self._vllm_config.model_config.dtype, spec.block_size,
                            spec.head_size, self._vllm_config.cache_config.cache_dtype)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None if self._worker is None else KvxferHandshakeMetadata(self._worker.port)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvxferConnectorMetadata) and self._worker is not None
        self._worker.apply(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM schedules a request once its load ended

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # pull mode: the decode reads the blocks where the forward left them

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        assert self._worker is not None
        result = self._worker.poll(finished_req_ids)
        self._load_errors |= result.error_blocks
        self._step = result
        return result.sending or None, result.recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call; vLLM asks right after
        ``get_finished`` in the same step, as its contract requires."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        result, self._step = self._step, None
        if result is None or not (result.reads or result.failures):
            return None
        return KvxferStats(data={
            "transfer_duration": [r.transfer_seconds for r in result.reads],
            "read_duration": [r.seconds for r in result.reads],
            "bytes_transferred": [r.num_bytes for r in result.reads],
            "num_descriptors": [r.descriptors for r in result.reads],
            "num_failed_transfers": result.failures})

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # -- scheduler side -----------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        assert self._scheduler is not None
        self._scheduler.set_side_channel_ports(
            {rank: meta.side_channel_port for rank, meta in metadata.items()
             if isinstance(meta, KvxferHandshakeMetadata)})

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return SchedulerSide.matched_tokens(request.kv_transfer_params,
                                            request.num_prompt_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        params = request.kv_transfer_params
        group = blocks.blocks[0] if blocks.blocks else []
        refs = [BlockRef(b.block_id, b.block_hash is not None) for b in group if not b.is_null]
        self._scheduler.after_alloc(request.request_id, params, request.num_prompt_tokens,
                                    refs, num_external_tokens)
        if params and params.get("do_remote_decode"):
            self._producing[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        scheduled = {rid: (self._producing[rid].num_computed_tokens, count)
                     for rid, count in scheduler_output.num_scheduled_tokens.items()
                     if rid in self._producing}
        plan = self._scheduler.build_plan(scheduled, self._block_ids)
        for hold in plan.holds:
            self._producing.pop(hold.request_id, None)
        return KvxferConnectorMetadata(plan)

    def _block_ids(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self._scheduler is not None
        self._producing.pop(request.request_id, None)
        completed = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                       RequestStatus.FINISHED_STOPPED)
        return self._scheduler.finished(request.request_id, request.kv_transfer_params,
                                        completed)

    # -- statistics ---------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvxferStats(data=data) if data is not None else KvxferStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _cpu_packing(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """How vLLM's CPU attention kernels store K and V here: they pick an instruction set
    (``vec``, ``vec16``, ``amx``, ...) per dtype and machine, and each stores a head's
    block its own way (``vec``: K transposed, then V), so peers must use the same one."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return f"{VLLM_CPU_PACKING_PREFIX}{_get_attn_isa(dtype, block_size, head_size, cache_dtype)}"


def _tp_rank() -> int:
    """This worker's rank in its TP group."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _served_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    return str(name[0] if isinstance(name, list | tuple) else name)

