"""Variable-length sequences in buckets: a GRU learns whether a marker token occurs.

Every sequence is random tokens with log-normal lengths in [4, 256] (mean about 40); half of
them hold one marker token at a random place, and the label says which half. A GRU must carry
the marker to the end of the sequence. `fitdp.BucketIterator` groups sequences of similar
length (automatic buckets: the least modelled training time, with at most 5% padding; each
bucket's short last batch counts) and fitdp runs each bucket in its own executor group, two
replicas on the CPU, with every parameter shared by name across buckets.

Run:  python examples/bucketing.py           (100% held-out accuracy, about 10 s on 2 cores)
      python examples/bucketing.py --fast    (a few seconds: the test suite's setting)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitdp

VOCAB, MARKER = 32, 1  # token 0 is padding, 1 the marker, 2..31 noise


def make_data(n: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``n`` sequences with log-normal lengths in [4, 256] (mean ~40) and marker labels."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    lengths = np.clip(np.round(rng.lognormal(np.log(40.0) - sigma**2 / 2, sigma, n)), 4, 256)
    labels = rng.integers(0, 2, n)
    seqs = []
    for length, label in zip(lengths.astype(int), labels):
        s = rng.integers(2, VOCAB, length)
        if label:
            s[rng.integers(0, length)] = MARKER
        seqs.append(torch.from_numpy(s))
    return seqs, torch.from_numpy(labels)


class Encoder(nn.Module):
    """Embedding + GRU; classifies from the last valid step of each padded sequence (the GRU
    runs left to right, so the padding after that step cannot change it)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim, padding_idx=0)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(tokens))
        return self.head(h[torch.arange(len(tokens)), lengths - 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fast", action="store_true", help="a few seconds: a smoke test")
    args = parser.parse_args()
    samples, epochs = (400, 1) if args.fast else (args.samples, args.epochs)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # two replicas, one core each
    seqs, labels = make_data(samples, seed=0)
    test_seqs, test_labels = make_data(max(samples // 5, 100), seed=1)
    train = fitdp.BucketIterator(seqs, labels, batch_size=args.batch_size,
                                 include_lengths=True, seed=0)
    test = fitdp.BucketIterator(test_seqs, test_labels, batch_size=args.batch_size,
                                include_lengths=True, shuffle=False)
    print(f"{len(train.buckets)} buckets {train.buckets}; padding {train.padding_fraction:.1%}")

    # bucket_module: one module per bucket, each parameter shared by name with `Encoder()`'s.
    # A GRU takes any length, so it is optional here; a network that must be built for its
    # length (e.g. unrolled over `key` steps) needs it, and with compile=True it gives every
    # bucket its own compiled graph.
    model = fitdp.Model(Encoder(), bucket_module=lambda key: Encoder())
    model.compile(optimizer="adam", lr=3e-3, loss="cross_entropy",
                  metrics={"accuracy": MulticlassAccuracy(num_classes=2, average="micro")},
                  grad_clip_norm=1.0)
    start = time.perf_counter()
    history = model.fit(train, epochs=epochs, devices=["cpu", "cpu"], validation_data=test,
                        verbose=0)
    seconds = time.perf_counter() - start
    h = history.history
    for e in range(len(h["loss"])):
        print(f"epoch {e + 1}: loss {h['loss'][e]:.4f} accuracy {h['accuracy'][e]:.3f} "
              f"val_accuracy {h['val_accuracy'][e]:.3f}")
    tokens = train.num_tokens * epochs
    print(f"final held-out accuracy {h['val_accuracy'][-1]:.3f}; padding "
          f"{train.padding_fraction:.1%}; {tokens / seconds:,.0f} real tokens/s "
          f"({seconds:.1f} s, validation included)")


if __name__ == "__main__":
    main()
