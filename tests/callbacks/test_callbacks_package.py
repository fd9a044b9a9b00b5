"""The package as a whole: no import cycles, the same exports, UserWarnings only, doctests."""

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


def imported_modules(path: Path, module: str) -> list[str]:
    """Every module `path` imports, anywhere in it: top level, inside functions and under
    `if TYPE_CHECKING:` (relative imports resolved against `module`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from pkg import sub` imports the submodule when there is one.
            found += [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                      for a in node.names]
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def callback_modules() -> dict[str, Path]:
    modules = {NAME: PACKAGE / "__init__.py"}
    for info in pkgutil.iter_modules([str(PACKAGE)]):
        modules[f"{NAME}.{info.name}"] = PACKAGE / f"{info.name}.py"
    return modules


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_the_callbacks_package():
    """Regression: base.py imported history.py and progress.py (inside a function) while they
    imported base.py. Submodules import siblings, never the package or top-level fitdp."""
    modules = callback_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        imports = imported_modules(path, module)
        if module != NAME:
            bad = [m for m in imports if m in ("fitdp", NAME)]
            assert not bad, f"{module} imports {bad}: import the sibling module instead"
        graph[module] = {m for m in imports if m in modules}
    assert find_cycle(graph) is None, find_cycle(graph)
    assert "fitdp.callbacks.callback_list" in graph["fitdp.callbacks"]


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
