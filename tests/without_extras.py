"""A pytest plugin that runs the tests as a base install would (issue 39 item 6): every
optional extra of ``pyproject.toml`` imports as missing, so a test that needs one must skip
(``pytest.importorskip``), never fail with ``ModuleNotFoundError``.

Run: ``python -m pytest -p tests.without_extras tests/data/test_loader_resume.py``.

torchmetrics (a base dependency) imports some extras at its own import when their packages
are installed (it reads the installed distributions, which no import hook can hide); it is
imported first, and the extras are hidden from everything imported after it.
"""

from __future__ import annotations

import sys

import pytest

# A None in sys.modules makes `import` raise ModuleNotFoundError (its submodules too),
# which pytest.importorskip turns into a skip.
EXTRAS = ("torchdata", "transformers", "datasets", "tokenizers", "mlflow", "keras", "onnx",
          "onnxscript", "onnxruntime", "tensorboard", "matplotlib", "mkdocs", "mkdocstrings",
          "mkdocstrings_handlers", "safetensors", "lightning", "torchvision")


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module is imported."""
    import torchmetrics  # noqa: F401 - see the module docstring

    for name in EXTRAS:
        sys.modules[name] = None  # type: ignore[assignment]
