"""`BucketIterator`: variable-length sequences -> padded batches grouped by bucket length."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fitdp.checks import check_choice, check_int
from fitdp.data.batch import DataBatch, DataDesc
from fitdp.data.length_groups import BucketBatchSampler
from fitdp.data.sources.protocol import SourcePlan, past_end_problem
from fitdp.data.sources.sequences import as_labels, as_sequences, check_pad


class BucketIterator:
    """Variable-length sequences -> padded batches grouped by length (MXNet's bucketing).

    Each sample goes to the smallest bucket length >= its length; a batch holds one bucket's
    samples, padded with ``pad_value`` to its length. Per bucket, batches are full except
    possibly the last, smaller one (kept: nothing is dropped or duplicated; ``pad`` is 0).

    Per-token labels (taggers, language models: one label sequence per sequence, of its length)
    are padded with ``label_pad`` (-100: the ``ignore_index`` of ``F.cross_entropy`` and of
    torchmetrics, so loss and metrics skip the padding).

    A ``fitdp.data.sources.DataSource``: an epoch's order depends only on ``(seed, epoch)``;
    ``set_epoch(e)`` always starts epoch ``e`` at its first batch; only ``load_state_dict``
    (``seed, epoch, position``) continues a partly consumed one (one loaded at the epoch's end
    has nothing left to yield). Iterating again after a pass that ran to the epoch's end,
    without ``set_epoch``, starts the next. ``set_epoch``/``load_state_dict`` end a live
    iteration (one at a time).

    Args:
        sequences: 1-D tensors, lists of ints or numpy arrays, one per sample.
        labels: one label per sequence (tensor, list or array; dim 0 is the sample), one
            label sequence per sequence of its length (lists, 1-D tensors or arrays), or None.
        batch_size: samples per batch.
        buckets: bucket lengths, or None to choose them with `choose_buckets`.
        pad_value: the value written after each sequence.
        shuffle: reshuffle samples within buckets and the order of batches every epoch.
        seed: seed of the shuffles; None draws one from torch's global RNG (reproducible).
        include_lengths: yield ``data=(padded, lengths)`` instead of ``padded``.
        label_pad: the value written after each per-token label sequence.
        layout: ``"NT"`` (batch-first, ``(batch, time)``) or ``"TN"`` (time-major
            ``(time, batch)`` data and per-token labels, as MXNet's ``BucketSentenceIter``;
            lengths and per-sequence labels stay ``(batch, ...)``). The batches carry it, so
            the devices split them, metrics read them and predict reorders them on ``N``.

    Raises:
        TypeError, ValueError: a bad argument, sequence or label (named in the message).

    Example:
        >>> seqs = [torch.arange(1, n + 1) for n in (3, 5, 2, 7)]
        >>> it = BucketIterator(seqs, [0, 1, 0, 1], batch_size=2, buckets=[4, 8], shuffle=False)
        >>> [(b.bucket_key, tuple(b.data.shape), b.index.tolist()) for b in it]
        [(4, (2, 4), [0, 2]), (8, (2, 8), [1, 3])]
        >>> tags = [s % 2 for s in seqs]  # per token
        >>> next(iter(BucketIterator(seqs, tags, 2, buckets=[4, 8], shuffle=False))).label
        tensor([[   1,    0,    1, -100],
                [   1,    0, -100, -100]])
    """

    def __init__(
        self,
        sequences: Sequence[torch.Tensor | Sequence[int] | np.ndarray],
        labels: torch.Tensor | Sequence[Any] | np.ndarray | None,
        batch_size: int,
        buckets: Sequence[int] | None = None,
        pad_value: int | float = 0,
        shuffle: bool = True,
        seed: int | None = None,
        include_lengths: bool = False,
        label_pad: int | float = -100,
        layout: str = "NT",
    ) -> None:
        self.batch_size = check_int("batch_size", batch_size, 1)
        seed = None if seed is None else check_int("seed", seed, None)
        seqs = as_sequences(sequences)
        self._dtype = functools.reduce(torch.promote_types, (s.dtype for s in seqs))
        self.pad_value = check_pad("pad_value", pad_value, "sequences", self._dtype)

        # One flat tensor + offsets (per-token labels too): a batch is one gather, not a collate.
        self._lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        self._offsets = torch.cumsum(self._lengths, 0) - self._lengths
        self._flat = torch.cat([s.to(self._dtype) for s in seqs])
        self._labels, self.per_token_labels = as_labels(labels, self._lengths)
        self.label_pad = check_pad("label_pad", label_pad, "labels",
                                    getattr(self._labels, "dtype", torch.int64))

        self.layout = check_choice("layout", layout, ("NT", "TN"),
                                   "pass 'NT' for (batch, time) or 'TN' for (time, batch)")
        if self.layout == "TN" and self._labels is not None and not self.per_token_labels and (
                self._labels.dim() > 1):
            raise ValueError(f"labels: got one label of shape {tuple(self._labels.shape[1:])} "
                             "per sequence with layout='TN'; expected per-token labels or one "
                             "number per sequence. Fix: layout='NT', or flatten the labels.")
        self.shuffle, self.include_lengths = bool(shuffle), bool(include_lengths)
        # Drawn from the global RNG so torch.manual_seed(...) reproduces a seed=None run.
        self.seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        self._order = BucketBatchSampler(self._lengths, batch_size, buckets=buckets,
                                         shuffle=self.shuffle, seed=self.seed, name="sequences")
        self.buckets = self._order.buckets
        # _restarts counts set_epoch/load_state_dict calls: a live iteration stops on a change.
        self._epoch = self._position = self._restarts = 0
        # A pass ran to the epoch's end since the last set_epoch/load_state_dict: the next
        # iteration starts the next epoch. Not a position at the end (a loaded one, or a pass
        # stopped after the last batch): fit then asks for the next epoch itself.
        self._ran_out = False
        self._num_batches = self._order.num_batches
        self.num_tokens = int(self._lengths.sum())
        width = self._order.widths
        self.padding_fraction = float((width - self._lengths).sum()) / float(width.sum())

    @property
    def default_bucket_key(self) -> int:
        """The largest bucket: its executor group is built first and sized for all others."""
        return self.buckets[-1]

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    @property
    def num_batches(self) -> int:
        """Batches per epoch (every bucket's full batches and its smaller last one)."""
        return self._num_batches

    @property
    def provide_data(self) -> list[DataDesc]:
        """Inputs of a full batch of the default bucket (MXNet style)."""
        shape, lengths = self._shape(self.default_bucket_key), (self.batch_size,)
        if self.include_lengths:
            return [DataDesc("data0", shape, self._dtype, self.layout),
                    DataDesc("data1", lengths, torch.int64, self.layout)]
        return [DataDesc("data", shape, self._dtype, self.layout)]

    def _shape(self, width: int) -> tuple[int, int]:
        """A full batch of bucket ``width`` in this iterator's layout."""
        return (width, self.batch_size) if self.layout == "TN" else (self.batch_size, width)

    @property
    def provide_label(self) -> list[DataDesc]:
        """Labels of a full batch of the default bucket ([] without labels)."""
        if self._labels is None:
            return []
        if self.per_token_labels:
            return [DataDesc("label", self._shape(self.default_bucket_key), self._labels.dtype,
                             self.layout)]
        shape = (self.batch_size, *self._labels.shape[1:])
        return [DataDesc("label", shape, self._labels.dtype, self.layout)]

    def plan(self) -> SourcePlan:
        """For the manager: the buckets that have samples, the largest as default, its inputs."""
        keys = tuple(k for k, m in zip(self.buckets, self._order.members) if len(m))
        return SourcePlan(bucket_keys=keys, default_bucket_key=self.default_bucket_key,
                          inputs=[*self.provide_data, *self.provide_label],
                          rows_per_step=None, num_samples=self.num_samples)

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        """The next iteration yields all of epoch ``epoch`` (an int >= 0, else TypeError or
        ValueError), even if a call that raised or stopped early consumed part of it."""
        self._epoch, self._position = check_int("epoch", epoch, 0), 0
        self._restarts, self._ran_out = self._restarts + 1, False

    def state_dict(self) -> dict[str, int]:
        """Seed, epoch and batches already yielded in this epoch (plain ints)."""
        return {"seed": self.seed, "epoch": self._epoch, "position": self._position}

    def check_resume(self, state: Any, *, continues: bool = True) -> str | None:
        """Why ``state`` cannot load (see ``load_state_dict``), or None; with ``continues``
        (the next iteration goes on from its position) a position past this data's batches
        per epoch too (saved on longer data)."""
        if not isinstance(state, Mapping):
            return f"got {type(state).__name__}; expected a state_dict() result."
        if missing := {"seed", "epoch", "position"} - set(state):
            return f"lacks {sorted(missing)}; expected a state_dict() result."
        if int(state["position"]) < 0:
            return (f"position {state['position']} is negative; expected a state_dict() "
                    "result (batches already yielded in its epoch).")
        if not continues:
            return None
        return past_end_problem(state, rows=None, samples=None, batches=self._num_batches)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` left off (``set_epoch`` after it would restart the epoch;
        at or past the epoch's end nothing is left of it: ``fit`` refuses a position past
        this data's end with ``check_resume`` first); a ValueError if a key is missing."""
        problem = self.check_resume(state, continues=False)
        if problem:
            raise ValueError(f"state: {problem}")
        self.seed, self._epoch = int(state["seed"]), int(state["epoch"])
        self._position = int(state["position"])
        self._restarts, self._ran_out = self._restarts + 1, False

    def count_tokens(self, batch: DataBatch) -> int:
        """The tokens of ``batch`` (one of this iterator's): its samples' own lengths
        summed, the padding left out (``tokens_per_sec`` of ``History.throughput``)."""
        return int(self._lengths[batch.index].sum())

    def _make_batch(self, width: int, index: torch.Tensor) -> DataBatch:
        """Pad the rows ``index`` (and their per-token labels) to ``width``: one masked gather."""
        lengths, cols = self._lengths[index], torch.arange(width)
        mask = cols < lengths[:, None]
        source = (self._offsets[index][:, None] + cols)[mask]
        padded = torch.full((len(index), width), self.pad_value, dtype=self._dtype)
        padded[mask] = self._flat[source]
        labels = label = self._labels
        if labels is not None and self.per_token_labels:
            label = torch.full((len(index), width), self.label_pad, dtype=labels.dtype)
            label[mask] = labels[source]
        elif labels is not None:
            label = labels[index]
        if self.layout == "TN":  # one copy per batch, as BucketSentenceIter's ``.T``
            padded = padded.t().contiguous()
            if label is not None and self.per_token_labels:
                label = label.t().contiguous()
        data = (padded, lengths) if self.include_lengths else padded
        return DataBatch(data=data, label=label, bucket_key=width, pad=0, index=index,
                         layout=self.layout)

    def __iter__(self) -> Iterator[DataBatch]:
        if self._ran_out:  # a pass ran to the epoch's end, no set_epoch since: move on
            self._epoch, self._position, self._ran_out = self._epoch + 1, 0, False
        restarts, order = self._restarts, self._order.batches(self.seed, self._epoch)
        while self._restarts == restarts and self._position < len(order):
            width, index = order[self._position]
            self._position += 1  # counted before the yield: a checkpoint taken in the step
            yield self._make_batch(width, index)  # that trains this batch resumes after it
        self._ran_out = self._restarts == restarts  # (not when set_epoch ended this pass)
