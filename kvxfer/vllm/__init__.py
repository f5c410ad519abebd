"""kvxfer inside vLLM: the ``KvxferConnector`` KV connector (the only package that
imports vLLM; ``import kvxfer`` never does).

``"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm"``
loads it. Modules:

- ``connector``: ``KvxferConnector``, vLLM's hooks (what it supports, what it refuses);
- ``extra_config``: its ``kv_connector_extra_config`` keys (the ``TransferConfig`` fields
  and three of vLLM's own);
- ``scheduler_side``: what the scheduler decides per step (leases, loads);
- ``worker_side``: one rank's transfers in a worker process (no vLLM import);
- ``step_plan``: what the scheduler hands its workers each step;
- ``cache_shapes``: the layer views every vLLM attention backend hands a connector;
- ``allocation``: the CPU cache allocated in shared memory, for readers on this host.

Design: docs/design/vllm-connector.md
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KvxferConnector"]


def __getattr__(name: str) -> Any:
    # Imported on first access (vLLM's loader does getattr(module, "KvxferConnector")),
    # so the pure submodules (extra_config, scheduler_side, step_plan) import without vLLM.
    if name == "KvxferConnector":
        return importlib.import_module("kvxfer.vllm.connector").KvxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
