"""The rank object: the one module above the executor that talks to other ranks, and
checking a call's arguments joins no process group (issue 18 item 3)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fitdp
from fitdp.call.plan import plan_call
from fitdp.call.ranks import Ranks

ROOT = Path(fitdp.__file__).resolve().parent
# Where fitdp may import torch.distributed: the rank object and the executor's engines.
ALLOWED = ("call/ranks.py", "executor/")


def distributed_imports(path: Path) -> list[int]:
    """Lines of ``path`` that import torch.distributed (any spelling, any depth)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_rank_object_and_the_executor_import_torch_distributed():
    found = {str(p.relative_to(ROOT)): distributed_imports(p) for p in ROOT.rglob("*.py")}
    above = {p: lines for p, lines in found.items() if lines and not p.startswith(ALLOWED)}
    assert not above, f"torch.distributed imported above the executor: {above}"
    assert found["call/ranks.py"]  # the check sees the rank object's own import


def test_the_import_check_sees_every_spelling(tmp_path):
    code = ("import torch.distributed as dist\nfrom torch.distributed import barrier\n"
            "from torch import distributed\nimport torch.distributed.checkpoint\nimport os\n")
    (tmp_path / "m.py").write_text(code)
    assert distributed_imports(tmp_path / "m.py") == [1, 2, 3, 4]


def test_checking_arguments_joins_no_process_group(monkeypatch):
    """Regression: plan_call/plan_fit joined torchrun's process group while checking
    arguments (a side effect of a check); now the call joins when it attaches."""
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)

    def refuse(*args, **kwargs):
        raise AssertionError("checking arguments joined a process group")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    model = fitdp.Model(nn.Linear(3, 2))
    plan = plan_call(model, torch.randn(8, 3), None, None, batch_size=2, verbose=0,
                     callbacks=None, steps=None, devices=["cpu"], has_labels=False)
    assert plan.ranks == Ranks(rank=1, world_size=2, local_rank=1)
    assert not model.is_main_process
    assert plan.amounts == (("x", {"samples": 8, "batches": 2}),)  # 2 steps of 2 x 2 rows
    assert not dist.is_initialized()
    with pytest.raises(AssertionError, match="joined a process group"):
        plan.join()  # attaching joins


def test_one_process_collectives_are_the_identity():
    ranks = Ranks()
    t = torch.arange(3.0)
    assert ranks.all_reduce_sum(t) is t and t.tolist() == [0.0, 1.0, 2.0]
    assert ranks.gather_rows([(0, None, 1)]) == [(0, None, 1)]
    ranks.check_even("x", {"samples": 1})
    ranks.barrier()
    ranks.join([torch.device("cpu")], 1.0)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="timeout: got 0"):
        ranks.join([torch.device("cpu")], 0)


def test_a_caught_failure_made_every_later_exit_skip_the_leaving_barrier(monkeypatch, capsys):
    """Regression: a failure reported in one call (and caught by the user) stayed recorded
    for the process, so after later calls that ran fine the rank left the group at exit
    without the barrier that keeps gloo from aborting while a peer still talks to it."""
    from fitdp.call import ranks as ranks_module

    met: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: met.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: met.append("left"))
    monkeypatch.setattr(ranks_module, "_failed", False)
    ranks = Ranks(rank=0, world_size=2)
    ranks.report_failure(ValueError("a bad batch"))  # the first call fails; the user goes on
    assert "fitdp: rank 0 (local 0) failed" in capsys.readouterr().err
    ranks_module._leave()
    assert met == ["left"]  # exiting right after the failure: no barrier
    met.clear()
    ranks.join([torch.device("cpu")], 1.0)  # the next call joins and runs fine
    ranks_module._leave()
    assert met == ["barrier", "left"]
