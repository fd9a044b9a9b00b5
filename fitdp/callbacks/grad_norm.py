"""`GradNormLogger`: the global norm of the gradients, in the logs at every log point."""

from __future__ import annotations

from fitdp.callbacks.base import Callback


class GradNormLogger(Callback):
    """Logs `grad_norm`: the global L2 norm of the gradients each optimizer step applies,
    reduced over the devices and ranks and unscaled, before `grad_clip_norm` clips them
    (what `torch.nn.utils.clip_grad_norm_` returns; Lightning's `grad_norm`, Keras has none).

    Every optimizer step takes the norm on the device; the logs hold the last step's at each
    log point (the first batch of an epoch and every `fit(log_every=...)`-th, every batch on
    the CPU) and at the epoch's end, so History, CSVLogger, TensorBoard, MLflowLogger and
    the progress bar show it. The norm is read on the host only there: one read per log
    point, none between. The reproducible mode logs the norm of its canonical gradient.
    `self.model.step_state` holds the same values on the device between log points.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import fitdp
        >>> model = fitdp.Model(nn.Linear(4, 2))
        >>> model.compile("sgd", lr=0.1, loss="mse", grad_clip_norm=1.0)
        >>> h = model.fit(torch.randn(16, 4), torch.randn(16, 2), batch_size=8, verbose=0,
        ...               callbacks=[fitdp.callbacks.GradNormLogger()])
        >>> sorted(h.history)
        ['grad_norm', 'loss', 'lr']
    """

    logs_grad_norm = True
