"""Keras 3 (torch backend) for the side-by-side parity tests, when it is installed."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest


@pytest.fixture(scope="session")
def keras() -> Any:
    """The `keras` module on its torch backend; the test is skipped without Keras (the
    optional `parity` extra; the `test` extra installs it). Imported once per session: it
    takes seconds. A ``KERAS_BACKEND`` set in the environment is overridden: the twins
    compare against Keras on torch."""
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "torch"
    module = pytest.importorskip("keras")
    if module.backend.backend() != "torch":
        pytest.fail(f"Keras was imported on the {module.backend.backend()!r} backend before "
                    "the parity tests ran; the twins need 'torch'. Fix: run them with "
                    "KERAS_BACKEND=torch, or in their own pytest process.")
    return module
