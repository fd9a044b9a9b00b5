"""What the EMA and SWA tests share: data, models, the torch hand loop they are held to, and
a backup that dies, to resume from."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import fitdp
from fitdp.callbacks import BackupAndRestore

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(40, 4, generator=G), torch.randint(0, 3, (40,), generator=G)
BATCH = 8  # 5 optimizer steps per epoch
LR = 0.1


def net(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(8)] if batchnorm else []
    return nn.Sequential(nn.Linear(4, 8), *norm, nn.ReLU(), nn.Linear(8, 3))


def model(module: nn.Module, optimizer: str = "sgd") -> fitdp.Model:
    m = fitdp.Model(copy.deepcopy(module))
    m.compile(optimizer=optimizer, lr=LR, loss="cross_entropy")
    return m


def batches(device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """fit(shuffle=False)'s batches, in order, on ``device``."""
    return [(X[i:i + BATCH].to(device), Y[i:i + BATCH].to(device))
            for i in range(0, len(X), BATCH)]


def hand_loop(module: nn.Module, epochs: int, averaged: AveragedModel,
              epoch_begin: Callable[[int, torch.optim.Optimizer], None] | None = None,
              epoch_end: Callable[[int], None] | None = None,
              after_step: bool = True, device: str = "cpu") -> torch.optim.Optimizer:
    """torch's training loop: SGD on the batches in order, ``averaged.update_parameters``
    after each ``optimizer.step()`` (``after_step``), the hooks around each epoch; the
    module and ``averaged`` on ``device``."""
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for epoch in range(epochs):
        if epoch_begin is not None:
            epoch_begin(epoch, opt)
        for x, y in batches(device):
            opt.zero_grad()
            nn.functional.cross_entropy(module(x), y).backward()
            opt.step()
            if after_step:
                averaged.update_parameters(module)
        if epoch_end is not None:
            epoch_end(epoch)
    return opt


def assert_params(got: dict[str, torch.Tensor], averaged: AveragedModel, exact: bool) -> None:
    """The averaged parameters of ``averaged`` in ``got``: bit for bit, or within 1e-6."""
    for name, want in averaged.module.named_parameters():
        want = want.detach().cpu()
        if exact:
            assert torch.equal(got[name], want), name
        else:
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6)


class Backup(BackupAndRestore):
    """``BackupAndRestore(save_freq=1)`` in a process that dies right after its backup of
    optimizer step ``crash_at`` (None: never)."""

    def __init__(self, folder: str, crash_at: int | None = None, **kw: bool) -> None:
        super().__init__(folder, save_freq=1, **kw)
        self.crash_at = crash_at

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self.model.global_step == self.crash_at:
            raise KeyboardInterrupt(f"died after the backup of step {self.crash_at}")
