"""The span probe's descriptors (:mod:`kvxfer.plan.span_probe`): a read's bytes as whole
spans of registered memory, each inside one registration, executed by the reference
memcpy executor of the descriptor tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_descriptors import LAYOUTS, Rank, execute, make_rank

from kvxfer.plan.layout import CacheSpec, KVCacheLayout
from kvxfer.plan.span_probe import memory_spans, span_descriptors

SPEC = CacheSpec(16, 2, 8, torch.float32)
BLOCKS, LAYERS = 6, 3


def rank(layout: KVCacheLayout, separate: bool, seed: int) -> Rank:
    return make_rank(SPEC, layout, BLOCKS, LAYERS, separate, np.random.default_rng(seed))


def memory(side: Rank) -> np.ndarray:
    """The registered bytes in address order."""
    return np.concatenate([raw.numpy() for raw in sorted(side.buffers,
                                                         key=lambda r: r.data_ptr())])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_storage_is_read_as_one_descriptor(layout: KVCacheLayout) -> None:
    local, remote = rank(layout, False, 1), rank(layout, False, 2)
    (span,) = memory_spans(local.geometry)
    assert span[1] == local.buffers[0].numel()  # the whole allocation
    num_bytes = 2 * LAYERS * SPEC.page_size_bytes  # two blocks of every layer
    descs = span_descriptors(local.geometry, remote.geometry, num_bytes)
    assert len(descs) == 1 and descs.num_bytes == num_bytes
    execute(local, remote, descs.local, descs.remote)
    assert np.array_equal(memory(local)[:num_bytes], memory(remote)[:num_bytes])


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LHBNC])
def test_a_storage_per_layer_costs_a_descriptor_per_layer_crossed(layout: KVCacheLayout
                                                                  ) -> None:
    local, remote = rank(layout, True, 3), rank(layout, False, 4)
    layer_bytes = BLOCKS * SPEC.page_size_bytes
    assert [length for _, length, _ in memory_spans(local.geometry)] == [layer_bytes] * LAYERS
    num_bytes = layer_bytes + layer_bytes // 2
    descs = span_descriptors(local.geometry, remote.geometry, num_bytes)
    assert descs.local[:, 1].tolist() == [layer_bytes, layer_bytes // 2]
    assert (descs.local[:, 1] == descs.remote[:, 1]).all()
    execute(local, remote, descs.local, descs.remote)  # each row inside one registration
    spans = memory_spans(local.geometry)
    order = sorted(range(LAYERS), key=lambda i: local.buffers[i].data_ptr())
    landed = np.concatenate([local.buffers[i].numpy() for i in order])
    assert spans[0][0] == local.buffers[order[0]].data_ptr()
    assert np.array_equal(landed[:num_bytes], memory(remote)[:num_bytes])


def test_more_bytes_than_registered_are_refused() -> None:
    local, remote = rank(KVCacheLayout.LBHNC, False, 5), rank(KVCacheLayout.LBHNC, False, 6)
    total = local.buffers[0].numel()
    assert len(span_descriptors(local.geometry, remote.geometry, total)) == 1
    with pytest.raises(ValueError, match=r"registered .* fewer than"):
        span_descriptors(local.geometry, remote.geometry, total + 1)
    with pytest.raises(ValueError, match="zero or more bytes"):
        span_descriptors(local.geometry, remote.geometry, -1)


def test_a_read_starts_where_it_is_asked_and_moves_back_to_fit() -> None:
    local, remote = rank(KVCacheLayout.LBHNC, False, 7), rank(KVCacheLayout.LBHNC, False, 8)
    (span,), page = memory_spans(local.geometry), SPEC.page_size_bytes
    (remote_span,) = memory_spans(remote.geometry)
    descs = span_descriptors(local.geometry, remote.geometry, 4 * page,
                                local_start=span[0] + 2 * page,
                                remote_start=remote_span[0] + 5 * page)
    assert descs.local[:, :2].tolist() == [[span[0] + 2 * page, 4 * page]]
    assert descs.remote[:, :2].tolist() == [[remote_span[0] + 5 * page, 4 * page]]
    end = remote_span[0] + remote_span[1]  # too close to the end: moved back to fit
    descs = span_descriptors(local.geometry, remote.geometry, 4 * page,
                                remote_start=end - page)
    assert descs.remote[:, :2].tolist() == [[end - 4 * page, 4 * page]]
    execute(local, remote, descs.local, descs.remote)
    with pytest.raises(ValueError, match="outside its registered memory"):
        span_descriptors(local.geometry, remote.geometry, page, local_start=span[0] - 1)


def test_a_start_in_a_later_storage_crosses_into_the_next() -> None:
    local, remote = rank(KVCacheLayout.LBHNC, True, 9), rank(KVCacheLayout.LBHNC, False, 10)
    spans, page = memory_spans(local.geometry), SPEC.page_size_bytes
    descs = span_descriptors(local.geometry, remote.geometry, 2 * page,
                                local_start=spans[0][0] + (BLOCKS - 1) * page)
    assert descs.local[:, :2].tolist() == [[spans[0][0] + (BLOCKS - 1) * page, page],
                                           [spans[1][0], page]]
    execute(local, remote, descs.local, descs.remote)
