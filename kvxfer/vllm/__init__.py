"""kvxfer inside vLLM: the ``KvxferConnector`` KV connector (the only package that
imports vLLM; ``import kvxfer`` never does).

``"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm"``
loads it; see :mod:`kvxfer.vllm.connector` for what it supports and
:mod:`kvxfer.vllm.extra_config` for its ``kv_connector_extra_config`` keys.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KvxferConnector"]


def __getattr__(name: str) -> Any:
    # Imported on first access (vLLM's loader does getattr(module, "KvxferConnector")),
    # so the pure submodules (settings, scheduler, plan) import without vLLM.
    if name == "KvxferConnector":
        return importlib.import_module("kvxfer.vllm.connector").KvxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
