"""fit(reproducible=True) under torchrun (issue 31): two gloo ranks with batch_size=B/2 train
bitwise what one process trains with batch_size=B (weights, BatchNorm statistics, optimizer
state, History), under DDP and under fitdp's own reduction. (Predictions then follow from
the weights: ``predict`` under torchrun cuts the rows by rank, other shapes than one
process's, so it is compared in one process, tests/model/test_reproducible.py.)"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitdp

WORKER = os.path.join(os.path.dirname(__file__), "reproducible_worker.py")
pytestmark = [pytest.mark.distributed, pytest.mark.ranks_script(WORKER)]
BATCH = 16  # the global batch
G = torch.Generator().manual_seed(0)
X = torch.randn(76, 6, generator=G)  # 4 full global batches and one of 12 rows
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()


def fit_mlp(batch_size: int, devices: list[str], loads: list[float] | None) -> dict[str, Any]:
    """The fit both sides run (dropout, BatchNorm, shuffle, accumulation, clipping)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
                        nn.Linear(32, 3))
    model = fitdp.Model(net)
    model.compile("adam", "cross_entropy", lr=0.01, metrics=[MulticlassAccuracy(num_classes=3)],
                  grad_accum_steps=2, grad_clip_norm=0.5)
    history = model.fit(X, Y, batch_size=batch_size, epochs=2, seed=5, verbose=0,
                        devices=devices, work_load_list=loads, validation_data=(X[:24], Y[:24]),
                        reproducible=True, micro_batch_size=4)
    return {"module": model.module.state_dict(), "optimizer": model.optimizer.state_dict(),
            "history": history.history, "step": model.global_step}


@pytest.fixture(scope="module")
def ranks_job(shared_ranks):
    run = shared_ranks(WORKER)  # the shared job's 2 ranks run reproducible_worker.py
    assert run.code == 0, run.output
    assert run.output.count("ddp ok") == 2 and run.output.count("local2 ok") == 2, run.output
    return run.out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b))
    return a == b


@pytest.mark.parametrize("engine", ["ddp", "local2"])
def test_two_ranks_at_half_the_batch_train_one_process_bitwise(ranks_job, engine):
    """The ranks ran with one intra-op thread each: so does the one process (torch's CPU
    kernels split a reduction by the thread count, so the count is part of the machine the
    bits belong to, as the GPU model is on a GPU)."""
    ranks = torch.load(ranks_job / f"{engine}.pt", weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = fit_mlp(BATCH, ["cpu"], None)
    finally:
        torch.set_num_threads(threads)
    for key in ("module", "optimizer", "step", "history"):
        assert same(ranks[key], one[key]), (key, ranks[key] if key == "history" else "")
