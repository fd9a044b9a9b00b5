"""Test tiers: tests marked ``requires_cuda`` run wherever a CUDA GPU is present.

Hypothesis profiles: "ci" (the default) draws few examples in a fixed order, so a CI run is
stable; ``pytest --hypothesis-profile=long`` draws many, randomly (docs/design.md, "The
equivalence harness"). Tests that set ``max_examples`` themselves keep their count.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          database=None, suppress_health_check=_SLOW_OK)
settings.register_profile("long", max_examples=300, deadline=None, database=None,
                          suppress_health_check=_SLOW_OK)
settings.load_profile("ci")  # --hypothesis-profile=NAME loads NAME after this


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the CUDA tier)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
