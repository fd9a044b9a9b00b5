"""``model.find_lr``: the learning-rate range test of fastai's ``lr_find`` and Lightning's
``Tuner.lr_find``, against a hand-written sweep, and the model left exactly as it was."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fitdp
from fitdp.checks import FitdpWarning
from fitdp.model.lr_finder import LRFinder


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def hand_sweep(net: nn.Module, x: torch.Tensor, y: torch.Tensor, *, min_lr: float,
               max_lr: float, num_steps: int, bs: int, threshold: float | None
               ) -> tuple[list[float], list[float], list[float]]:
    """The reference, written as fastai's LRFinder callback and Lightning's _LRCallback run
    it: before step i the rate is min_lr * (max_lr/min_lr) ** (i / (num_steps - 1)); the
    loss is smoothed with a bias-corrected EMA (beta 0.98); the sweep stops once the smoothed
    loss exceeds ``threshold`` times the best so far (that point recorded)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    lrs, raw, smooth, avg, best = [], [], [], 0.0, math.inf
    for i in range(num_steps):
        lr = min_lr * (max_lr / min_lr) ** (i / (num_steps - 1))
        for group in opt.param_groups:
            group["lr"] = lr
        start = (i * bs) % len(x)  # in order, round and round the data
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x[start:start + bs]), y[start:start + bs])
        loss.backward()
        opt.step()
        avg = 0.98 * avg + 0.02 * loss.item()
        lrs.append(lr)
        raw.append(loss.item())
        smooth.append(avg / (1 - 0.98 ** (i + 1)))
        if threshold is not None and i > 0 and smooth[-1] > threshold * best:
            break
        best = min(best, smooth[-1])
    return lrs, raw, smooth


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_find_lr_matches_a_hand_sweep(devices):
    x, y = data(64)
    lrs, raw, smooth = hand_sweep(mlp(), x, y, min_lr=1e-3, max_lr=1e3, num_steps=40, bs=16,
                                  threshold=4.0)
    model = fitdp.Model(mlp())
    model.compile("sgd", "cross_entropy")
    found = model.find_lr(x, y, min_lr=1e-3, max_lr=1e3, num_steps=40, batch_size=16,
                          shuffle=False, devices=devices)
    assert len(found.lrs) == len(lrs) < 40 and found.diverged  # SGD at 1e3 blows up
    assert found.lrs == pytest.approx(lrs, rel=1e-12)
    # Two replicas add the gradients in another order; at rates of 100 and more the last
    # steps blow that rounding up, so those are compared loosely.
    assert found.raw_losses[:-3] == pytest.approx(raw[:-3], rel=1e-5)
    assert found.losses[:-3] == pytest.approx(smooth[:-3], rel=1e-5)
    assert found.losses == pytest.approx(smooth, rel=1e-2)


def test_find_lr_runs_every_step_without_a_threshold():
    x, y = data(64)
    lrs, raw, _ = hand_sweep(mlp(), x, y, min_lr=1e-5, max_lr=1e-2, num_steps=12, bs=16,
                             threshold=None)
    model = fitdp.Model(mlp())
    model.compile("sgd", "cross_entropy")
    found = model.find_lr(x, y, min_lr=1e-5, max_lr=1e-2, num_steps=12, batch_size=16,
                          shuffle=False, early_stop_threshold=None)
    assert found.lrs[0] == 1e-5 and found.lrs[-1] == pytest.approx(1e-2) and len(raw) == 12
    assert found.raw_losses == pytest.approx(raw, rel=1e-5) and not found.diverged


def test_find_lr_leaves_weights_optimizer_step_and_rng_as_they_were():
    """The model after find_lr trains exactly as if find_lr had never run (Lightning
    restores its checkpoint after the sweep; here nothing else moves either)."""
    x, y = data(64)

    def trained() -> fitdp.Model:
        model = fitdp.Model(mlp())
        model.compile("adam", "cross_entropy", lr_scheduler=lambda o: torch.optim.lr_scheduler
                      .StepLR(o, 1, gamma=0.5))
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, devices=["cpu", "cpu"])
        return model

    model, twin = trained(), trained()
    weights = copy.deepcopy(model.module.state_dict())
    optimizer = copy.deepcopy(model.optimizer.state_dict())
    scheduler = model.lr_scheduler.state_dict()
    run = model.run.state_dict()
    torch.manual_seed(7)
    twin_rng = torch.get_rng_state()
    model.find_lr(x, y, num_steps=20, batch_size=16, devices=["cpu", "cpu"])
    assert torch.equal(torch.get_rng_state(), twin_rng)
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    after = model.optimizer.state_dict()
    assert after["param_groups"] == optimizer["param_groups"]  # lr included
    for i, state in optimizer["state"].items():
        for k, v in state.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    assert model.lr_scheduler.state_dict() == scheduler and model.run.state_dict() == run
    assert model.global_step == 4
    # and the next fit is the one the twin does, bit for bit
    torch.manual_seed(7)
    a = model.fit(x, y, batch_size=16, epochs=2, verbose=0, devices=["cpu", "cpu"])
    torch.manual_seed(7)
    b = twin.fit(x, y, batch_size=16, epochs=2, verbose=0, devices=["cpu", "cpu"])
    assert a.history == b.history
    for (k, v), w in zip(model.module.state_dict().items(), twin.module.state_dict().values()):
        assert torch.equal(v, w), k


