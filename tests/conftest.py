"""Shared test configuration.

Tests marked ``cuda`` run wherever ``torch.cuda.is_available()`` is true and are
skipped only where it is false.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
