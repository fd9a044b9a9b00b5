"""One rank of a 2-process gloo job training Hugging Face models on dict batches with their
own loss, launched by tests/distributed/test_huggingface_ranks.py.

For each case of tests/model/test_huggingface.py and each strategy: fit on the dict in
memory (each global batch of 8 rows split 4 + 4 over the ranks), evaluate and predict; and
GPT-2 on a DataLoader of dicts (its batches round-robin over the ranks). Rank 0 saves the
weights, the History, the evaluate logs and the predicted logits of each run.

Usage: torchrun ... hf_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
import fitdp  # noqa: E402
from tests.model.test_huggingface import (  # noqa: E402
    BATCH,
    CASES,
    LR,
    OPTIMIZER,
    loader_of_dicts,
)

torch.set_num_threads(1)
OUT = sys.argv[1]
RANK = int(os.environ["RANK"])


def run(name: str, make, data, loss_items, strategy, x=None) -> None:
    model = fitdp.Model(make())
    model.compile(OPTIMIZER, lr=LR, loss=None, loss_items=loss_items, strategy=strategy,
                  forward_kwargs={"use_cache": False} if "gpt2" in name else None,
                  metrics=["accuracy", "perplexity"] if "gpt2" in name else ["accuracy"])
    history = model.fit(data if x is None else x, batch_size=BATCH // 2, shuffle=False,
                        verbose=0)
    logs = model.evaluate(data, batch_size=BATCH // 2, verbose=0, return_dict=True)
    inputs = {k: v for k, v in data.items() if k != "labels"}
    logits = model.predict(inputs, batch_size=BATCH // 2, verbose=0)["logits"]
    if RANK == 0:
        torch.save({"weights": model.module.state_dict(), "history": history.history,
                    "evaluate": logs, "logits": logits}, os.path.join(OUT, f"{name}.pt"))


# FSDP2 shards each transformer block, then the rest
for strategy in ("ddp", fitdp.FSDP(blocks=(BertLayer, GPT2Block))):
    tag = "ddp" if strategy == "ddp" else "fsdp"
    for case, (make, data_of, loss_items) in CASES.items():
        run(f"{case}-{tag}", make, data_of(), loss_items, strategy)
make, data_of, loss_items = CASES["gpt2-causal-lm"]
data = data_of()
# batches of 4 round-robin: each step's two are the 8 rows the hand loop takes at once
run("gpt2-loader-ddp", make, data, loss_items, "ddp", x=loader_of_dicts(data, BATCH // 2))
