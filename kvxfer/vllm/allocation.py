"""vLLM's KV cache allocated in memory a decode on this host can map.

:class:`SharedCacheAllocation`, KvxferConnector's ``get_mem_pool_context``, makes the one
buffer vLLM allocates a shared one (``shared_zeros``, zeroed on the spot); every other call,
dtype and device passes through. No vLLM import here.

Design: docs/design/vllm-connector.md#a-cache-a-decode-on-this-host-can-map
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvxfer.transfer.converted.mapped_reads import shared_zeros


def cache_buffer_bytes(func: Callable[..., Any], args: Sequence[Any],
                       kwargs: Mapping[str, Any]) -> int | None:
    """The size of the buffer ``func(*args, **kwargs)`` allocates when it is vLLM's cache
    allocation on the CPU (``torch.zeros(n, dtype=torch.int8)``), else None."""
    if func is not torch.zeros or len(args) != 1 or not isinstance(args[0], int):
        return None
    if kwargs.get("dtype") is not torch.int8 or set(kwargs) - {"dtype", "device"}:
        return None
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return None
    return args[0]


class SharedCacheAllocation(TorchFunctionMode):
    """While active, vLLM's CPU cache allocation (:func:`cache_buffer_bytes`) returns a
    buffer from :func:`shared_zeros` (plain memory where this system has no memfd);
    ``shared`` lists the sizes it allocated so."""

    def __init__(self) -> None:
        super().__init__()
        self.shared: list[int] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        nbytes = cache_buffer_bytes(func, args, kwargs)
        if nbytes is None:
            return func(*args, **kwargs)
        buffer = shared_zeros(nbytes).view(torch.int8)
        buffer.zero_()  # in memory now, as torch.zeros's pages are: no fault in a forward
        self.shared.append(nbytes)
        return buffer
