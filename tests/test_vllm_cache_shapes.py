"""``kvxfer.vllm.cache_shapes``: a vLLM layer view's head-slot form, named by the backend's
``num_head_slots`` (pure; the views themselves, from vLLM's classes, are read in the vLLM
tier's ``test_backend_shapes``)."""

from __future__ import annotations

import pytest
import torch

from kvxfer.plan.layout import CacheSpec
from kvxfer.vllm.cache_shapes import cache_spec

F16 = torch.float16


@pytest.mark.parametrize(("shape", "slots", "want"), [
    ((9, 4, 16, 16), None, CacheSpec(16, 4, 8, F16)),
    ((9, 8, 16, 8), 8, CacheSpec(16, 4, 8, F16, separate_kv_head_groups=True)),
    ((9, 2, 16, 32), 2, CacheSpec(16, 1, 32, F16, separate_kv_head_groups=True)),
])
def test_each_form_is_planned_as_its_heads(shape: tuple[int, ...], slots: int | None,
                                           want: CacheSpec) -> None:
    assert cache_spec(shape, F16, 8, 4, slots) == want


def test_the_declared_slots_tell_apart_forms_of_one_shape() -> None:
    """Two KV heads of 8: [B, 2, N, 16] is K and V per token, or a K and a V slot."""
    packed = cache_spec((9, 2, 16, 16), F16, 8, 2, None)
    groups = cache_spec((9, 2, 16, 16), F16, 8, 2, 2)
    assert (packed.num_kv_heads, packed.separate_kv_head_groups) == (2, False)
    assert (groups.num_kv_heads, groups.head_size, groups.separate_kv_head_groups) == \
        (1, 16, True)


@pytest.mark.parametrize(("shape", "slots", "says"), [
    ((9, 4, 16, 8), None, "that needs [B, 4, N, 16]"),
    ((9, 4, 16, 16), 8, "that needs [B, 8, N, 8]"),
    ((9, 4, 16, 16), 3, "declares num_head_slots=3"),
    ((9, 4, 16), None, "got a view of shape [9, 4, 16]"),
])
def test_a_view_that_does_not_hold_its_form_is_refused_naming_it(
        shape: tuple[int, ...], slots: int | None, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        cache_spec(shape, F16, 8, 4, slots)
    assert says in str(caught.value), str(caught.value)
