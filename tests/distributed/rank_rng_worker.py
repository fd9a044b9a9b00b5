"""One rank of tests/distributed/test_rank_generators.py's 2-rank job: the ranks draw
different amounts of randomness (dropout over padded batches of other lengths). The
uninterrupted fit (rank 0 saves its weights and History), then the same fit with
``BackupAndRestore(save_freq=3)`` crashing after step 5, then the rerun, which resumes from
step 3's backup (rank 0 saves what it ends with).

Usage: torchrun ... rank_rng_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

import fitdp
from fitdp.callbacks import BackupAndRestore, Callback

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
torch.set_num_threads(1)
G = torch.Generator().manual_seed(0)
# batch b (4 rows) holds sequences of 2 + 4 * (b % 2) tokens: rank 0's short, rank 1's long
ROWS = [(torch.randint(1, 30, (2 + 4 * (i // 4 % 2),), generator=G), int(i % 3 == 0))
        for i in range(48)]


def pad(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a batch to its longest sequence."""
    x = nn.utils.rnn.pad_sequence([r[0] for r in rows], batch_first=True)
    return x, torch.tensor([r[1] for r in rows])


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.drop, self.out = nn.Embedding(30, 8), nn.Dropout(0.5), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.embed(x)).mean(1))


class Crash(Callback):
    """Both ranks stop after step 5 (after step 3's backup), as a crashed job."""

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == 5:
            raise KeyboardInterrupt("crash after step 5")


def fit(*callbacks: Callback) -> tuple[fitdp.Model, dict]:
    torch.manual_seed(0)
    model = fitdp.Model(Bag())
    model.compile("adam", "cross_entropy", lr=0.05)
    loader = DataLoader(ROWS, batch_size=4, collate_fn=pad)  # 12 batches: 6 steps per epoch
    history = model.fit(loader, epochs=2, seed=1, verbose=0, callbacks=list(callbacks))
    return model, history.history


def save(name: str, model: fitdp.Model, history: dict) -> None:
    if RANK == 0:
        torch.save({"weights": model.module.state_dict(), "history": history},
                   os.path.join(OUT, name))


backup = BackupAndRestore(os.path.join(OUT, "backup"), save_freq=3)
save("uninterrupted.pt", *fit())
try:
    fit(backup, Crash())
except KeyboardInterrupt:
    pass
save("resumed.pt", *fit(backup))  # the rerun: resumes from step 3's backup
print("done", flush=True)
