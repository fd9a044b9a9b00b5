"""Fine-tune a tiny BERT (built from a config, no download) to classify generated reviews.

Each review is a sentence made from a small word list: a subject, a verb and two adjectives,
one of which carries the sentiment ("the plot was slow and dull" is negative). Words are
token ids of the word list itself (no tokenizer to download). The batches are what a Hugging
Face tokenizer and collator give: dicts of `input_ids`, `attention_mask` and `labels`; fitdp
passes each as `model(**batch)` and trains on the model's own loss (`compile(loss=None)`),
two CPU replicas, with accuracy read from `outputs.logits` and `batch["labels"]`.

Run:  python examples/hf_bert_classifier.py          (100% held-out accuracy from epoch 2, ~10 s)
      python examples/hf_bert_classifier.py --fast   (a few seconds: the test suite's setting)
"""

from __future__ import annotations

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

import fitdp

SUBJECTS = ["the film", "the plot", "the cast", "the music", "the ending", "the story"]
VERBS = ["was", "felt", "seemed", "looked"]
NEUTRAL = ["long", "loud", "new", "short", "french", "old", "quiet", "simple"]
POSITIVE = ["great", "lovely", "moving", "brilliant", "charming", "fresh"]
NEGATIVE = ["dull", "boring", "awful", "slow", "clumsy", "flat"]
WORDS = ["[PAD]", "[CLS]", "and"] + sorted({w for p in SUBJECTS for w in p.split()}
                                          | set(VERBS + NEUTRAL + POSITIVE + NEGATIVE))
IDS = {w: i for i, w in enumerate(WORDS)}
LENGTH = 10


def make_reviews(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` reviews as a padded batch dict (a collator's output) with sentiment labels."""
    g = torch.Generator().manual_seed(seed)

    def pick(words: list[str]) -> str:
        return words[int(torch.randint(len(words), (), generator=g))]

    ids = torch.zeros(n, LENGTH, dtype=torch.long)
    labels = torch.randint(0, 2, (n,), generator=g)
    for i in range(n):
        mood = pick(POSITIVE if labels[i] else NEGATIVE)
        pair = [mood, pick(NEUTRAL)] if torch.rand((), generator=g) < 0.5 else [
            pick(NEUTRAL), mood]
        words = ["[CLS]", *pick(SUBJECTS).split(), pick(VERBS), pair[0], "and", pair[1]]
        ids[i, : len(words)] = torch.tensor([IDS[w] for w in words])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (512, 3) if args.fast else (2048, 4)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=37,
                        max_position_embeddings=LENGTH, num_labels=2)
    model = fitdp.Model(BertForSequenceClassification(config))
    model.compile("adamw", lr=3e-3, loss=None, metrics=["accuracy"])
    history = model.fit(make_reviews(n, seed=1), batch_size=32, epochs=epochs, verbose=0,
                        devices=["cpu", "cpu"], seed=0)
    for epoch, (loss, acc) in enumerate(zip(history.history["loss"],
                                            history.history["accuracy"]), 1):
        print(f"epoch {epoch}: loss {loss:.4f}, accuracy {acc:.3f}")
    test = model.evaluate(make_reviews(256, seed=2), batch_size=64, verbose=0,
                          return_dict=True)
    print(f"held-out: loss {test['loss']:.4f}, accuracy {test['accuracy']:.3f}")


if __name__ == "__main__":
    main()
