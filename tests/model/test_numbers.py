"""No silent wrong numbers (issue 10, items 2-7, 16, 17): each test names the bug it pins."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import fitdp
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager

G = torch.Generator().manual_seed(5)
X, Y = torch.randn(96, 6, generator=G), torch.randint(0, 3, (96,), generator=G)


def mlp(bn: bool = False, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    mid: list[nn.Module] = [nn.BatchNorm1d(16)] if bn else []
    return nn.Sequential(nn.Linear(6, 16), *mid, nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3))


def weights(model: fitdp.Model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def test_validation_sees_the_batchnorm_statistics_of_the_saved_model(tmp_path):
    """Regression: on several replicas validation ran with each replica's own running
    statistics, so the val_loss that EarlyStopping and ModelCheckpoint select on (0.38628)
    was not the loss of the model they saved (0.387)."""
    model = fitdp.Model(mlp(bn=True))
    model.compile(optimizer="sgd", lr=0.1)
    path = tmp_path / "best.ckpt"
    h = model.fit(X, Y, batch_size=16, epochs=2, devices=["cpu", "cpu", "cpu"], verbose=0,
                  validation_data=(X[:40], Y[:40]),
                  callbacks=[fitdp.callbacks.ModelCheckpoint(str(path), save_best_only=True)])
    saved = fitdp.Model(mlp(bn=True))
    saved.compile(optimizer="sgd", lr=0.1)
    saved.load(path)
    val = saved.evaluate(X[:40], Y[:40], devices=["cpu"], verbose=0)["loss"]
    assert min(h.history["val_loss"]) == pytest.approx(val, rel=1e-6)
    aux = model._replicas.manager.aux_arrays
    assert all(torch.equal(block[0], b) for block in aux for b in block)


def test_averaging_equal_replicas_is_exact():
    """Regression: ten evaluate/predict calls on three CPU replicas moved 87 of 515 weights
    by about an ulp (stack().mean(0))."""
    model = fitdp.Model(mlp(bn=True))
    model.compile(optimizer="adam", lr=0.01)
    model.fit(X, Y, batch_size=16, devices=["cpu"] * 3, verbose=0)
    before = weights(model)
    for _ in range(5):
        model.evaluate(X, Y, devices=["cpu"] * 3, verbose=0)
        model.predict(X, devices=["cpu"] * 3)
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_backward_twice_counts_every_device_once():
    """Regression: backward() twice without zero_grad counted devices 1..n twice (2.667
    where one device gives 2.0)."""
    grads = {}
    for devices in (["cpu"], ["cpu"] * 3):
        net = nn.Linear(1, 1, bias=False)
        nn.init.constant_(net.weight, 1.0)
        mgr = DataParallelExecutorManager(net, devices, loss=lambda out, y: out.mean())
        batch = DataBatch(torch.ones(6, 1), torch.zeros(6))
        for _ in range(2):
            mgr.load_data_batch(batch)
            mgr.forward(is_train=True)
            mgr.backward()
        grads[len(devices)] = mgr.grad_arrays[0][0].item()
        mgr.close()
    assert grads[1] == grads[3] == 2.0


@pytest.mark.parametrize("extra", [5, -5])
def test_labels_of_another_length_are_refused(extra):
    """Regression: a label tensor with more rows than the data was silently cut; fewer rows
    failed deep in torch with per-slice sizes."""
    model = fitdp.Model(mlp())
    model.compile(optimizer="sgd")
    y = torch.randint(0, 3, (96 + extra,))
    with pytest.raises(ValueError, match=rf"{96 + extra} rows.*96"):
        model.fit(X, y, verbose=0)
    batches = [DataBatch(X[:16], y[:16 + extra])]
    before = weights(model)
    with pytest.raises(ValueError, match=rf"{16 + extra} rows for data of 16 rows"):
        model.fit(batches, devices=["cpu", "cpu"], verbose=0)
    assert all(torch.equal(v, before[k]) for k, v in model.module.state_dict().items())
    mgr = DataParallelExecutorManager(nn.Linear(6, 3), ["cpu", "cpu"])
    with pytest.raises(ValueError, match="label"):
        mgr.load_data_batch(DataBatch(X[:16], Y[:16 + extra]))
    mgr.close()


def run_with_dropout(devices: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    model = fitdp.Model(mlp(dropout=0.5))
    model.compile(optimizer="sgd", lr=0.1)
    model.fit(X, Y, batch_size=16, epochs=3, devices=devices, seed=seed, verbose=0)
    return weights(model)


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu"] * 3])
def test_dropout_on_cpu_replicas_is_reproducible_with_a_seed(devices):
    """Regression: dropout on several CPU replicas was not reproducible: the same script with
    seed=0 stopped after 13, 15, 16 or 24 epochs (threads drew masks in any order)."""
    runs = [run_with_dropout(devices) for _ in range(3)]
    for other in runs[1:]:
        for k, v in runs[0].items():
            assert torch.equal(v, other[k]), k
    assert any(not torch.equal(v, run_with_dropout(devices, seed=1)[k])
               for k, v in runs[0].items())


def test_dropout_resume_is_bitwise_on_cpu_replicas(tmp_path):
    class Crash(fitdp.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.global_step == 8:
                raise KeyboardInterrupt

    ref = run_with_dropout(["cpu", "cpu"])
    model = fitdp.Model(mlp(dropout=0.5))
    model.compile(optimizer="sgd", lr=0.1)
    backup = fitdp.callbacks.BackupAndRestore(str(tmp_path / "b"), save_freq=1)
    kw = dict(batch_size=16, epochs=3, devices=["cpu", "cpu"], seed=0, verbose=0)
    with pytest.raises(KeyboardInterrupt):
        model.fit(X, Y, callbacks=[backup, Crash()], **kw)
    again = fitdp.Model(mlp(dropout=0.5))
    again.compile(optimizer="sgd", lr=0.1)
    again.fit(X, Y, callbacks=[fitdp.callbacks.BackupAndRestore(str(tmp_path / "b"),
                                                                save_freq=1)], **kw)
    for k, v in weights(again).items():
        assert torch.equal(v, ref[k]), k


def hand_loop(net: nn.Module, steps: int, bs: int = 16, lr: float = 0.1) -> nn.Module:
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for i in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(net(X[i * bs:(i + 1) * bs]), Y[i * bs:(i + 1) * bs]).backward()
        opt.step()
    return net


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_frozen_parameters_are_kept_saved_and_can_be_unfrozen(devices, tmp_path):
    """Regression: any requires_grad=False parameter (a frozen backbone) made fit fail with
    `set_params: unknown names ['0.weight']` on every device list."""
    net = mlp()
    net[0].weight.requires_grad_(False)
    ref = hand_loop(copy.deepcopy(net), steps=6)
    frozen = net[0].weight.clone()
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.1)
    model.fit(X, Y, batch_size=16, shuffle=False, devices=devices, verbose=0)
    assert torch.equal(model.module[0].weight, frozen)
    for a, b in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model.save(tmp_path / "m.ckpt")
    other = fitdp.Model(mlp())
    other.compile(optimizer="sgd", lr=0.1)
    other.load(tmp_path / "m.ckpt")
    assert torch.equal(other.module[0].weight, frozen)
    model.module[0].weight.requires_grad_(True)  # unfreeze between two fits
    model.fit(X, Y, batch_size=16, shuffle=False, devices=devices, verbose=0)
    assert not torch.equal(model.module[0].weight, frozen)


class Custom(torch.optim.Optimizer):
    """A user's own optimizer: plain SGD with its own hyperparameter name."""

    def __init__(self, params, rate: float = 0.05) -> None:
        super().__init__(params, {"rate": rate})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["n"] = state.get("n", 0) + 1
                    p.add_(p.grad, alpha=-group["rate"])


