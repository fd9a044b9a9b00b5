"""Hugging Face models: what ``fit`` costs over a hand loop, and what ``loss_items`` fixes.

Run: python bench/huggingface.py [--repeats 7] [--json out.json] [--quick]

1. A tiny BERT classifier (from a config, no download) trained by ``Model.fit`` on a dict of
   tensors (the model's own loss, ``compile(loss=None)``, one CPU replica) against the loop a
   transformers user writes (``model(**batch).loss.backward()``, ``opt.step()``) on the same
   batches in the same order: median seconds per step of each, interleaved, this process's
   CPU time on one thread (time spent waiting for a core on a shared machine does not count).
2. The error ``loss_items`` removes (exact, no timing): a tiny GPT-2 on padded lines (labels
   -100 on the padding) trained on two CPU replicas with and without
   ``loss_items="causal_lm"``, the largest weight difference from the one-device hand loop
   after 2 and 8 AdamW steps. Without it the slices are weighed by rows, while GPT-2
   averages over its shifted, labelled tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp
from overhead import compare  # noqa: E402  (bench/ is sys.path[0])

import fitdp  # noqa: E402

TARGET = 1.03  # fitdp / hand loop per step, at most
Batch = dict[str, torch.Tensor]


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=64, num_labels=3))


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def padded(n: int, length: int, seed: int) -> Batch:
    """Token ids with a mask of sequences of 2..length tokens (the short ones second)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (n, length), generator=g)
    lengths = torch.randint(2, length + 1, (n,), generator=g).sort(descending=True).values
    mask = (torch.arange(length) < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def batches(data: Batch, bs: int) -> list[Batch]:
    n = len(data["input_ids"])
    return [{k: v[i:i + bs] for k, v in data.items()} for i in range(0, n, bs)]


def overhead(steps: int, repeats: int) -> dict[str, float | str]:
    """Row 1: the tiny BERT's fit against the hand loop."""
    bs = 32
    data = padded(bs * steps, 16, seed=1)
    data["labels"] = torch.randint(0, 3, (bs * steps,), generator=torch.Generator().manual_seed(2))
    net = bert()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net.train()
    order = batches(data, bs)

    def hand() -> None:
        for batch in order:
            opt.zero_grad()
            net(**batch).loss.backward()
            opt.step()

    model = fitdp.Model(bert())
    model.compile("adamw", lr=1e-3, loss=None)

    def fit() -> None:
        model.fit(data, batch_size=bs, shuffle=False, devices=["cpu"], verbose=0)

    return compare("tiny BERT classifier, batch 32, 1 CPU replica", fit, hand, steps, repeats,
                   sync=False)


def items_error(steps: int, loss_items: str | None) -> float:
    """Row 2: the largest weight difference from the hand loop after ``steps`` AdamW steps
    on two CPU replicas."""
    bs = 8
    data = padded(bs * steps, 12, seed=3)
    data["labels"] = data["input_ids"].masked_fill(data["attention_mask"] == 0, -100)
    ref = gpt2()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for batch in batches(data, bs):
        opt.zero_grad()
        ref(**batch).loss.backward()
        opt.step()
    model = fitdp.Model(gpt2())
    model.compile("adamw", lr=1e-3, loss=None, loss_items=loss_items)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fitdp.checks.FitdpWarning)  # the one measured here
        model.fit(data, batch_size=bs, shuffle=False, devices=["cpu", "cpu"], verbose=0)
    return max((p - q).abs().max().item()
               for p, q in zip(model.module.parameters(), ref.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, 4 steps")
    args = parser.parse_args()
    repeats, steps = (1, 4) if args.quick else (args.repeats, 16)
    torch.set_num_threads(1)
    load = os.getloadavg()
    print(f"{'case (fitdp vs hand loop)':<46} {'fitdp':>12}  {'hand':>12}")
    row = overhead(steps, repeats)
    print(f"\ntiny BERT fit overhead: {row['ratio']:.3f}x (target <= {TARGET})")
    errors = {}
    for n in (2, 8):
        for items in (None, "causal_lm"):
            errors[f"{n} steps, loss_items={items}"] = err = items_error(n, items)
            print(f"GPT-2, 2 CPU replicas, {n} AdamW steps, loss_items={items!s:<9}: "
                  f"max |weight - hand loop| {err:.1e}")
    print(f"load average {load} at the start, {os.getloadavg()} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overhead": row, "items_error": errors, "loadavg_at_start": load}, f,
                      indent=2)


if __name__ == "__main__":
    main()
