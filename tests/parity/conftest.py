"""Keras 3 (torch backend) for the side-by-side parity tests, when it is installed."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest


@pytest.fixture(scope="session")
def keras() -> Any:
    """The `keras` module on its torch backend; the test is skipped without Keras (the
    optional `parity` extra). Imported once per session: it takes seconds."""
    if "keras" not in sys.modules:
        os.environ.setdefault("KERAS_BACKEND", "torch")
    module = pytest.importorskip("keras")
    if module.backend.backend() != "torch":
        pytest.skip(f"Keras runs on {module.backend.backend()!r}; the twins need 'torch'")
    return module
