"""Bitwise equality of nested states (tensors, dicts, lists), shared by the checkpoint and
reproducible-mode tests."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Recursive equality that also checks tensor dtypes and container types."""
    assert type(actual) is type(expected) or (
        isinstance(actual, dict) and isinstance(expected, dict)
    ), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where
