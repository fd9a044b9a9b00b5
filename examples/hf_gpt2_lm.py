"""Fine-tune a tiny GPT-2 (built from a config, no download) on generated arithmetic text.

Each line is a character-level sum such as "12+7=19." of 6 to 9 characters, padded at the end
to one length: `attention_mask` is 0 and `labels` -100 on the padding, as a Hugging Face
collator gives. GPT-2 shifts its labels and averages its loss over the labelled tokens after
the first, so `compile(loss=None, loss_items="causal_lm")` weighs each replica's slice by
those tokens: two CPU replicas train the one-device, whole-batch update. `use_cache=False`
is fixed for every forward (`forward_kwargs`), and `predict` returns a dict of the logits
joined over batches (the cache is dropped), from which the next-character accuracy is read.

Run:  python examples/hf_gpt2_lm.py          (next-character accuracy about 0.5, ~15 s)
      python examples/hf_gpt2_lm.py --fast   (a few seconds: the test suite's setting)
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import fitdp

CHARS = "_0123456789+=."  # "_" is padding
LENGTH = 10


def make_lines(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` sums ``a+b=c.`` as a padded batch dict with causal LM labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(n, LENGTH, dtype=torch.long)
    for i in range(n):
        a, b = (int(v) for v in torch.randint(0, 50, (2,), generator=g))
        line = f"{a}+{b}={a + b}."
        ids[i, : len(line)] = torch.tensor([CHARS.index(c) for c in line])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def next_char_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of labelled next characters predicted right (positions shifted as GPT-2's
    loss shifts them)."""
    guess, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    kept = target != -100
    return float((guess[kept] == target[kept]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (512, 3) if args.fast else (2048, 6)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(CHARS), n_embd=32, n_layer=2, n_head=2,
                        n_positions=LENGTH, bos_token_id=0, eos_token_id=0)
    model = fitdp.Model(GPT2LMHeadModel(config))
    model.compile("adamw", lr=3e-3, loss=None, loss_items="causal_lm",
                  forward_kwargs={"use_cache": False})
    history = model.fit(make_lines(n, seed=1), batch_size=32, epochs=epochs, verbose=0,
                        devices=["cpu", "cpu"], seed=0)
    for epoch, loss in enumerate(history.history["loss"], 1):
        print(f"epoch {epoch}: loss {loss:.4f}")
    test = make_lines(256, seed=2)
    loss = model.evaluate(test, batch_size=64, verbose=0, return_dict=True)["loss"]
    outputs = model.predict({k: v for k, v in test.items() if k != "labels"}, batch_size=64,
                            verbose=0)
    accuracy = next_char_accuracy(outputs["logits"], test["labels"])
    print(f"held-out: loss {loss:.4f}, next-character accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
