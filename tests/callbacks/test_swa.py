"""`SWA` against torch's recipe (the ``torch.optim.swa_utils`` docs): ``SWALR`` stepped
once per epoch from the SWA start, ``AveragedModel.update_parameters`` after each of those
epochs, ``update_bn`` over the training data at the end, written by hand on the same
batches."""

from __future__ import annotations

import copy

import pytest
import torch
from averaging_helpers import BATCH, Backup, X, Y, assert_params, batches, hand_loop, model, net
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from fitdp.callbacks import SWA
from fitdp.checks import FitdpWarning

EPOCHS, START, SWA_LR, ANNEAL = 5, 2, 0.05, 2


def reference(module: torch.nn.Module) -> tuple[AveragedModel, torch.optim.Optimizer]:
    trained = copy.deepcopy(module)
    averaged = AveragedModel(trained)
    scheduler: list[SWALR] = []

    def epoch_begin(epoch, opt):
        if epoch == START:
            scheduler.append(SWALR(opt, swa_lr=SWA_LR, anneal_epochs=ANNEAL))
        elif epoch > START:
            scheduler[0].step()

    def epoch_end(epoch):
        if epoch >= START:
            averaged.update_parameters(trained)

    opt = hand_loop(trained, EPOCHS, averaged, epoch_begin, epoch_end, after_step=False)
    update_bn([x for x, _ in batches()], averaged)
    return averaged, opt


def fit_swa(module, devices, **kw):
    m, swa = model(module), SWA(swa_lr=SWA_LR, swa_epoch_start=START, annealing_epochs=ANNEAL)
    m.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, callbacks=[swa], verbose=0,
          devices=devices, **kw)
    return m, swa


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_swa_equals_torch_recipe(devices):
    """One device: bit for bit, the rate too; two CPU replicas: within 1e-6."""
    module = net()
    m, _ = fit_swa(module, devices)
    averaged, opt = reference(module)
    assert_params(m.get_weights(), averaged, exact=len(devices) == 1)
    assert m.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"] < 0.1


def test_swa_with_batchnorm_equals_torch_recipe_and_update_bn():
    """The BatchNorm statistics are update_bn's for the averaged weights, bit for bit."""
    module = net(batchnorm=True)
    m, swa = fit_swa(module, ["cpu"])
    averaged, _ = reference(module)
    got = m.get_weights()
    for name, want in averaged.module.state_dict().items():
        assert torch.equal(got[name], want), name
    assert swa.training_weights is not None
    assert not torch.equal(swa.training_weights["1.running_mean"], got["1.running_mean"])


def test_swa_batchnorm_pass_on_two_replicas_is_the_one_device_pass():
    """Two CPU replicas train slices (their BatchNorm statistics differ from one device's),
    but the statistics computed at the end are update_bn's for the averaged weights over
    the whole batches, bit for bit."""
    m, _ = fit_swa(net(batchnorm=True), ["cpu", "cpu"])
    got = m.get_weights()
    check = net(batchnorm=True)
    check.load_state_dict(got)
    update_bn([x for x, _ in batches()], check)
    for name, want in check.state_dict().items():
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize("crash_at", [10, 13])  # the last step of epoch 1; mid-epoch 2
def test_swa_resumes_bitwise_with_its_average_and_schedule(tmp_path, crash_at):
    def run(crash_at=None):
        m = model(net(batchnorm=True), "adamw")
        swa = SWA(swa_lr=SWA_LR, swa_epoch_start=0.2, annealing_epochs=ANNEAL)
        m.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, seed=1, verbose=0,
              callbacks=[Backup(str(tmp_path / "backup"), crash_at), swa])
        return m

    whole = run()
    with pytest.raises(KeyboardInterrupt):
        run(crash_at)
    resumed = run()
    assert resumed.optimizer.param_groups[0]["lr"] == whole.optimizer.param_groups[0]["lr"]
    for k, v in whole.get_weights().items():
        assert torch.equal(resumed.get_weights()[k], v), k


def test_swa_start_as_a_fraction_of_the_epochs():
    """0.6 of 5 epochs: epochs 3 and 4 are averaged."""
    module = net()
    m = model(module)
    m.fit(X, Y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0,
          callbacks=[SWA(swa_lr=SWA_LR, swa_epoch_start=0.6, annealing_epochs=0)])
    trained = copy.deepcopy(module)
    averaged = AveragedModel(trained)
    sched: list[SWALR] = []

    def epoch_begin(epoch, opt):
        if epoch == 3:
            sched.append(SWALR(opt, swa_lr=SWA_LR, anneal_epochs=0))
        elif epoch > 3:
            sched[0].step()

    hand_loop(trained, 5, averaged, epoch_begin,
              lambda e: averaged.update_parameters(trained) if e >= 3 else None,
              after_step=False)
    assert_params(m.get_weights(), averaged, exact=True)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"swa_lr": 0}, ValueError, r"SWA\(swa_lr=\.\.\.\): got 0"),
    ({"swa_lr": -0.1}, ValueError, r"SWA\(swa_lr=\.\.\.\): got -0.1"),
    ({"swa_lr": "0.05"}, TypeError, r"SWA\(swa_lr=\.\.\.\): got '0.05' \(str\)"),
    ({"swa_lr": 0.05, "swa_epoch_start": 1.5}, ValueError,
     r"SWA\(swa_epoch_start=\.\.\.\): got 1.5; expected an epoch index"),
    ({"swa_lr": 0.05, "swa_epoch_start": -1}, ValueError, r"SWA\(swa_epoch_start=\.\.\.\)"),
    ({"swa_lr": 0.05, "swa_epoch_start": "late"}, TypeError,
     r"SWA\(swa_epoch_start=\.\.\.\): got 'late'"),
    ({"swa_lr": 0.05, "swa_epoch_start": True}, TypeError, r"SWA\(swa_epoch_start=\.\.\.\)"),
    ({"swa_lr": 0.05, "annealing_epochs": -1}, ValueError, r"SWA\(annealing_epochs=\.\.\.\)"),
    ({"swa_lr": 0.05, "annealing_strategy": "exp"}, ValueError,
     r"SWA\(annealing_strategy=\.\.\.\): got 'exp'"),
])
def test_bad_arguments_name_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        SWA(**kwargs)


def test_swa_lr_per_group_must_match_the_groups():
    m = model(net())
    with pytest.raises(ValueError, match=r"SWA\(swa_lr=\.\.\.\): got \[0.1, 0.2\] \(list\); "
                                         r"expected one rate per parameter group \(1 "
                                         r"here\)"):
        m.fit(X, Y, callbacks=[SWA(swa_lr=[0.1, 0.2])], verbose=0)


def test_swa_on_one_shot_data_keeps_the_training_statistics_and_warns():
    """A generator cannot be read again for the BatchNorm pass: the statistics stay the
    training run's (not reset to 0 and 1) and a warning says how to compute them."""
    m = model(net(batchnorm=True))
    one_shot = ((X[i:i + BATCH], Y[i:i + BATCH]) for i in range(0, len(X), BATCH))
    with pytest.warns(FitdpWarning, match=r"update_bn: .*one-shot iterator.*update_bn\("):
        m.fit(one_shot, callbacks=[SWA(swa_lr=SWA_LR, swa_epoch_start=0)], verbose=0)
    stats = m.get_weights()["1.running_var"]
    assert not torch.equal(stats, torch.ones_like(stats))
