"""One rank of tests/distributed/test_zero1.py's job: the same fit under strategy="ddp" and
"zero1" (AdamW, accumulation, clipping, a scheduler), then zero1 checkpoints: a whole file by
rank 0 after every rank shared (epoch 0's end), a sharded folder by every rank, a backup
after every step with a crash mid-epoch and a resumed fit. Rank 0 writes the weights.

Usage: torchrun ... zero1_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(40, 6, generator=g)
y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
# 40 rows, 5 a rank: 4 global batches of 10 an epoch, 2 accumulated per optimizer step


def model(strategy: str = "zero1") -> fitdp.Model:
    torch.manual_seed(RANK)  # rank 0's weights reach every rank
    m = fitdp.Model(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)))
    m.compile(optimizer="adamw", lr=0.05, loss="cross_entropy", grad_accum_steps=2,
              grad_clip_norm=0.05, strategy=strategy,
              lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    return m


def fit(m: fitdp.Model, **kwargs) -> None:
    m.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, **kwargs)


def keep(name: str, m: fitdp.Model) -> None:
    weights = m.get_weights()
    if RANK == 0:
        torch.save(weights, os.path.join(OUT, f"{name}.pt"))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


class Saves(fitdp.callbacks.Callback):
    """After step 1, rank 0 alone saves (refused: not shared since the step); at epoch 0's
    end every rank shares and rank 0 saves a file, and every rank saves a sharded folder."""

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self.model.global_step == 1 and self.model.run.micro_step == 0 and RANK == 0:
            try:
                self.model.save(os.path.join(OUT, "refused.ckpt"))
            except RuntimeError as err:
                print(f"rank 0 unshared save refused: {'share_epoch_logs' in str(err)}, "
                      f"file written: {os.path.exists(os.path.join(OUT, 'refused.ckpt'))}",
                      flush=True)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if epoch == 0:
            self.model.share_epoch_logs()
            if RANK == 0:
                self.model.save(os.path.join(OUT, "zero1-whole.ckpt"))
            self.model.save(os.path.join(OUT, "zero1-sharded.ckpt"), sharded=True)
            keep("at-checkpoint", self.model)


class Crash(BaseException):
    """An interruption on every rank after the 3rd of 4 optimizer steps (mid-epoch 1)."""


def crash_after_step_3(m: fitdp.Model) -> fitdp.callbacks.Callback:
    def end(batch: int, logs: dict[str, float] | None = None) -> None:
        if m.global_step == 3:
            raise Crash
    return fitdp.callbacks.LambdaCallback(on_train_batch_end=end)


class Held(fitdp.callbacks.Callback):
    """The optimizer state bytes this rank holds after a step (the sharded optimizer's part
    under zero1: the compiled optimizer holds none while the replicas run)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        engine = self.model._replicas.engine
        optimizer = engine.zero.optim if getattr(engine, "zero", None) is not None \
            else self.model.optimizer
        self.held = max(self.held, state_bytes(optimizer))


held = {}
for strategy in ("ddp", "zero1"):
    m, probe = model(strategy), Held()
    fit(m, callbacks=[probe] + ([Saves()] if strategy == "zero1" else []))
    held[strategy] = probe.held
    keep(strategy, m)
    if strategy == "zero1":  # after fit: whole on every rank, rank 0 alone may save
        print(f"rank {RANK} after fit: state bytes {state_bytes(m.optimizer)}", flush=True)
        if RANK == 0:
            m.save(os.path.join(OUT, "zero1-after.ckpt"))
    m.close()
print(f"rank {RANK} optimizer state bytes: ddp {held['ddp']} zero1 {held['zero1']}", flush=True)

folder = os.path.join(OUT, "backup")
crashing = model()
try:
    fit(crashing, callbacks=[BackupAndRestore(folder, save_freq=1), crash_after_step_3(crashing)])
except Crash:
    pass
again = model()  # finds the backup (step 3, mid-epoch 1) and resumes from it
fit(again, callbacks=[BackupAndRestore(folder, save_freq=1)])
print(f"rank {RANK} resumed from step {again.history.params['resumed']['step']}", flush=True)
keep("backup-resumed", again)
print(f"rank {RANK} zero1 done", flush=True)
