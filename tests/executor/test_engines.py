"""The engine interface (issue 30, item 1): one engine per call's replicas, each engine's torch
types in its own file, and its state owned by the engine object, not the process.
tests/distributed/test_strategy.py runs the DDP and FSDP2 engines under torchrun."""

from __future__ import annotations

import ast
import inspect
import typing
import weakref
from pathlib import Path

import torch
from torch import nn

import fitdp
from fitdp.call import replicas
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager
from fitdp.executor.engine import Engine, EngineOptions
from fitdp.executor.engines import ENGINES, engine_for
from fitdp.executor.local_reduce import LocalReduce
from fitdp.executor.update import UpdateOptions

ROOT = Path(fitdp.__file__).resolve().parent


def engine_class(options: type[EngineOptions]) -> type[Engine]:
    """The engine class a registered strategy's options make (their ``engine``'s return)."""
    return typing.get_type_hints(options.engine)["return"]


# The registry is the list of engines: each strategy's options class, its engine class and
# the file that holds them (ENGINES in fitdp/executor/engines.py).
OPTIONS = {o.__name__ for o in ENGINES.values()}
ENGINE_FILES = {Path(inspect.getfile(o)).relative_to(ROOT).as_posix() for o in ENGINES.values()}
# The names of torch's engine types and calls (DDP's, FSDP2's, DTensor's, ZeRO's) and fitdp's.
TORCH_NAMES = {"DistributedDataParallel", "DTensor", "FSDPModule", "fully_shard",
               "distribute_tensor", "MixedPrecisionPolicy", "full_tensor", "to_local",
               "require_backward_grad_sync", "ZeroRedundancyOptimizer"}
ENGINE_NAMES = OPTIONS | {engine_class(o).__name__ for o in ENGINES.values()} | TORCH_NAMES
SHARDED_SAVING = "executor/sharded_io.py"  # reads a shard where it is (``to_local``)
# Where fitdp's options objects may be named besides: the registry, and the public names
# ``fitdp.DDP``/``fitdp.FSDP``.
OPTIONS_FILES = {"executor/engines.py", "__init__.py"}


def names(path: Path) -> list[tuple[str, int, bool]]:
    """(identifier, line, whether it is an ``isinstance`` class argument) of every name,
    attribute and import alias in ``path``."""
    found = []
    tree = ast.parse(path.read_text())
    tested = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call)
              and isinstance(call.func, ast.Name) and call.func.id in ("isinstance", "issubclass")
              and len(call.args) == 2 for n in ast.walk(call.args[1])}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.append((node.id, node.lineno, id(node) in tested))
        elif isinstance(node, ast.Attribute):
            found.append((node.attr, node.lineno, id(node) in tested))
        elif isinstance(node, ast.alias):
            found.append((node.asname or node.name.rsplit(".")[-1], node.lineno, False))
    return found


def test_engine_types_are_named_only_in_their_engine_files():
    """Engines were flags: DDP/FSDP2/DTensor types and tests of them spread over six files
    (manager, replicas, update, sharded_io, ...). Now the step asks no engine what it is."""
    found: dict[str, list[tuple[str, int]]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ENGINE_FILES:
            continue
        for name, line, in_isinstance in names(path):
            allowed = (rel == SHARDED_SAVING and name == "to_local") or (
                name in OPTIONS and rel in OPTIONS_FILES and not in_isinstance)
            if name in ENGINE_NAMES and not allowed:
                found.setdefault(rel, []).append((name, line))
    assert not found, f"engine types named outside the engine files: {found}"
    named = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
             if {n for n, _, _ in names(p)} & (ENGINE_NAMES - OPTIONS)}
    assert named == ENGINE_FILES | {SHARDED_SAVING}, named  # torch's types: three files


def test_the_registry_lists_each_engine_once_by_its_name():
    """engine_for was an if-chain over "ddp"/"fsdp" and compile checked a tuple of its own:
    now both read ENGINES, and each entry's options class makes its own engine class, with
    the defaults, under 2 ranks of one device each (nothing is joined to make one)."""
    cpu = torch.device("cpu")
    assert ENGINE_FILES >= {"executor/ddp.py", "executor/fsdp.py"}
    for name, options in ENGINES.items():
        assert options.name == name
        engine = engine_for(name, [cpu], 2)
        assert type(engine) is engine_class(options) and engine.options == options()
        model = fitdp.Model(nn.Linear(3, 2))
        model.compile(optimizer="sgd", loss="mse", strategy=name)  # compile takes the name