OPTIMIZERS = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
              torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.NAdam, torch.optim.RAdam,
              torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD, torch.optim.SparseAdam,
              torch.optim.LBFGS, Custom]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_optimizer_follows_the_model_between_device_lists(cls):
    """Regression: fit on ["cpu", "cpu"] then predict/evaluate/export on ["cpu"] raised
    `AdamW.__init__() got an unexpected keyword argument 'decoupled_weight_decay'` (the
    optimizer was rebuilt from its defaults)."""
    model = fitdp.Model(mlp())
    kwargs = {"lr": 0.01} if cls not in (Custom, torch.optim.LBFGS) else {}
    model.compile(optimizer=lambda p: cls(p, **kwargs))
    opt = model.optimizer
    if cls is torch.optim.SparseAdam:
        with pytest.raises(RuntimeError, match="dense"):
            model.fit(X, Y, batch_size=32, devices=["cpu", "cpu"], verbose=0)
        return
    if cls is torch.optim.LBFGS:  # needs a closure: fitdp steps without one; torch refuses
        with pytest.raises(Exception, match="closure"):
            model.fit(X, Y, batch_size=32, devices=["cpu", "cpu"], verbose=0)
        return
    model.fit(X, Y, batch_size=32, devices=["cpu", "cpu"], verbose=0)
    state = {k: copy.deepcopy(v) for k, v in opt.state_dict()["state"].items()}
    model.predict(X, devices=["cpu"])
    model.evaluate(X, Y, devices=["cpu"], verbose=0)
    model.fit(X, Y, batch_size=32, devices=["cpu"], verbose=0)
    assert model.optimizer is opt and opt.state_dict()["state"].keys() == state.keys()
    params = {id(p) for p in model.module.parameters()}
    assert all(id(p) in params for g in opt.param_groups for p in g["params"])


