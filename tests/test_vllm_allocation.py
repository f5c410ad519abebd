"""KvxferConnector's allocation context (:mod:`kvxfer.vllm.allocation`): vLLM's CPU cache
buffer comes out shared, writable and zeroed, and nothing else vLLM allocates inside the
context changes. That real vLLM allocates through it, and a decode then copies from the
mapped cache, is tests_vllm/test_kvxfer_connector.py's."""

from __future__ import annotations

import ctypes
import mmap

import torch

from kvxfer.plan.regions import MemoryRegion
from kvxfer.transfer.converted.mapped_reads import shared_regions
from kvxfer.vllm.allocation import SharedCacheAllocation

NBYTES = 3 * 4096 + 128  # past a page, as vLLM sizes it (not rounded)


def offered(tensor: torch.Tensor) -> bool:
    region = MemoryRegion(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    return bool(shared_regions([region]))


def test_the_cache_buffer_is_shared_zeroed_and_writable() -> None:
    context = SharedCacheAllocation()
    with context:  # as vllm.v1.worker.utils.allocate_kv_cache allocates it
        buffer = torch.zeros(NBYTES, dtype=torch.int8, device=torch.device("cpu"))
        views = buffer.view(torch.float16)[: NBYTES // 4].view(2, -1)
    assert buffer.dtype == torch.int8 and buffer.shape == (NBYTES,)
    assert offered(buffer) and context.shared == [NBYTES]
    assert not buffer.any()
    views.fill_(1.5)
    assert offered(views) and float(views.sum()) == 1.5 * views.numel()
    assert context.shared == [NBYTES]  # the views made nothing else shared


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(pages in memory, pages) of the whole pages ``tensor``'s bytes lie in (mincore)."""
    start = tensor.data_ptr() & ~(mmap.PAGESIZE - 1)
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = -(-(end - start) // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, end - start, vector) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector), pages


def test_the_cache_buffer_is_in_memory_from_the_start() -> None:
    """As vLLM's own torch.zeros leaves it: no page faults in the first forward passes."""
    with SharedCacheAllocation():
        buffer = torch.zeros(64 * mmap.PAGESIZE, dtype=torch.int8)
    resident, pages = resident_pages(buffer)
    assert resident == pages >= 64


def test_only_the_cache_allocation_is_shared() -> None:
    context = SharedCacheAllocation()
    with context:
        others = [torch.zeros(NBYTES, dtype=torch.float16),          # another dtype
                  torch.zeros(2, NBYTES, dtype=torch.int8),           # another shape
                  torch.zeros(NBYTES, dtype=torch.int8, requires_grad=False),  # more kwargs
                  torch.empty(NBYTES, dtype=torch.int8),               # another call
                  torch.zeros(NBYTES, dtype=torch.int8, device="meta")]  # another device
    assert context.shared == []
    assert not any(offered(t) for t in others if t.device.type == "cpu")
    with context:
        assert offered(torch.zeros(NBYTES, dtype=torch.int8, device="cpu"))
        assert offered(torch.zeros(NBYTES, dtype=torch.int8))  # the default device
    assert context.shared == [NBYTES, NBYTES]
