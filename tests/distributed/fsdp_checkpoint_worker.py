"""One rank of tests/distributed/test_strategy.py's FSDP2 checkpoint job: a fit under
strategy="fsdp" saves a checkpoint at its first epoch's end (every rank calls ``save``:
the shards are gathered, rank 0 writes), then a new model resumes from it on 2 ranks; rank 0
writes both runs' final weights and ``get_weights`` as of the checkpoint.

Usage: torchrun ... fsdp_checkpoint_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import fitdp

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
CHECKPOINT = os.path.join(OUT, "fsdp.ckpt")
ASYNC = os.path.join(OUT, "fsdp-async.ckpt")  # the same state, through async_save=True
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(40, 6, generator=g)
y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


class SaveFirstEpoch(fitdp.callbacks.Callback):
    """Every rank saves (ModelCheckpoint saves from rank 0 alone: not with "fsdp")."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if epoch == 0:
            self.model.save(CHECKPOINT)
            self.model.save(ASYNC, async_save=True)
            weights = self.model.get_weights()
            if RANK == 0:
                torch.save(weights, os.path.join(OUT, "at-checkpoint.pt"))


def model() -> fitdp.Model:
    torch.manual_seed(RANK)  # rank 0's weights reach every rank
    m = fitdp.Model(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)))
    m.compile(optimizer="adamw", lr=0.05, loss="cross_entropy", grad_accum_steps=2,
              grad_clip_norm=0.05, strategy=fitdp.FSDP(blocks=(nn.Linear,)))
    return m


whole = model()
whole.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, callbacks=[SaveFirstEpoch()])
resumed, resumed_async = model(), model()
resumed.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, resume=CHECKPOINT)
resumed_async.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, resume=ASYNC)
for name, m in (("uninterrupted", whole), ("resumed", resumed),
                ("resumed-async", resumed_async)):
    weights = m.get_weights()  # rank 0 alone: fit's end gathered the shards
    if RANK == 0:
        torch.save(weights, os.path.join(OUT, f"{name}.pt"))
if RANK == 0:  # rank 0 alone too (the host is whole since fit's end)
    whole.export(os.path.join(OUT, "fsdp.pt2"), x[:4])
refused = model()
torch.manual_seed(0)  # rank 0's initial weights: every rank's once the fit has started
before = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).state_dict()
try:  # saves from rank 0 alone: refused when the fit starts, not a hang
    refused.fit(x, y, batch_size=5, epochs=1, verbose=0,
                callbacks=[fitdp.callbacks.ModelCheckpoint(os.path.join(OUT, "mc.ckpt"))])
except ValueError as err:
    unchanged = all(torch.equal(v, refused.get_weights()[k]) for k, v in before.items())
    print(f"rank {RANK} refused: {'ModelCheckpoint' in str(err)}, unchanged: {unchanged}",
          flush=True)
print(f"rank {RANK} fsdp checkpoint done", flush=True)
