"""No fitdp module reads or writes another fitdp module's private fields (issue 18 item 5:
model_io read ``model._replicas`` and ``model._sync_host``, replicas.py wrote
``trainer.scaler``): a private name (``_x``) may be reached through ``self``/``cls`` or, for
objects of its own file, by any name; from any other file only through a public name."""

from __future__ import annotations

import ast
from pathlib import Path

import fitdp

ROOT = Path(fitdp.__file__).resolve().parent
# torch.nn.Module's own tables, which bucket sharing writes as torch's docs do (a fitdp class
# may use the same name for a field of its own), and the mark an LR scheduler's patched
# ``optimizer.step`` leaves (the sharded step writes it as that patch does; the scheduler
# steps read it as torch's order warning does).
TORCH_FIELDS = {"_parameters", "_buffers", "_modules", "_opt_called"}


def private_names(tree: ast.AST, *, own: bool = False) -> set[str]:
    """The private names a file defines: functions, classes, class fields, ``self._x = ...``
    (and ``other._x = ...``, unless ``own``: that may be another library's field)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and not (
                own and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls"))):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def reached(node: ast.AST) -> tuple[ast.AST | None, str | None]:
    """The object and attribute name ``node`` reaches: ``x._a``, or ``getattr(x, "_a", ...)``
    / ``setattr(x, "_a", ...)`` / ``hasattr(x, "_a")`` spelled with a constant name."""
    if isinstance(node, ast.Attribute):
        return node.value, node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[0], node.args[1].value
    return None, None


def foreign_private_access(files: dict[str, ast.AST]) -> list[str]:
    defined = {name: private_names(tree) for name, tree in files.items()}
    everywhere = set().union(*defined.values()) - TORCH_FIELDS
    found = []
    for name, tree in files.items():
        for node in ast.walk(tree):
            target, attr = reached(node)
            if attr not in everywhere or attr in defined[name]:
                continue
            if isinstance(target, ast.Name) and target.id in ("self", "cls"):
                continue
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_private_fields():
    files = {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in ROOT.rglob("*.py")}
    assert foreign_private_access(files) == []


def test_the_check_sees_a_foreign_private_read():
    files = {
        "a.py": ast.parse("class Model:\n    def __init__(self):\n        self._replicas = 1\n"),
        "b.py": ast.parse("def save(model):\n    return model._replicas\n"),
    }
    assert foreign_private_access(files) == ["b.py:2: model._replicas"]


def test_the_check_sees_a_foreign_private_read_through_getattr():
    """Regression: a callback read ``getattr(self.model, "_replicas", None)``."""
    files = {
        "a.py": ast.parse("class Model:\n    def __init__(self):\n        self._replicas = 1\n"),
        "b.py": ast.parse("def save(cb):\n    return getattr(cb.model, '_replicas', None)\n"),
    }
    assert foreign_private_access(files) == ["b.py:2: getattr(cb.model, '_replicas', None)"]


# The flag an LR scheduler's patched ``optimizer.step`` sets (torch's scheduler contract, no
# public form): the sharded step calls the class's step per shard and records it the same way.
TORCH_STEP_FLAG = {"_opt_called"}


def foreign_private_writes(files: dict[str, ast.AST]) -> list[str]:
    """Writes to a private field no fitdp object has: another library's internals."""
    owned = (set().union(*(private_names(t, own=True) for t in files.values())) | TORCH_FIELDS
             | TORCH_STEP_FLAG)
    found = []
    for name, tree in files.items():
        for node in ast.walk(tree):
            target, attr = reached(node)
            stored = (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      or isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr")
            if (stored and attr and attr.startswith("_") and not attr.startswith("__")
                    and attr not in owned):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_writes_another_librarys_private_fields():
    """Regression (issue 28 item 14): a resume wrote torchmetrics' private ``_update_count``
    and ``_computed``; another library's internals change without notice (the ecosystem
    rule), so fitdp goes through their public API."""
    files = {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in ROOT.rglob("*.py")}
    assert foreign_private_writes(files) == []


def test_the_check_sees_a_foreign_private_write():
    files = {"a.py": ast.parse("def load(m, n):\n    m._update_count = n\n"
                               "    setattr(m, '_computed', None)\n    m._own = 1\n"),
             "b.py": ast.parse("class Own:\n    def __init__(self):\n        self._own = 0\n")}
    assert foreign_private_writes(files) == ["a.py:2: m._update_count",
                                             "a.py:3: setattr(m, '_computed', None)"]
