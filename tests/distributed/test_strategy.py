"""compile(strategy=...): checked when compiled, combinations that cannot work refused when a
call attaches (before any weight changes), and the engines' gradient arithmetic (issue 20)."""

from __future__ import annotations

import os

import pytest
import torch
from test_distributed import launch
from torch import nn

import fitdp
from fitdp.executor.engines import DDP, FSDP, _blocks, engine_for

CPU = torch.device("cpu")


@pytest.mark.parametrize("bad, error", [("zero", ValueError), (3, ValueError),
                                        (FSDP(blocks=("Linear",)), TypeError)])
def test_compile_refuses_an_unknown_strategy(bad, error):
    model = fitdp.Model(nn.Linear(3, 2))
    with pytest.raises(error, match="strategy"):
        model.compile(optimizer="sgd", loss="mse", strategy=bad)
    assert model._trainer is None  # nothing kept


def test_auto_is_ddp_for_one_device_per_rank_and_fitdps_own_reduction_otherwise():
    assert engine_for("auto", [CPU], 2) == DDP()
    assert engine_for("auto", [CPU, CPU], 2) is None  # several local devices: replicas
    assert engine_for("auto", [CPU], 1) is None
    assert engine_for("fsdp", [CPU], 4) == FSDP()
    options = FSDP(blocks=(nn.Linear,))
    assert engine_for(options, [CPU], 2) is options


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", FSDP()])
def test_ddp_and_fsdp_with_several_local_devices_are_refused(strategy):
    with pytest.raises(ValueError, match=r"2 local devices in one process.*one device per rank"):
        engine_for(strategy, [CPU, CPU], 2)


def test_ddp_in_one_process_is_refused_before_a_weight_moves():
    model = fitdp.Model(nn.Linear(3, 2))
    model.compile(optimizer="sgd", lr=1.0, loss="mse", strategy="ddp")
    before = [p.detach().clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match=r"strategy='ddp'.*one process.*torchrun"):
        model.fit(torch.randn(8, 3), torch.randn(8, 2), batch_size=4, verbose=0,
                  devices=["cpu"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))


def test_fsdp_blocks_by_class_or_by_size():
    net = nn.Sequential(nn.Linear(8, 64), nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
                        nn.Linear(64, 2))
    assert _blocks(net, FSDP(blocks=(nn.Linear,))) == [net[0], net[1][0], net[2]]
    assert _blocks(net, FSDP(min_params=1000)) == [net[1]]  # outermost large subtree only


@pytest.mark.distributed
def test_ddp_and_fsdp_sum_uneven_ranks_into_the_whole_batch_gradient(tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "engine_worker.py")
    code, output, _ = launch("", tmp_path, script=[worker])
    assert code == 0, output
    assert output.count("engines ok") == 2, output
