"""Keras 3's step overrides on fitdp.Model subclasses, all_gather and several optimizers
(issue 19 items 1-4), each against a hand-written torch loop on one device.

Keras's semantics (keras/src/backend/torch/trainer.py, ``TorchTrainer.train_step``): the step
gets ``data`` and unpacks ``x, y, sample_weight`` (``data_adapter_utils.
unpack_x_y_sample_weight``), calls ``y_pred = self(x, training=True)`` and
``loss = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
training=True)``, then backward and ``optimizer.apply`` itself, and returns
``compute_metrics(x, y, y_pred, sample_weight)`` (fitdp's step returns the loss and fitdp
takes the update, docs/custom-fit.md's table); ``test_step`` runs ``self(x, training=False)``;
``predict_step`` returns ``self(x, training=False)``. The guide "Customizing what happens
in fit() with PyTorch" overrides these, and ends with a GAN taking a discriminator step
then a generator step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitdp
from fitdp.call.custom_step import CustomStep

DEVICES = [["cpu"], ["cpu", "cpu"]]
X = torch.randn(48, 6, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (48,), generator=torch.Generator().manual_seed(1))


def _net(seed: int = 3, out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, out))


def _batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class SquaredLoss(fitdp.Model):
    """The guide's first example: compute_loss overridden (here: a loss compile does not
    name), the rest Keras's default train_step."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self.calls = getattr(self, "calls", 0) + 1
        onehot = nn.functional.one_hot(y, 3).float()
        return ((y_pred - onehot) ** 2).sum(1).mean()


@pytest.mark.parametrize("devices", DEVICES)
def test_compute_loss_override_trains_as_a_hand_loop(devices: list[str]) -> None:
    """Regression: an overridden compute_loss was silently ignored (0 calls)."""
    net = _net()
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for sl in _batches(48, 20) * 2:
        opt.zero_grad()
        ((ref(X[sl]) - nn.functional.one_hot(Y[sl], 3).float()) ** 2).sum(1).mean().backward()
        opt.step()
    model = SquaredLoss(net)
    model.compile("sgd", lr=0.1)
    model.fit(X, Y, batch_size=20, epochs=2, shuffle=False, devices=devices, verbose=0)
    assert model.calls == 6 * len(devices)
    torch.testing.assert_close(dict(net.named_parameters()), dict(ref.named_parameters()))


class AutoEncoder(fitdp.Model):
    """fit(x) without y: the step reconstructs its inputs."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        assert y is None
        return ((y_pred - x) ** 2).mean()


@pytest.mark.parametrize("devices", DEVICES)
def test_fit_without_y_trains_an_autoencoder_as_a_hand_loop(devices: list[str]) -> None:
    """Regression: fit(x) without y was refused."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(6, 2), nn.Linear(2, 6))
    ref = nn.Sequential(nn.Linear(6, 2), nn.Linear(2, 6))
    ref.load_state_dict(net.state_dict())
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for sl in _batches(48, 16):
        opt.zero_grad()
        ((ref(X[sl]) - X[sl]) ** 2).mean().backward()
        opt.step()
    model = AutoEncoder(net)
    model.compile("adam", lr=0.01)
    h = model.fit(X, batch_size=16, shuffle=False, devices=devices, verbose=0)
    torch.testing.assert_close(dict(net.named_parameters()), dict(ref.named_parameters()))
    assert h.history["loss"][0] > 0
    preds = model.predict(X, devices=devices)
    torch.testing.assert_close(preds, ref(X).detach())


class LowLevel(fitdp.Model):
    """The guide's low-level train_step: its own loss, a dict of logs with "loss"."""

    def train_step(self, data):
        x, y = data
        y_pred = self.module(x)
        loss = nn.functional.cross_entropy(y_pred, y, label_smoothing=0.1)
        return {"loss": loss, "pred_mean": y_pred.mean()}

    def test_step(self, data):
        x, y = data
        return {"loss": nn.functional.cross_entropy(self(x), y), "seen": 1.0}

    def predict_step(self, data):
        (x,) = data
        return self(x).softmax(-1)


@pytest.mark.parametrize("devices", DEVICES)
def test_train_test_predict_steps_run_per_slice(devices: list[str]) -> None:
    """train_step's logs reach the history; test_step and predict_step replace their passes."""
    net, ref = _net(), _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    means = []
    for sl in _batches(48, 24):
        opt.zero_grad()
        out = ref(X[sl])
        means.append(out.mean().item())
        nn.functional.cross_entropy(out, Y[sl], label_smoothing=0.1).backward()
        opt.step()
    model = LowLevel(net)
    model.compile("sgd", lr=0.2)
    h = model.fit(X, Y, batch_size=24, shuffle=False, devices=devices, verbose=0,
                  validation_data=(X, Y))
    torch.testing.assert_close(dict(net.named_parameters()), dict(ref.named_parameters()))
    assert h.history["pred_mean"][0] == pytest.approx(sum(means) / 2, abs=1e-6)
    assert h.history["val_seen"] == [1.0]
    val = nn.functional.cross_entropy(ref(X), Y).item()
    assert h.history["val_loss"][0] == pytest.approx(val, abs=1e-6)
    torch.testing.assert_close(model.predict(X, devices=devices), ref(X).softmax(-1).detach())


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.5) -> torch.Tensor:
    """SimCLR's NT-Xent over two views (the whole batch's negatives)."""
    z = nn.functional.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    sim = z @ z.T / tau
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return nn.functional.cross_entropy(sim, target)


