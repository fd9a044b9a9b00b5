"""A custom step's optimizer steps go through the executor's one update (issue 19 gaps):
``Model.optimizer_step`` with clipping and a GradScaler, accumulation refused with several
optimizers, class_weight without targets; each against a hand-written torch loop.

Lightning's manual optimization (``self.manual_backward(loss)``, ``opt.step()``) clips with
``self.clip_gradients(opt, ...)`` on that optimizer's parameters, scales every backward by
the precision plugin's ``GradScaler`` and steps and updates the scaler once per
``opt.step()``; it leaves accumulation to the user's step. fitdp's ``optimizer_step`` does
the same, through the executor's ``Update`` (reduce, unscale, clip, step, broadcast).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitdp
from tests.call.test_custom_step import DEVICES, GAN, GANModel, X, _batches, _gan_step


def _reference(real: torch.Tensor, size: int, clip: float | None,
               scale: float = 1.0) -> GAN:
    """The GAN loop of test_custom_step by hand: each optimizer's own gradients clipped."""
    gan = GAN()
    d_opt = torch.optim.Adam(gan.discriminator.parameters(), lr=0.01)
    g_opt = torch.optim.SGD(gan.generator.parameters(), lr=0.1)
    bce = nn.functional.binary_cross_entropy_with_logits
    for sl in _batches(len(real), size):
        noise = real[sl, :2] * 0.5
        for opt, part in ((d_opt, gan.discriminator), (g_opt, gan.generator)):
            gan.zero_grad()
            if opt is d_opt:
                loss, _ = _gan_step(gan, real[sl], noise)
            else:
                loss = bce(gan.discriminator(gan.generator(noise)),
                           torch.zeros(len(real[sl]), 1))
            (loss * scale).backward()
            for p in part.parameters():
                p.grad /= scale
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(list(part.parameters()), clip)
            opt.step()
    return gan


def _model(**compile_kw) -> GANModel:
    gan = GAN()
    model = GANModel(gan)
    model.compile(optimizer={
        "d": torch.optim.Adam(gan.discriminator.parameters(), lr=0.01),
        "g": torch.optim.SGD(gan.generator.parameters(), lr=0.1)}, **compile_kw)
    return model


@pytest.mark.parametrize("devices", DEVICES)
def test_optimizer_step_clips_each_optimizers_gradients(devices: list[str]) -> None:
    """Regression: grad_clip_norm was ignored by Model.optimizer_step (its own step)."""
    real = X[:40]
    ref = _reference(real, 10, clip=0.05)
    model = _model(grad_clip_norm=0.05)
    model.fit(real, batch_size=10, shuffle=False, devices=devices, verbose=0)
    torch.testing.assert_close(dict(model.module.named_parameters()),
                               dict(ref.named_parameters()))
    unclipped = _reference(real, 10, clip=None)
    assert not torch.allclose(unclipped.generator[0].weight, ref.generator[0].weight)


@pytest.mark.parametrize("devices", DEVICES)
def test_optimizer_step_scales_unscales_and_updates_the_grad_scaler(devices: list[str]
                                                                    ) -> None:
    """Regression: Model.optimizer_step bypassed the 16-mixed GradScaler (no scaled
    backward, no unscale, scale never updated). A CPU GradScaler stands in for CUDA's: the
    same code path, a power-of-two scale, so the update is the unscaled one."""
    real = X[:40]
    ref = _reference(real, 10, clip=0.05)
    model = _model(grad_clip_norm=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    model._compiled.scaler = scaler  # what Replicas makes for 16-mixed on CUDA
    model.fit(real, batch_size=10, shuffle=False, devices=devices, verbose=0)
    torch.testing.assert_close(dict(model.module.named_parameters()),
                               dict(ref.named_parameters()))
    assert scaler.get_scale() == 2.0 ** (8 + 4 * 2)  # updated after each of 8 steps


def test_grad_accum_steps_with_several_optimizers_is_refused_at_compile() -> None:
    """Regression: grad_accum_steps > 1 with manual optimization was silently ignored."""
    with pytest.raises(ValueError, match="grad_accum_steps.*several optimizers.*optimizer_st"):
        _model(grad_accum_steps=2)


def test_class_weight_without_targets_is_a_clear_error() -> None:
    """Regression: class_weight with fit(x) and no y said 'targets that are not a 1-D
    tensor of class indices' (misleading: there were none)."""

    class AutoEncoder(fitdp.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            return ((y_pred - x) ** 2).mean()

    net = nn.Linear(6, 6)
    before = net.weight.clone()
    model = AutoEncoder(net)
    model.compile("sgd")
    with pytest.raises(ValueError, match="class_weight: got no targets.*sample_weight"):
        model.fit(X, class_weight={0: 2.0}, verbose=0, devices=["cpu"])
    assert torch.equal(net.weight, before)
