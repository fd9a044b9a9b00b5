"""A torchrun worker for tests/callbacks/test_grad_norm.py: GradNormLogger on 2 gloo ranks,
each rank's logged norms saved to OUT/rank<r>.pt."""

from __future__ import annotations

import os
import sys

import torch
from test_grad_norm import CLIP, BatchNorms, X, Y, net

import fitdp
from fitdp.callbacks import GradNormLogger

out = sys.argv[1]
model = fitdp.Model(net())
model.compile("sgd", lr=0.1, loss="cross_entropy", grad_clip_norm=CLIP)
probe = BatchNorms()
model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, log_every=1,
          callbacks=[GradNormLogger(), probe])
torch.save(probe.seen, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
