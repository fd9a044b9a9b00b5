"""One rank of a 2-process gloo job training tiny BERTs from a ``datasets.Dataset`` of text
through a collator (padding; MLM masking; a tagger's rows grouped by length for two shuffled
epochs), launched by tests/distributed/test_hf_data_ranks.py. Rank 0 saves the weights, the
History, the evaluate logs and the classifier's logits.

Usage: torchrun ... hf_data_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
import fitdp  # noqa: E402
from tests import hf_data  # noqa: E402
from tests.model.test_hf_datasets import LR, SEED  # noqa: E402

torch.set_num_threads(1)
OUT, RANK, BATCH = sys.argv[1], int(os.environ["RANK"]), 4

RUNS = {"classify": ("classify", {"shuffle": False}), "mlm": ("mlm", {"shuffle": False}),
        "tag_grouped": ("tag", {"epochs": 2, "group_by_length": True})}

for name, (task, how) in RUNS.items():
    model = fitdp.Model(hf_data.model(task))
    model.compile("sgd", lr=LR, loss=None, loss_items=hf_data.LOSS_ITEMS[task], strategy="ddp")
    ds, collate = hf_data.dataset(task), hf_data.collator(task)
    history = model.fit(ds, batch_size=BATCH, seed=SEED, verbose=0, collate_fn=collate, **how)
    torch.manual_seed(1)
    logs = model.evaluate(ds, batch_size=BATCH, verbose=0, collate_fn=collate)
    torch.manual_seed(2)
    logits = model.predict(ds, batch_size=BATCH, collate_fn=collate)["logits"] \
        if task == "classify" else None
    if RANK == 0:
        torch.save({"weights": model.module.state_dict(), "history": history.history,
                    "evaluate": logs, "logits": logits}, os.path.join(OUT, f"{name}.pt"))
