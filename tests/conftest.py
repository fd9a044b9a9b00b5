"""Test tiers: tests marked ``requires_cuda`` run wherever a CUDA GPU is present."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the CUDA tier)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
