"""kvxfer inside vLLM: the ``KvxferConnector`` KV connector (the only package that
imports vLLM; ``import kvxfer`` never does).

``"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm"``
loads it; see :mod:`kvxfer.vllm.connector` for what it supports and
:mod:`kvxfer.vllm.settings` for its ``kv_connector_extra_config`` keys.
"""

from kvxfer.vllm.connector import KvxferConnector

__all__ = ["KvxferConnector"]
