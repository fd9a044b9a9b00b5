"""No import cycles anywhere in fitdp: every import counts, function-local and
TYPE_CHECKING ones too, so the layers stay a stack (issue 9). ``import fitdp`` loads nothing
heavy beyond its core dependencies (issue 30 item 10)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import fitdp

ROOT = Path(fitdp.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the fitdp modules it imports (a ``from pkg import name`` counts as the
    submodule ``pkg.name`` when that is a module, else as ``pkg``)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.split(".")[0] == "fitdp"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                if base.split(".")[0] != "fitdp":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.add(sub if sub in files else base)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_fitdp():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_detector_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# What a call loads when it needs it (FSDP2, DTensor, distributed checkpointing, torchrun's
# error files, compilation, the optional integrations), never ``import fitdp``.
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp",
         "torch.distributed.elastic", "torch._dynamo", "sympy", "transformers", "onnx",
         "onnxscript", "matplotlib", "tensorboard", "torch.utils.tensorboard", "mlflow",
         "torchdata", "keras", "pandas", "scipy")


def test_import_fitdp_loads_nothing_heavy_beyond_torch_and_torchmetrics():
    """torch.distributed.checkpoint and DTensor were loaded at ``import fitdp`` (about 1.3 s)."""
    probe = ("import json, sys\n"
             "import torch, torchmetrics\n"
             "core = set(sys.modules)\n"
             "import fitdp\n"
             "print(json.dumps([fitdp.__file__, sorted(core), sorted(set(sys.modules) - core)]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT.parent, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    where, core, added = json.loads(out.splitlines()[-1])
    assert Path(where).resolve().parent == ROOT  # this checkout's fitdp, not an installed one
    heavy = sorted({h for h in HEAVY for m in added if m == h or m.startswith(h + ".")})
    assert heavy == [], f"import fitdp loaded {heavy}: import them where they are used"
    # Of torchmetrics, only what ``import torchmetrics`` loads (no extra submodule).
    assert [m for m in added if m.split(".")[0] == "torchmetrics"] == []
    # torchmetrics itself loads matplotlib, transformers and scipy when they are installed
    # (its plotting and BERTScore): they count in the reference, as torchmetrics does. These
    # must not be there at all.
    absent = {"torch.distributed.checkpoint", "torch.distributed.tensor",
              "torch.distributed.fsdp", "onnx", "tensorboard", "mlflow"}
    assert absent.isdisjoint(core + added)
