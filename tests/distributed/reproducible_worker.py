"""One rank of tests/distributed/test_reproducible_ranks.py's 2-rank job: the reproducible
fit of ``test_reproducible_ranks.fit_mlp`` at half the global batch per rank, under DDP
(strategy "auto", one device per rank) and fitdp's own reduction (two CPU replicas per
rank, uneven loads); rank 0 saves what the test compares with one process.

Usage: torchrun ... reproducible_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_reproducible_ranks import BATCH, fit_mlp  # noqa: E402

OUT = sys.argv[1]
torch.set_num_threads(1)
for name, devices, loads in (("ddp", ["cpu"], None), ("local2", ["cpu", "cpu"], [1, 3])):
    got = fit_mlp(BATCH // 2, devices, loads)
    if int(os.environ["RANK"]) == 0:
        torch.save(got, os.path.join(OUT, f"{name}.pt"))
    print(f"{name} ok", flush=True)