def test_find_lr_puts_a_user_source_back_where_it_was():
    seqs = [torch.arange(1, 5) % 7 for _ in range(48)]
    labels = torch.arange(48) % 3
    it = fitdp.BucketIterator(seqs, labels, batch_size=8, buckets=[4], seed=3)
    next(iter(it)), next(iter(it))  # part-way into epoch 0
    position = it.state_dict()
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Embedding(7, 4), nn.Flatten(), nn.Linear(16, 3)))
    model.compile("sgd", "cross_entropy")
    found = model.find_lr(it, num_steps=15)  # 6 batches an epoch: runs into epoch 2
    assert len(found.lrs) == 15
    assert it.state_dict() == position


class Breaks(nn.Module):
    """Raises in its forward on the ``at``-th call."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.net, self.calls, self.at = mlp(), 0, at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom")
        return self.net(x)


def test_find_lr_that_raises_leaves_the_model_as_it_was():
    x, y = data(64)
    model = fitdp.Model(Breaks(at=10**9))
    model.compile("adam", "cross_entropy")
    model.fit(x, y, batch_size=16, verbose=0)
    weights = copy.deepcopy(model.module.state_dict())
    optimizer = copy.deepcopy(model.optimizer.state_dict())
    model.module.at = model.module.calls + 6
    with pytest.raises(RuntimeError, match="boom"):
        model.find_lr(x, y, num_steps=20, batch_size=16)
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    after = model.optimizer.state_dict()
    assert after["param_groups"] == optimizer["param_groups"]
    assert all(torch.equal(after["state"][i]["exp_avg"], s["exp_avg"])
               for i, s in optimizer["state"].items())
    assert model.global_step == 4 and model.run.micro_step == 0


@pytest.mark.parametrize("kwargs,error,names", [
    ({"min_lr": 1, "max_lr": 0.1}, ValueError, "max_lr"),
    ({"min_lr": 0}, ValueError, "min_lr"),
    ({"min_lr": "1e-7"}, TypeError, "min_lr"),
    ({"max_lr": float("nan")}, ValueError, "max_lr"),
    ({"num_steps": 1}, ValueError, "num_steps"),
    ({"num_steps": 10.0}, TypeError, "num_steps"),
    ({"early_stop_threshold": 1}, ValueError, "early_stop_threshold"),
    ({"beta": 1.0}, ValueError, "beta"),
])
def test_find_lr_bad_arguments_name_them_and_change_nothing(kwargs, error, names):
    x, y = data(32)
    model = fitdp.Model(mlp())
    model.compile("adam", "cross_entropy")
    weights = copy.deepcopy(model.module.state_dict())
    with pytest.raises(error, match=f"find_lr\\({names}="):
        model.find_lr(x, y, **kwargs)
    assert all(torch.equal(v, weights[k]) for k, v in model.module.state_dict().items())
    assert model.global_step == 0


def test_find_lr_needs_compile():
    with pytest.raises(RuntimeError, match="compile"):
        fitdp.Model(mlp()).find_lr(*data(32))


def test_suggestion_is_the_steepest_descent_as_lightning_computes_it():
    """Lightning: ``torch.gradient`` of the smoothed losses with unit spacing, argmin,
    after dropping the first 10 points and the last one."""
    lrs = [10 ** (-6 + i / 5) for i in range(30)]
    losses = [2.0 - math.tanh((i - 18) / 3) for i in range(30)]  # falls fastest at i = 18
    found = LRFinder(lrs, losses, beta=0.0)
    grads = torch.gradient(torch.tensor(losses[10:-1], dtype=torch.float64))[0]
    assert found.suggestion == lrs[10 + int(torch.argmin(grads))] == lrs[18]


def test_suggestion_skips_non_finite_losses():
    """A NaN loss makes every later smoothed loss NaN (as fastai's and Lightning's averages
    do); those points are left out of the slope."""
    found = LRFinder([1.0, 2.0, 3.0, 4.0, 5.0], [5.0, 4.8, 1.0, 0.9, math.nan], beta=0.0)
    assert math.isnan(found.losses[-1])
    # slopes over the 4 finite points (unit spacing): -0.2, -2.0, -1.95, -0.1
    assert found.suggest(skip_begin=0, skip_end=0) == 2.0


def test_suggestion_of_a_short_sweep_is_none_with_a_warning():
    with pytest.warns(FitdpWarning, match="num_steps"):
        assert LRFinder([1e-3, 1e-2], [1.0, 0.9]).suggestion is None


def test_plot_writes_the_curve(tmp_path):
    pytest.importorskip("matplotlib")
    lrs = [10 ** (-6 + i / 5) for i in range(30)]
    found = LRFinder(lrs, [2.0 - math.tanh((i - 18) / 3) for i in range(30)])
    fig = found.plot(str(tmp_path / "lr.png"))
    assert (tmp_path / "lr.png").stat().st_size > 0
    assert fig.axes[0].get_xscale() == "log"