def test_evaluate_and_predict_need_no_optimizer():
    model = fitdp.Model(mlp())
    assert model.predict(X, devices=["cpu", "cpu"]).shape == (96, 3)


def test_learning_rate_zero_is_accepted_and_changes_nothing():
    """Regression: lr=0 was refused ("expected a positive learning rate") though torch
    accepts it (frozen runs, warm-up from zero, LR range tests)."""
    model = fitdp.Model(mlp())
    model.compile(optimizer="sgd", lr=0.0)
    before = weights(model)
    h = model.fit(X, Y, devices=["cpu", "cpu"], verbose=0)
    assert h.history["lr"] == [0.0]
    assert all(torch.equal(v, before[k]) for k, v in model.module.state_dict().items())


def test_time_major_batches_split_on_the_batch_axis():
    """MXNet's DataDesc.layout: "TNC" data splits across devices on axis 1, and the update
    equals one device's on the whole batch."""
    torch.manual_seed(0)
    rnn = nn.RNN(4, 8)  # time-major by default, like MXNet's TNC

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.out = copy.deepcopy(rnn), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(x)[0])  # (T, N, 3)

    x = torch.randn(5, 12, 4)  # T=5, N=12
    y = torch.randint(0, 3, (5, 12))

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, 3), target.reshape(-1))

    results = []
    for devices in (["cpu"], ["cpu", "cpu", "cpu"]):
        torch.manual_seed(1)
        model = fitdp.Model(Net())
        model.compile(optimizer="sgd", lr=0.5, loss=loss)
        model.fit([DataBatch(x, y, layout="TNC")], devices=devices, verbose=0)
        preds = model.predict([DataBatch(x, layout="TNC")], devices=devices)
        results.append((weights(model), preds))
    assert results[1][1].shape == (5, 12, 3)
    for k, v in results[0][0].items():
        torch.testing.assert_close(results[1][0][k], v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)