def test_the_check_sees_names_imports_and_isinstance(tmp_path):
    code = ("from torch.distributed.tensor import DTensor\nimport fitdp\n"
            "isinstance(x, fitdp.DDP)\ny = t.full_tensor()\n")
    (tmp_path / "m.py").write_text(code)
    assert sorted(n for n in names(tmp_path / "m.py") if n[0] in ENGINE_NAMES) == [
        ("DDP", 3, True), ("DTensor", 1, False), ("full_tensor", 4, False)]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def test_the_engine_is_chosen_once_per_call_and_is_what_the_step_calls(monkeypatch):
    """``engine_for`` runs when a call makes its replicas, not per batch; a later call on the
    same replicas keeps their engine; the bound step prepares each batch through an engine
    that says it prepares (``Engine.prepares``, DDP's), and never calls one that does not."""
    chosen = []
    real = replicas.engine_for

    def counted(*args, **kwargs):
        chosen.append(real(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(replicas, "engine_for", counted)
    prepared = []
    monkeypatch.setattr(LocalReduce, "prepare", lambda self, stepping: prepared.append(
        (self, stepping)))
    monkeypatch.setattr(LocalReduce, "prepares", True)
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy", grad_accum_steps=2)
    x, y = data()
    model.fit(x, y, batch_size=6, epochs=2, verbose=0, devices=["cpu", "cpu"])
    assert len(chosen) == 1 and isinstance(chosen[0], LocalReduce)
    engine = model._replicas.manager.engine
    assert engine is chosen[0]
    # 4 batches an epoch, 2 accumulated per optimizer step
    assert prepared == [(engine, False), (engine, True)] * 4
    model.evaluate(x, y, batch_size=6, verbose=0, devices=["cpu", "cpu"])
    model.fit(x, y, batch_size=6, epochs=1, verbose=0, devices=["cpu", "cpu"])
    assert len(chosen) == 1 and model._replicas.manager.engine is engine  # replicas reused
    monkeypatch.setattr(LocalReduce, "prepares", False)  # the local engine's own flag
    prepared.clear()
    model.fit(x, y, batch_size=6, epochs=1, verbose=0, devices=["cpu", "cpu"])
    assert prepared == []


def step_grads(engine: LocalReduce | None
               ) -> tuple[list[torch.Tensor], DataParallelExecutorManager]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    mgr = DataParallelExecutorManager(net, ["cpu", "cpu"], engine=engine,
                                      loss=nn.functional.cross_entropy)
    x, y = data()
    mgr.load_data_batch(DataBatch(x, y))
    mgr.forward(is_train=True)
    mgr.backward()
    return [p.grad.clone() for p in mgr.master_parameters()], mgr


def test_the_bucket_size_is_the_engines_own_not_the_process():
    """``flat_buckets.BUCKET_BYTES`` was patched process-wide by tests and bench to get
    several buckets; two engines with their own sizes now live side by side, and the
    gradients summed with 3 buckets are those summed with one."""
    small, big = LocalReduce(distributed=False, bucket_bytes=64), LocalReduce(False)
    small_grads, small_mgr = step_grads(small)
    big_grads, big_mgr = step_grads(big)
    assert small_mgr.flat.plan == [[0], [1, 2], [3]] and big_mgr.flat.plan == [[0, 1, 2, 3]]
    assert all(torch.equal(a, b) for a, b in zip(small_grads, big_grads))
    default_grads, default_mgr = step_grads(None)  # the manager's default engine
    assert isinstance(default_mgr.engine, LocalReduce)
    assert default_mgr.update(UpdateOptions()).cross_rank is None  # one process: no ranks
    assert all(torch.equal(a, b) for a, b in zip(default_grads, big_grads))


def test_closing_a_ddp_engine_frees_its_wrapper_and_leaves_the_others(tmp_path):
    """DDP wrappers were released at exit only, by one process-wide ``atexit`` entry per
    executor ever bound; now each engine releases its own when it closes (the manager's
    ``close``; at exit, through the engine's own hook, for one never closed)."""
    from fitdp.executor.ddp import DDP

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        managers = [DataParallelExecutorManager(nn.Linear(4, 2), ["cpu"], distributed=True,
                                                engine=DDP().engine(),
                                                loss=nn.functional.cross_entropy)
                    for _ in range(2)]
        lead = managers[0].execgrp.executors[0]
        wrapper = weakref.ref(managers[0].engine.wrapper)
        assert lead.fn is wrapper() and lead.ranked is lead.fn
        managers[0].close()
        assert wrapper() is None and lead.fn is lead.module and lead.ranked is None
        assert managers[1].engine.wrapper is not None
        managers[1].engine._at_exit()  # what exit runs for an engine never closed
        assert managers[1].engine.wrapper is None
    finally:
        torch.distributed.destroy_process_group()
