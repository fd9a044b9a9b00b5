"""A fit whose step would hand a BatchNorm1d that trains a slice of one row is refused
before the first step (issue 37 item 7), in the ordinary step as in the reproducible one
(tests/model/test_reproducible.py): torch's BatchNorm raises "Expected more than 1 value per
channel when training" on such a slice, which fitdp met only mid-epoch, after the other
replicas' forwards had moved their running statistics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitdp
from fitdp.executor.batchnorm_rows import check_batchnorm_rows

G = torch.Generator().manual_seed(0)
X = torch.randn(64, 6, generator=G)
Y = (X[:, 0] > 0).long()
CPU = torch.device("cpu")


def trained() -> fitdp.Model:
    """A BatchNorm1d MLP after one epoch: statistics and optimizer state to keep."""
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                      nn.Linear(16, 2)))
    model.compile("adam", "cross_entropy")
    model.fit(X, Y, batch_size=16, verbose=0)
    return model


def snapshot(model: fitdp.Model) -> list[torch.Tensor]:
    opt = model.optimizer.state_dict()["state"]
    return [v.clone() for v in model.module.state_dict().values()] + [
        opt[i][k].clone() for i in sorted(opt) for k in ("exp_avg", "exp_avg_sq")]


def assert_unchanged(model: fitdp.Model, before: list[torch.Tensor], step: int) -> None:
    assert all(torch.equal(a, b) for a, b in zip(snapshot(model), before, strict=True))
    assert model.global_step == step


def test_a_skewed_work_load_list_giving_a_one_row_slice_is_refused_before_statistics_move():
    """Issue 37 item 7: work_load_list=[1, 15] gave device 0 one row of 16; the first batch
    failed with torch's message after device 1's forward moved its running statistics,
    which the end of the call averaged into the model."""
    model = trained()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"work_load_list: got \[1\.0, 15\.0\].*BatchNorm1d "
                       r"'1'.*gives a device 1 row\. Fix: loads that give every device 2 rows"):
        model.fit(X, Y, batch_size=16, verbose=0, devices=["cpu", "cpu"],
                  work_load_list=[1, 15])
    assert_unchanged(model, before, 4)


def test_a_last_batch_giving_a_device_one_row_is_refused_before_the_first_step():
    """65 rows in batches of 16 on one device end in a batch of one row (and 67 on two
    devices in one of 3, split 2 + 1): it failed after the epoch's other steps."""
    model = trained()
    before = snapshot(model)
    x, y = torch.cat([X, X[:3]]), torch.cat([Y, Y[:3]])
    for rows, devices in ((65, ["cpu"]), (67, ["cpu", "cpu"])):
        with pytest.raises(ValueError, match=rf"batch_size: got 16;.*the last batch of {rows} "
                           rf"rows has {rows - 64}, which gives a device 1 row\. Fix: "
                           rf"batch_size=\d+ .*or the first 64 rows"):
            model.fit(x[:rows], y[:rows], batch_size=16, verbose=0, devices=devices)
        assert_unchanged(model, before, 4)


@pytest.mark.parametrize("module,kwargs", [
    # frozen (eval) BatchNorm1d uses its running statistics: one row is fine
    (nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4).eval()), dict(batch_size=16)),
    # BatchNorm2d: images have values per channel in one row
    (nn.Sequential(nn.Conv2d(2, 2, 3), nn.BatchNorm2d(2)), dict(micro_batch_size=1)),
    # no foreseeable last batch: steps_per_epoch leaves where the epoch ends to the data
    (nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)), dict(samples=None)),
    # work_load_list="auto" (loads None) is measured while training
    (nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)), dict(loads=None, batch_size=3)),
])
def test_what_is_not_refused(module, kwargs):
    args = dict(samples=65, batch_size=16, devices=[CPU, CPU], loads=[1.0, 1.0],
                micro_batch_size=None)
    check_batchnorm_rows(module, **{**args, **kwargs})
