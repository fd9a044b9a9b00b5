"""Keras 3's step overrides on ``fitdp.Model`` (mixed into it): ``train_step``,
``test_step``, ``predict_step``, ``compute_loss``, the model called as ``self(x)``, and
``optimizer_step`` for a step that takes its own optimizer steps (a GAN).

Each step runs per device slice on that device's replica (``fitdp.call.custom_step``).
The defaults are the built-in step, so a subclass overrides only what it changes; a model
that overrides nothing never goes through them (the built-in path, at its speed).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fitdp.call.custom_step import overridden, step_context
from fitdp.call.gather import current
from fitdp.checks import fail
from fitdp.compiled.optimizers import MultiOptimizer
from fitdp.executor.replica import call_module


def unpack_x_y_sample_weight(data: Any) -> tuple[Any, Any, Any]:
    """Keras's ``keras.utils.unpack_x_y_sample_weight``: ``(x, y, sample_weight)`` from a
    step's ``data`` (``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``; y and the
    weights None where absent). A list is read as the tuple (a DataLoader's default collate
    yields lists); an empty or longer tuple is an error, as in Keras
    (keras/src/trainers/data_adapters/data_adapter_utils.py).

    Args:
        data: the step's batch.

    Returns:
        ``(x, y, sample_weight)``.

    Raises:
        ValueError: ``data`` is an empty tuple or list, or one of more than 3 items.

    Example:
        >>> unpack_x_y_sample_weight((1, 2))
        (1, 2, None)
        >>> unpack_x_y_sample_weight([1, 2])
        (1, 2, None)
    """
    if not isinstance(data, (tuple, list)):
        return data, None, None
    if not 1 <= len(data) <= 3:
        fail("unpack_x_y_sample_weight(data)", f"a {type(data).__name__} of {len(data)} items",
             "x, (x,), (x, y) or (x, y, sample_weight), as in Keras",
             "pack several inputs as one item: ((x1, x2), y)", described=True)
    return (*data, *([None] * (3 - len(data))))  # type: ignore[return-value]


class KerasSteps:
    """The overridable steps (module docstring); ``Model`` holds the rest."""

    _compiled: Any
    _module: nn.Module

    @property
    def steps_overridden(self) -> bool:
        """Whether this model's class overrides a step (then it trains through them)."""
        return overridden(self, KerasSteps)

    @property
    def labels_optional(self) -> bool:
        """Whether fit/evaluate may take ``x`` without ``y``: a model with its own step may
        train without targets (autoencoders, self-supervised; compute_loss gets y=None), and
        a module that computes its own loss (``compile(loss=None)``) finds them in the batch
        dict."""
        own = self._compiled is not None and hasattr(self._compiled.objective, "loss_of")
        return own or self.steps_overridden

    @property
    def module(self) -> nn.Module:
        """The network. Inside a step: the replica the step runs on; else the host module
        (the trained, device-averaged weights between calls)."""
        context = current()
        if context is not None and context.owner is self:
            return context.module
        return self._module

    @module.setter
    def module(self, value: nn.Module) -> None:
        self._module = value

    def __call__(self, x: Any = None, training: bool | None = None, **kwargs: Any) -> Any:
        """The module on ``x`` (a tensor, a tuple of inputs or a dict of keyword inputs) and
        ``kwargs`` (``self(**batch, labels=y)`` for a Hugging Face model); inside a step on
        the step's replica. ``training`` switches the replica's mode for this call only
        (Keras's ``training=``; fitdp already runs training steps in train mode and the
        others in eval mode)."""
        context = current()
        mine = context is not None and context.owner is self
        module = self.module
        fn = context.fn if mine and context.fn is not None else module  # type: ignore[union-attr]
        switch = training is not None and module.training is not training
        if switch:
            module.train(bool(training))
        try:
            outputs = fn(**kwargs) if x is None and kwargs else call_module(fn, x, kwargs)
        finally:
            if switch:
                module.train(not training)
        if mine:
            context.outputs = outputs  # type: ignore[union-attr]
        return outputs

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None,
                     sample_weight: Any = None, training: bool = True) -> torch.Tensor:
        """Compile's loss of ``y_pred`` against ``y`` (with ``sample_weight``), the mean over
        the slice; ``y_pred`` is also what compile's metrics see. Override it for a loss
        that needs ``x`` or no targets (``fit(x)`` without ``y``).

        Raises:
            RuntimeError: before ``compile``.
            ValueError: no targets (``y`` is None) for compile's loss.
        """
        if self._compiled is None:
            raise RuntimeError("compute_loss: the model is not compiled; call "
                               "model.compile(...) first")
        context = current()
        if context is not None and context.owner is self:
            context.outputs = y_pred
        objective = self._compiled.objective
        if y is None and not hasattr(objective, "loss_of"):  # loss=None: y_pred holds it
            fail("y", None, "targets for compile's loss", "pass y to fit/evaluate, or "
                 "override compute_loss (or train_step) for a loss without targets",
                 error=ValueError)
        return objective(y_pred, y) if sample_weight is None else objective(
            y_pred, y, sample_weight)

    def train_step(self, data: Any) -> torch.Tensor | dict[str, Any]:
        """One device slice's training step: returns its loss (the slice's mean), or a dict
        of logs holding ``"loss"``; fitdp does backward, the reduce across devices and
        ranks, unscaling, clipping, accumulation and the optimizer step.

        Args:
            data: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` of this slice.
        """
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True)
        return self.compute_loss(x, y, y_pred, sample_weight, training=True)

    def test_step(self, data: Any) -> torch.Tensor | dict[str, Any] | None:
        """One device slice's evaluation step: its loss (or logs holding it); compile's
        metrics see the outputs."""
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        if y is None and type(self).compute_loss is KerasSteps.compute_loss:
            return None  # no targets and compile's loss: outputs only
        return self.compute_loss(x, y, y_pred, sample_weight, training=False)

    def predict_step(self, data: Any) -> Any:
        """One device slice's predictions (rows in input order)."""
        x, _, _ = unpack_x_y_sample_weight(data)
        return self(x, training=False)

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The compiled optimizers by name (one: ``{"0": optimizer}``)."""
        if self._compiled is None:
            return {}
        opt = self._compiled.optimizer
        return dict(opt.optimizers) if isinstance(opt, MultiOptimizer) else {"0": opt}

    def optimizer_step(self, name: str, loss: torch.Tensor) -> None:
        """Inside ``train_step``: one step of the optimizer ``name`` from ``loss`` (this
        slice's mean), Lightning's manual optimization. Every replica zeroes its gradients
        and backpropagates its weighted loss; then the executor's one update runs, as for
        fitdp's own step: the gradients summed across the replicas and ranks (the whole
        batch's gradient, as one device), unscaled (16-mixed), clipped to
        ``grad_clip_norm`` (this optimizer's parameters), the step on device 0's
        parameters, copied to every replica before the step goes on. Every replica must
        call it the same times in the same order. ``grad_accum_steps`` > 1 is refused with
        several optimizers (accumulate in the step, as Lightning's manual optimization).

        Raises:
            RuntimeError: outside a step.
            ValueError: an unknown ``name``.
        """
        context = step_context("optimizer_step")
        optimizers = self.optimizers
        if name not in optimizers:
            fail("optimizer_step(name)", name, f"one of {sorted(optimizers)}",
                 "compile(optimizer={name: ..., ...}) names them", error=ValueError)
        context.step.backward(context, optimizers[name], loss)