def test_input_grads_like_mxnet():
    """MXNet's executors give the gradient of the loss for each input (get_input_grads)."""
    net = nn.Linear(6, 3)
    x = X[:8].clone().requires_grad_()
    nn.functional.cross_entropy(net(x), Y[:8]).backward()
    mgr = DataParallelExecutorManager(copy.deepcopy(net), ["cpu", "cpu"],
                                      loss=nn.functional.cross_entropy, inputs_need_grad=True)
    mgr.load_data_batch(DataBatch(X[:8], Y[:8]))
    mgr.forward(is_train=True)
    mgr.backward()
    (grad,) = mgr.get_input_grads()
    torch.testing.assert_close(grad, x.grad)
    (per_device,) = mgr.get_input_grads(merge_multi_context=False)
    assert [g.shape[0] for g in per_device] == [4, 4]
    mgr.close()


def test_per_token_losses_give_one_devices_update_on_several():
    """Per-token labels padded with the ignore index: each device's mean loss is over its own
    real tokens, so slices are weighed by those counts, not by rows (else two devices moved
    a weight by 0.17 more than one in a step)."""
    seqs = [torch.randint(1, 10, (n,)) for n in [2, 7, 3, 6, 5, 1, 4, 8]]
    labs = [torch.randint(0, 4, (len(s),)) for s in seqs]

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.e, self.o = nn.Embedding(10, 8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o(self.e(x)).transpose(1, 2)

    out = []
    for devices in (["cpu"], ["cpu", "cpu"], ["cpu"] * 3):
        model = fitdp.Model(Tagger())
        model.compile("sgd", lr=0.5)
        it = fitdp.BucketIterator(seqs, labs, batch_size=8, buckets=[8], shuffle=False)
        h = model.fit(it, devices=devices, verbose=0)
        out.append((h.history["loss"][0], weights(model)))
    for loss, w in out[1:]:
        assert loss == pytest.approx(out[0][0], rel=1e-6)
        for k, v in w.items():
            torch.testing.assert_close(v, out[0][1][k], rtol=1e-6, atol=1e-7)


def test_dropout_in_turn_costs_are_bounded():
    """Reproducible dropout runs CPU replicas' forwards in device order; a module that draws
    no random numbers keeps them concurrent (probed on the first step)."""
    model = fitdp.Model(mlp())
    model.compile(optimizer="sgd")
    model.fit(X, Y, devices=["cpu", "cpu"], verbose=0)
    assert model._replicas.manager.execgrp.stochastic is False
    model = fitdp.Model(mlp(dropout=0.1))
    model.compile(optimizer="sgd")
    t = time.perf_counter()
    model.fit(X, Y, devices=["cpu", "cpu"], verbose=0)
    assert model._replicas.manager.execgrp.stochastic is True
    assert time.perf_counter() - t < 30


class _TupleTokenLoss:
    """A loss over tuple targets ``(tokens, mask)`` that says what it averages (counts)."""

    def __call__(self, out: torch.Tensor, y: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y[0], ignore_index=-100)

    def counts(self, y: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (y[0] != -100).sum()


class _OwnStep(fitdp.Model):
    def train_step(self, data):
        x, y = data
        return self.compute_loss(x, y, self(x, training=True))


@pytest.mark.parametrize("cls", [fitdp.Model, _OwnStep])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_logged_loss_of_counted_tuple_targets_is_the_token_mean_on_any_device_count(
        cls, devices):
    """Regression (issue 28.17): with tuple targets and a loss that has counts(), History's
    loss was weighed by rows on one device (1.2595) and by counts on two (1.2459)."""
    g = torch.Generator().manual_seed(0)
    x, tokens = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    tokens[torch.rand(40, generator=g) < 0.4] = -100
    mask = torch.rand(40, generator=g)
    torch.manual_seed(0)
    model = cls(nn.Linear(6, 3))
    model.compile("sgd", lr=0.0, loss=_TupleTokenLoss())  # no update: one weight all epoch
    h = model.fit(x, (tokens, mask), batch_size=10, shuffle=False, devices=devices, verbose=0)
    # docs/bucketing.md: the epoch's loss is the mean over every real token of the epoch.
    with torch.no_grad():
        ref = nn.functional.cross_entropy(model.module(x), tokens, ignore_index=-100)
    assert h.history["loss"][0] == pytest.approx(float(ref), rel=1e-6)
