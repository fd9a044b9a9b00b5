"""The package as a whole: the same exports, UserWarnings only, doctests (import cycles:
tests/test_imports.py, for all of fitdp)."""

from __future__ import annotations

import ast
import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import fitdp.callbacks

PACKAGE = Path(fitdp.callbacks.__file__).parent
NAME = "fitdp.callbacks"


def callback_modules() -> dict[str, Path]:
    modules = {NAME: PACKAGE / "__init__.py"}
    for info in pkgutil.iter_modules([str(PACKAGE)]):
        modules[f"{NAME}.{info.name}"] = PACKAGE / f"{info.name}.py"
    return modules


def test_the_package_exports_the_same_names():
    old = {"HOOKS", "BackupAndRestore", "CSVLogger", "Callback", "CallbackList",
           "EarlyStopping", "History", "LambdaCallback", "LearningRateScheduler",
           "ModelCheckpoint", "ProgressBar", "ReduceLROnPlateau", "Speedometer", "TensorBoard",
           "TerminateOnNaN"}
    assert old <= set(fitdp.callbacks.__all__)
    assert all(hasattr(fitdp.callbacks, name) for name in fitdp.callbacks.__all__)


def test_every_warning_is_a_user_warning():
    """Users' `filterwarnings("error", category=UserWarning)` must catch every warning the
    callbacks emit (several were RuntimeWarnings)."""
    calls = []
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
                category = next((k.value for k in node.keywords if k.arg == "category"),
                                node.args[1] if len(node.args) > 1 else None)
                calls.append((path.name, node.lineno, category and ast.unparse(category)))
    assert calls, "expected the monitored-value and checkpoint warnings"
    assert all(category == "UserWarning" for _, _, category in calls), calls


@pytest.mark.parametrize("module", sorted(callback_modules()))
def test_docstring_examples_run(module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
