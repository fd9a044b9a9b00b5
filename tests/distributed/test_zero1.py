"""compile(strategy="zero1") (issue 39, item 1): the optimizer state sharded over the ranks by
torch's ZeroRedundancyOptimizer (DeepSpeed's ZeRO stage 1), behind the engine: weights equal
"ddp", each rank holding its part of the state, checkpoints (whole and sharded) holding the
whole state, resumed bitwise on 2 ranks and allclose in one process; bad options refused."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import fitdp
from fitdp.executor.engines import engine_for
from fitdp.executor.zero1 import ZeRO1, Zero1Engine
from fitdp.saving.sharded import read_state

WORKER = os.path.join(os.path.dirname(__file__), "zero1_worker.py")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def zero1_job(shared_ranks):
    """One 2-rank run for every check below (in the tests' shared torchrun job)."""
    run = shared_ranks(WORKER)
    assert run.code == 0, run.output
    assert run.output.count("zero1 done") == 2, run.output
    return run.out, run.output


def weights(out, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.pt", weights_only=True)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str):
    assert got.keys() == want.keys(), what
    assert all(torch.equal(got[k], v) for k, v in want.items()), what


def one_process() -> fitdp.Model:
    """zero1_worker.py's model in one process (fitdp's own engine)."""
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)))
    model.compile(optimizer="adamw", lr=0.05, loss="cross_entropy", grad_accum_steps=2,
                  grad_clip_norm=0.05,
                  lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    return model


@pytest.mark.distributed
@pytest.mark.ranks_script(WORKER)
def test_zero1_weights_equal_ddp_and_each_rank_holds_its_part(zero1_job):
    """AdamW with accumulation, clipping and a per-epoch StepLR: zero1's weights are ddp's bit
    for bit (the same summed gradients, the same per-parameter AdamW arithmetic, each rank
    stepping its part, then broadcast); each rank holds only its part of Adam's moments
    (together the whole of ddp's), and the compiled optimizer none while the replicas run."""
    out, output = zero1_job
    assert_equal(weights(out, "zero1"), weights(out, "ddp"), "zero1 vs ddp")
    held = {}
    for rank in (0, 1):
        line = next(ln for ln in output.splitlines()
                    if ln.startswith(f"rank {rank} optimizer state bytes"))
        held[rank] = [int(w) for w in line.split()[-3::2]]  # [ddp, zero1]
        assert 0 < held[rank][1] < held[rank][0], line
        assert f"rank {rank} after fit: state bytes 0" in output
    assert held[0][1] + held[1][1] == held[0][0]  # the parts make the whole


@pytest.mark.distributed
@pytest.mark.ranks_script(WORKER)
def test_zero1_checkpoints_hold_the_whole_optimizer_state(zero1_job):
    """Rank 0's file (after every rank shared), every rank's sharded folder (mid-fit) and rank
    0's file after fit each hold AdamW's state of every parameter; a save on rank 0 alone
    after a step, with no share, is refused and writes nothing (it would hold rank 0's part
    only)."""
    out, output = zero1_job
    assert "rank 0 unshared save refused: True, file written: False" in output
    shapes = [list(p.shape) for p in one_process().module.parameters()]
    for name in ("zero1-whole.ckpt", "zero1-sharded.ckpt", "zero1-after.ckpt"):
        state = read_state(str(out / name))["optimizer"]
        assert sorted(state["state"]) == [0, 1, 2, 3], name
        for i, shape in enumerate(shapes):
            assert list(state["state"][i]["exp_avg"].shape) == shape, (name, i)
        assert state["param_groups"][0]["lr"] == pytest.approx(0.05 * (0.5 if
                                                                "after" not in name else 0.25))


@pytest.mark.distributed
@pytest.mark.ranks_script(WORKER)
def test_zero1_resumes_mid_epoch_bitwise_on_two_ranks(zero1_job):
    """BackupAndRestore after every step (each rank sharing its part before rank 0 saves), a
    crash after step 3 of 4 (mid-epoch 1), the fit run again: it resumes from step 3 and ends
    bit for bit where the uninterrupted zero1 fit did."""
    out, output = zero1_job
    assert output.count("resumed from step 3") == 2, output
    assert_equal(weights(out, "backup-resumed"), weights(out, "zero1"), "backup")


@pytest.mark.distributed
@pytest.mark.ranks_script(WORKER)
@pytest.mark.parametrize("name", ["zero1-whole.ckpt", "zero1-sharded.ckpt"])
def test_a_zero1_checkpoint_resumes_in_one_process(zero1_job, name):
    """Saved by 2 zero1 ranks at epoch 0's end, resumed by one process (strategy 'auto', the
    global batch of 10): the same weights at the checkpoint, and the 2-rank run's end
    (allclose: one process sums the batch in another order)."""
    out, _ = zero1_job
    model = one_process()
    model.load(out / name)
    assert_equal(model.get_weights(), weights(out, "at-checkpoint"), name)
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, devices=["cpu"],
              resume=out / name)
    for k, v in model.get_weights().items():
        torch.testing.assert_close(v, weights(out, "zero1")[k], rtol=1e-5, atol=1e-5, msg=k)


def test_zero1_in_one_process_is_refused_before_a_weight_moves():
    """As "ddp" and "fsdp": one process has no ranks to shard over (strategy='auto' is the
    plain optimizer there)."""
    model = fitdp.Model(nn.Linear(3, 2))
    model.compile(optimizer="adamw", loss="mse", strategy="zero1")
    before = [p.detach().clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match=r"strategy='zero1'.*one process.*torchrun"):
        model.fit(torch.randn(8, 3), torch.randn(8, 2), batch_size=4, verbose=0,
                  devices=["cpu"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
    assert not model.optimizer.state


@pytest.mark.parametrize("call, match", [
    ({"devices": [CPU, CPU]}, r"2 local devices in one process.*one device per rank"),
    ({"scaled": True}, r"precision='16-mixed'.*GradScaler.*Fix: precision='bf16-mixed'"),
    ({"custom_step": True}, r"overrides train_step"),
    ({"bucketed": True}, r"bucket_module"),
])
def test_zero1_options_that_cannot_work_are_refused(call, match):
    """Several local replicas per rank (the sharded optimizer steps one replica's
    parameters), a GradScaler (it cannot skip the sharded step on inf), a custom step or a
    bucket_module: each refused with the reason and the fix."""
    devices = call.pop("devices", [CPU])
    with pytest.raises(ValueError, match=match):
        engine_for("zero1", devices, 2, **call)
    assert isinstance(engine_for(ZeRO1(bucket_cap_mb=1), [CPU], 2), Zero1Engine)


def test_an_unknown_strategy_names_zero1_among_those_expected():
    model = fitdp.Model(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"'auto', 'ddp', 'fsdp', 'zero1'"):
        model.compile(optimizer="sgd", loss="mse", strategy="zero2")
