"""One rank of a 2-process gloo job: a contrastive train_step with fitdp.all_gather across
the ranks, launched by tests/distributed/test_custom_step_ranks.py.

Usage: torchrun ... custom_step_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
from tests.call.test_custom_step import Contrastive, _net  # noqa: E402

torch.set_num_threads(1)
OUT = sys.argv[1]
views = torch.randn(40, 2, 6, generator=torch.Generator().manual_seed(7))
model = Contrastive(_net(out=4))
model.compile("sgd", lr=0.5)
# 10 rows per rank and step: the global batch of 20 that one process trains on.
model.fit(views, batch_size=10, epochs=2, shuffle=False, verbose=0)
if int(os.environ["RANK"]) == 0:
    torch.save(model.module.state_dict(), os.path.join(OUT, "weights.pt"))