class Contrastive(fitdp.Model):
    def train_step(self, data):
        (views,) = data
        z1, z2 = self(views[:, 0]), self(views[:, 1])
        return nt_xent(fitdp.all_gather(z1), fitdp.all_gather(z2))


@pytest.mark.parametrize("devices", DEVICES)
def test_all_gather_contrastive_loss_equals_the_whole_batch(devices: list[str]) -> None:
    """Regression: NT-Xent on 2 replicas saw half the negatives (weights 1.2e-2 away)."""
    views = torch.randn(40, 2, 6, generator=torch.Generator().manual_seed(7))
    net, ref = _net(out=4), _net(out=4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for sl in _batches(40, 20) * 2:
        opt.zero_grad()
        loss = nt_xent(ref(views[sl, 0]), ref(views[sl, 1]))
        losses.append(loss.item())
        loss.backward()
        opt.step()
    model = Contrastive(net)
    model.compile("sgd", lr=0.5)
    h = model.fit(views, batch_size=20, epochs=2, shuffle=False, devices=devices, verbose=0)
    torch.testing.assert_close(dict(net.named_parameters()), dict(ref.named_parameters()))
    assert h.history["loss"][1] == pytest.approx(sum(losses[2:]) / 2, abs=1e-5)


def test_all_gather_outside_a_step_is_the_identity_and_checks_its_argument() -> None:
    t = torch.ones(3, 2)
    assert fitdp.all_gather(t) is t
    with pytest.raises(TypeError, match="torch.Tensor"):
        fitdp.all_gather([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0-d"):
        fitdp.all_gather(torch.tensor(1.0))


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.generator = nn.Sequential(nn.Linear(2, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1))


def _gan_step(gan: nn.Module, real: torch.Tensor, noise: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The guide's GAN: discriminator on real and generated, then generator."""
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = gan.generator(noise)
    both = torch.cat([fake.detach(), real])
    labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
    d_loss = bce(gan.discriminator(both), labels)
    return d_loss, labels


class GANModel(fitdp.Model):
    def train_step(self, data):
        (real,) = data
        gan = self.module
        noise = real[:, :2] * 0.5  # deterministic "noise" from the batch: same on any split
        d_loss, _ = _gan_step(gan, real, noise)
        self.optimizer_step("d", d_loss)
        g_loss = nn.functional.binary_cross_entropy_with_logits(
            gan.discriminator(gan.generator(noise)), torch.zeros(len(real), 1))
        self.optimizer_step("g", g_loss)
        return {"d_loss": d_loss, "g_loss": g_loss}


def _gan_reference(real: torch.Tensor, size: int, epochs: int) -> GAN:
    gan = GAN()
    d_opt = torch.optim.Adam(gan.discriminator.parameters(), lr=0.01)
    g_opt = torch.optim.SGD(gan.generator.parameters(), lr=0.1)
    for sl in _batches(len(real), size) * epochs:
        noise = real[sl, :2] * 0.5
        d_opt.zero_grad()
        d_loss, _ = _gan_step(gan, real[sl], noise)
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad()
        gan.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(
            gan.discriminator(gan.generator(noise)), torch.zeros(len(real[sl]), 1)).backward()
        g_opt.step()
    return gan


def _gan_model() -> GANModel:
    gan = GAN()
    model = GANModel(gan)
    model.compile(optimizer={
        "d": torch.optim.Adam(gan.discriminator.parameters(), lr=0.01),
        "g": torch.optim.SGD(gan.generator.parameters(), lr=0.1)})
    return model


@pytest.mark.parametrize("devices", DEVICES)
def test_gan_with_two_optimizers_equals_a_hand_loop(devices: list[str]) -> None:
    """Regression: a GAN (two optimizers) could not be written at all."""
    real = X[:40]
    ref = _gan_reference(real, 10, 2)
    model = _gan_model()
    h = model.fit(real, batch_size=10, epochs=2, shuffle=False, devices=devices, verbose=0)
    torch.testing.assert_close(dict(model.module.named_parameters()),
                               dict(ref.named_parameters()))
    assert set(h.history) >= {"d_loss", "g_loss"} and "loss" not in h.history
    assert model.global_step == 8
    # each optimizer's rate under its name (the first one's logged as "lr" misnamed g's)
    assert h.history["d_lr"] == [0.01, 0.01] and h.history["g_lr"] == [0.1, 0.1]
    assert "lr" not in h.history


def test_gan_checkpoint_resumes_both_optimizers(tmp_path) -> None:
    """Both optimizers' states are saved and restored: 1 + 1 epochs equal 2."""
    real = X[:40]
    ref = _gan_reference(real, 10, 2)
    first = _gan_model()
    first.fit(real, batch_size=10, shuffle=False, devices=["cpu", "cpu"], verbose=0)
    first.save(tmp_path / "gan.ckpt")
    second = _gan_model()
    second.load(tmp_path / "gan.ckpt")
    assert second.optimizers["d"].state  # Adam's moments came back
    second.fit(real, batch_size=10, shuffle=False, devices=["cpu", "cpu"], verbose=0)
    torch.testing.assert_close(dict(second.module.named_parameters()),
                               dict(ref.named_parameters()))


def test_optimizer_step_checks_its_name_and_needs_a_step() -> None:
    model = _gan_model()
    with pytest.raises(RuntimeError, match="outside a step"):
        model.optimizer_step("d", torch.zeros(()))

    class Wrong(GANModel):
        def train_step(self, data):
            self.optimizer_step("x", self.module.discriminator(data[0]).mean())

    bad = Wrong(GAN())
    bad.compile(optimizer={"d": "sgd"})
    with pytest.raises(ValueError, match="optimizer_step"):
        bad.fit(X, batch_size=8, verbose=0, devices=["cpu"])


def test_a_model_that_overrides_nothing_keeps_the_built_in_step() -> None:
    """No CustomStep in the path of a plain Model (its speed is the built-in step's)."""
    model = fitdp.Model(_net())
    model.compile("sgd")
    model.fit(X, Y, verbose=0, devices=["cpu", "cpu"])
    assert model._replicas is not None and model._replicas.step is None
    sub = SquaredLoss(_net())
    sub.compile("sgd")
    sub.fit(X, Y, verbose=0, devices=["cpu", "cpu"])
    assert isinstance(sub._replicas.step, CustomStep)  # type: ignore[union-attr]


def test_self_module_is_the_replica_inside_a_step_and_the_host_outside() -> None:
    seen = []

    class Probe(fitdp.Model):
        def train_step(self, data):
            seen.append(self.module)
            return super().train_step(data)

    net = _net()
    model = Probe(net)
    model.compile("sgd")
    model.fit(X, Y, batch_size=48, verbose=0, devices=["cpu", "cpu"])
    assert model.module is net
    assert len(seen) == 2 and seen[0] is not seen[1] and net not in seen


@pytest.mark.parametrize("devices", DEVICES)
def test_train_step_dict_without_loss_is_refused_before_any_weight_moves(
        devices: list[str]) -> None:
    """A train_step dict without "loss" ran epochs training nothing (issue 28 item 7)."""

    class NoLoss(fitdp.Model):
        def train_step(self, data):
            x, y, _ = fitdp.unpack_x_y_sample_weight(data)
            return {"total": self.compute_loss(x, y, self(x)), "acc": torch.tensor(0.5)}

    model = NoLoss(_net())
    model.compile("sgd", lr=0.1)
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(ValueError, match=r"train_step: got a dict with keys \['acc', 'total'\]"
                       r".*return \{'loss': loss"):
        model.fit(X, Y, batch_size=8, verbose=0, devices=devices)
    torch.testing.assert_close(model.module.state_dict(), before, rtol=0, atol=0)
    assert model.global_step == 0


def test_unpack_x_y_sample_weight_reads_a_list_and_refuses_four_items_as_keras() -> None:
    """unpack_x_y_sample_weight([x, y]) gave ([x, y], None, None) and a 4-tuple was taken
    as x; Keras (keras/src/trainers/data_adapters/data_adapter_utils.py) turns a list into a
    tuple, gives (x, y, None), and raises ValueError for any tuple not of 1 to 3 items."""
    x, y, w = torch.ones(2, 3), torch.zeros(2), torch.full((2,), 0.5)
    assert fitdp.unpack_x_y_sample_weight([x, y]) == (x, y, None)
    assert fitdp.unpack_x_y_sample_weight([x, y, w]) == (x, y, w)
    assert fitdp.unpack_x_y_sample_weight([x]) == (x, None, None)
    assert fitdp.unpack_x_y_sample_weight(x) == (x, None, None)
    assert fitdp.unpack_x_y_sample_weight({"a": x}) == ({"a": x}, None, None)
    for bad in ((x, y, w, w), [x, y, w, w], ()):
        with pytest.raises(ValueError, match=r"unpack_x_y_sample_weight\(data\).*\(x, y, "
                           r"sample_weight\)"):
            fitdp.unpack_x_y_sample_weight(bad)
