"""Fine-tune a tiny BERT on a Hugging Face ``datasets.Dataset`` of text, the way a
transformers user starts: a text column, a tokenizer, a collator. Nothing is downloaded: the
tokenizer is trained here on the training texts with the ``tokenizers`` library and wrapped as
a transformers ``PreTrainedTokenizerFast``, and the model is built from a config.

The reviews are generated: a subject, a verb and two adjectives, one of which carries the
sentiment ("the plot was slow and dull" is negative). ``fit`` takes the dataset and the
collator (``collate_fn=``, as ``Trainer(data_collator=)``), drops the ``text`` column the model's
``forward`` does not take (one note), batches reviews of similar length together
(``group_by_length=True``, as ``Trainer``'s), pads each batch to its longest review and trains
on the model's own loss (``compile(loss=None)``) on two CPU replicas.

Run:  python examples/finetune_hf_dataset.py          (~100% held-out accuracy, ~15 s)
      python examples/finetune_hf_dataset.py --fast   (a few seconds: the test suite's setting)
"""

from __future__ import annotations

import argparse
import random

import datasets
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
)

import fitdp

SUBJECTS = ["the film", "the plot", "the cast", "the music", "the ending", "the story"]
VERBS = ["was", "felt", "seemed", "looked", "is"]
NEUTRAL = ["long", "loud", "new", "short", "french", "old", "quiet", "simple", "very"]
POSITIVE = ["great", "lovely", "moving", "brilliant", "charming", "fresh"]
NEGATIVE = ["dull", "boring", "awful", "slow", "clumsy", "flat"]


def reviews(n: int, seed: int) -> datasets.Dataset:
    """``n`` generated reviews: a ``text`` column and a ``label`` (1: positive)."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        label = rng.randrange(2)
        adjectives = [rng.choice(POSITIVE if label else NEGATIVE)]
        adjectives += rng.sample(NEUTRAL, rng.randrange(1, 3))
        rng.shuffle(adjectives)
        texts.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {' and '.join(adjectives)}")
        labels.append(label)
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on ``texts``, adding [CLS] ... [SEP] as BERT's does."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tok.token_to_id("[CLS]")),
                                                 ("[SEP]", tok.token_to_id("[SEP]"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer reviews and epochs")
    args = parser.parse_args()
    n, epochs = (384, 2) if args.fast else (1536, 3)
    datasets.disable_progress_bars()
    train, held_out = reviews(n, seed=0), reviews(n // 4, seed=1)
    tokenizer = train_tokenizer(train["text"])

    def tokenize(batch: dict) -> dict:
        return tokenizer(batch["text"], truncation=True, max_length=16)

    train = train.map(tokenize, batched=True)
    held_out = held_out.map(tokenize, batched=True)
    print(f"{len(train)} reviews, columns {train.column_names}, "
          f"vocabulary of {len(tokenizer)} words")

    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=37,
                        max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = fitdp.Model(BertForSequenceClassification(config))
    model.compile("adamw", lr=3e-3, loss=None, metrics=["accuracy"])
    collator = DataCollatorWithPadding(tokenizer)
    # (a note names the text column dropped from each dataset: not a forward argument)
    history = model.fit(train, batch_size=32, epochs=epochs, collate_fn=collator,
                        group_by_length=True, validation_data=held_out,
                        devices=["cpu", "cpu"], seed=0, verbose=0)
    for epoch, (loss, acc) in enumerate(zip(history.history["loss"],
                                            history.history["val_accuracy"])):
        print(f"epoch {epoch + 1}: loss {loss:.4f}, held-out accuracy {acc:.3f}")
    logs = model.evaluate(held_out, batch_size=64, collate_fn=collator, verbose=0)
    print(f"held-out: loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.3f}")
    texts = ["the plot was slow and dull", "the music is lovely and very french"]
    out = model.predict(dict(tokenizer(texts, padding=True, return_tensors="pt")))
    for text, label in zip(texts, out["logits"].argmax(1).tolist()):
        print(f"{text!r}: {'positive' if label else 'negative'}")


if __name__ == "__main__":
    main()
