"""A custom step on several replicas (issue 19 gaps): slices weighed by tokens for a
TokenMean loss, seeded dropout reproducible, a replica a short batch leaves idle; each
against one device or a hand-written torch loop on the same batches.

Keras's torch trainer (keras/src/backend/torch/trainer.py) runs ``train_step(data)`` once
per batch on one device; fitdp runs it per device slice, so what the slices add up to must
be what that one call would give: the built-in path's weights (rows, or a TokenMean's
tokens), the same random draws for the same seed, and every replica in each meeting.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fitdp
from fitdp.call import gather
from tests.call.test_custom_step import (
    GAN,
    Contrastive,
    GANModel,
    X,
    _batches,
    _gan_reference,
    _net,
    nt_xent,
)


def _tokens(n: int = 24, t: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token labels padded with -100, far more padding in the second half of each
    batch: weighing slices by rows would give another update than tokens."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, t, 6, generator=g)
    y = torch.randint(0, 3, (n, t), generator=g)
    for i in range(n):
        keep = t if i % 12 < 6 else 1 + i % 2
        y[i, keep:] = -100
    return x, y


def _token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


class LoggedTagger(fitdp.Model):
    """A train_step of the guide's first kind: compile's loss, plus a log of its own."""

    def train_step(self, data):
        x, y = data
        loss = self.compute_loss(x, y, self(x, training=True))
        return {"loss": loss, "tokens": (y != -100).sum()}


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_custom_step_on_a_token_mean_loss_weighs_slices_by_tokens(devices) -> None:
    """Regression: a custom step's slices were weighed by rows, not TokenMean's tokens
    (2 replicas ended away from one device on per-token labels padded with -100)."""
    x, y = _tokens()
    net, ref = _net(), _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for sl in _batches(24, 12):
        opt.zero_grad()
        loss = _token_loss(ref(x[sl]), y[sl])
        losses.append((loss.item(), int((y[sl] != -100).sum())))
        loss.backward()
        opt.step()
    model = LoggedTagger(net)
    model.compile("sgd", lr=0.5, loss=fitdp.TokenMean(_token_loss))
    h = model.fit(x, y, batch_size=12, shuffle=False, devices=devices, verbose=0)
    torch.testing.assert_close(dict(net.named_parameters()), dict(ref.named_parameters()))
    mean = sum(v * c for v, c in losses) / sum(c for _, c in losses)
    assert h.history["loss"][0] == pytest.approx(mean, abs=1e-6)


class DropoutSquared(fitdp.Model):
    def train_step(self, data):
        x, y = data
        return ((self(x, training=True) - F.one_hot(y, 4).float()) ** 2).mean()


class DropoutContrastive(Contrastive):
    """all_gather in a step whose module draws: the replicas take turns between meetings."""


class DropoutGAN(GANModel):
    """Manual optimization (two meetings a step) on a discriminator with dropout."""


def _dropout_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Dropout(0.5),
                         nn.Linear(64, 4))


def _dropout_gan() -> DropoutGAN:
    gan = GAN()
    gan.discriminator.insert(2, nn.Dropout(0.5))
    model = DropoutGAN(gan)
    model.compile(optimizer={
        "d": torch.optim.Adam(gan.discriminator.parameters(), lr=0.01),
        "g": torch.optim.SGD(gan.generator.parameters(), lr=0.1)})
    return model


@pytest.mark.parametrize("kind", ["loss", "all_gather", "optimizer_step"])
def test_seeded_custom_steps_with_dropout_on_two_cpu_replicas_are_reproducible(kind) -> None:
    """Regression: a custom step's CPU replicas ran at once and drew their dropout masks
    from the shared generator in thread order: two seeded fits gave other weights."""
    views = torch.randn(48, 2, 6, generator=torch.Generator().manual_seed(7))
    labels = (X[:, 0] > 0).long()
    runs = []
    for _ in range(2):
        if kind == "loss":
            model: fitdp.Model = DropoutSquared(_dropout_net())
            model.compile("sgd", lr=0.1)
            model.fit(X, labels, batch_size=8, epochs=3, seed=1, devices=["cpu", "cpu"],
                      verbose=0)
        elif kind == "all_gather":
            model = DropoutContrastive(_dropout_net())
            model.compile("sgd", lr=0.1)
            model.fit(views, batch_size=8, epochs=3, seed=1, devices=["cpu", "cpu"],
                      verbose=0)
        else:
            model = _dropout_gan()
            model.fit(X, batch_size=8, epochs=3, seed=1, devices=["cpu", "cpu"], verbose=0)
        runs.append({k: v.detach().clone() for k, v in model.module.state_dict().items()})
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


def test_a_replica_a_short_batch_leaves_idle_does_not_stall_all_gather(monkeypatch) -> None:
    """Regression: the last batch of 1 row on 2 replicas left replica 1 out of all_gather;
    replica 0 waited 300 s and failed."""
    monkeypatch.setattr(gather, "WAIT_SECONDS", 20.0)
    views = torch.randn(41, 2, 6, generator=torch.Generator().manual_seed(7))
    net, ref = _net(out=4), _net(out=4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for sl in _batches(41, 20):
        opt.zero_grad()
        nt_xent(ref(views[sl, 0]), ref(views[sl, 1])).backward()
        opt.step()
    model = Contrastive(net)
    model.compile("sgd", lr=0.5)
    model.fit(views, batch_size=20, shuffle=False, devices=["cpu", "cpu"], verbose=0)
    torch.testing.assert_close(dict(net.named_parameters()), dict(ref.named_parameters()))


def test_manual_optimization_on_a_batch_smaller_than_the_devices(monkeypatch) -> None:
    """Regression: optimizer_step on a 1-row batch over 3 replicas waited for the idle ones."""
    monkeypatch.setattr(gather, "WAIT_SECONDS", 20.0)
    real = X[:21]
    ref = _gan_reference(real, 10, 1)  # batches of 10, 10 and 1
    gan = GAN()
    model = GANModel(gan)
    model.compile(optimizer={
        "d": torch.optim.Adam(gan.discriminator.parameters(), lr=0.01),
        "g": torch.optim.SGD(gan.generator.parameters(), lr=0.1)})
    model.fit(real, batch_size=10, shuffle=False, devices=["cpu"] * 3, verbose=0)
    torch.testing.assert_close(dict(gan.named_parameters()), dict(ref.named_parameters()))
