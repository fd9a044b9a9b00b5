"""A training epoch's throughput: samples (and, for sequence data, tokens) per second."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from time import perf_counter
from typing import Any

import torch

from fitdp.call.ranks import Ranks
from fitdp.data.batch import DataBatch
from fitdp.executor.step import Step


class Throughput:
    """Times a training epoch's batches and counts what they held (Lightning's
    ``ThroughputMonitor``, torchtitan's tokens per second), for ``History.throughput`` and
    the progress bar.

    ``samples_per_sec``: the rows the epoch trained (padding rows left out), summed over
    the ranks, over the seconds from its first batch to its last step (data loading
    included, validation not). ``tokens_per_sec``: for a source that counts the tokens of a
    batch (``count_tokens(batch)``: a ``BucketIterator`` counts its samples' own lengths,
    the padding left out), those over the same seconds.

    Args:
        source: the training data (its ``count_tokens``, if it has one, is read once).
    """

    def __init__(self, source: Any) -> None:
        self.count_tokens = getattr(source, "count_tokens", None)
        self.start = 0.0
        self.samples = 0  # the bound step's count at the epoch's start
        self.tokens = 0

    def begin(self, step: Step) -> None:
        self.start, self.samples, self.tokens = perf_counter(), step.samples, 0

    def counted(self, batches: Iterable[DataBatch]) -> Iterable[DataBatch]:
        """``batches``, their tokens counted on the way when the source counts them (else
        ``batches`` itself: nothing runs per batch)."""
        return batches if self.count_tokens is None else self._count(batches)

    def _count(self, batches: Iterable[DataBatch]) -> Iterator[DataBatch]:
        count = self.count_tokens
        for batch in batches:
            self.tokens += count(batch)  # type: ignore[misc]
            yield batch

    def rates(self, step: Step, ranks: Ranks, device: torch.device) -> dict[str, float]:
        """The epoch's rates (every rank's samples and tokens: a collective under torchrun,
        on ``device``, the one the ranks reduce on)."""
        seconds = max(perf_counter() - self.start, 1e-9)
        counts = [float(step.samples - self.samples), float(self.tokens)]
        if ranks.enabled:
            counts = ranks.all_reduce_sum(torch.tensor(
                counts, dtype=torch.float64, device=device)).tolist()
        rates = {"samples_per_sec": counts[0] / seconds}
        if self.count_tokens is not None:
            rates["tokens_per_sec"] = counts[1] / seconds
        return rates
