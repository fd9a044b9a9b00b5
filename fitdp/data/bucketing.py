"""`BucketIterator`: variable-length sequences -> padded batches grouped by bucket length."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from fitdp.checks import check_choice, check_int
from fitdp.data.batch import DataBatch, DataDesc
from fitdp.data.sources.protocol import SourcePlan, past_end_problem
from fitdp.data.sources.sequences import as_labels, as_sequences, check_pad


class StepCost(NamedTuple):
    """A step on ``rows`` sequences padded to ``width`` takes ``fixed + per_timestep * width +
    per_token * rows * width`` (any unit: only ratios count).

    Example:
        >>> choose_buckets([3] * 40 + [9] * 40, batch_size=32, step_cost=StepCost(0, 0, 1))
        [3, 9]
    """

    fixed: float
    per_timestep: float
    per_token: float


# What automatic buckets minimise: a step of bench/bucketing.py's GRU (one thread, 2-core CPU;
# `python bench/bucketing.py --fit-cost` fits rows 1..32 x widths 4..256) takes 0.50 ms + 0.064
# ms per timestep + 0.0023 ms per token (error: median 3%, worst 13%). A timestep costs as much
# as 28 rows: a short last batch costs half a full one (fixed + rows x width: 28% off).
GRU_CPU_STEP_COST = StepCost(fixed=0.50, per_timestep=0.064, per_token=0.0023)
AUTO_PADDING_TARGET = 0.05  # automatic buckets pad at most this share of all tokens,
AUTO_MAX_BUCKETS = 64  # in at most this many buckets (each an executor group, a compiled graph)
_MAX_CANDIDATES = 512  # bucket lengths searched; the DP costs O(buckets * K^2)


def choose_buckets(
    lengths: Sequence[int] | torch.Tensor | np.ndarray,
    batch_size: int,
    padding_target: float = AUTO_PADDING_TARGET,
    max_buckets: int = AUTO_MAX_BUCKETS,
    step_cost: StepCost = GRU_CPU_STEP_COST,
) -> list[int]:
    """Bucket lengths of the least modelled training time per epoch, with little padding.

    Every bucket holds at least ``min(batch_size, len(lengths))`` samples; ``p`` samples at width
    ``w`` cost ``ceil(p / batch_size)`` steps of ``step_cost`` (the short last batch too) on
    ``p * w`` tokens. An exact dynamic program over the distinct lengths (at most 512; quantiles
    beyond) finds the cheapest boundaries. Padding above ``padding_target`` is charged extra (a
    Lagrange multiplier, bisected) until within it, or least padding if nothing is.

    Args:
        lengths: the length of every sample (positive ints).
        batch_size: samples per batch; the minimum bucket population.
        padding_target: the most padding (pad / (real + pad)) to accept.
        max_buckets: the most buckets to use.
        step_cost: the step time model (default: measured for a GRU on a CPU).

    Returns:
        Sorted bucket lengths; the last is the longest sample.

    Example:
        >>> choose_buckets([2, 2, 3, 9, 9, 10], batch_size=2)
        [3, 10]
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    n, batch_size = len(lens), check_int("batch_size", batch_size, 1)
    max_buckets = check_int("max_buckets", max_buckets, 1)
    if n == 0 or lens.min() < 1:
        raise ValueError(f"lengths: received {lens.tolist()[:8]}...; expected ints >= 1.")
    cand = np.unique(lens)
    if len(cand) > _MAX_CANDIDATES:  # keep the DP's K x K matrix small: quantiles as candidates
        cand = np.unique(np.quantile(lens, np.linspace(0, 1, _MAX_CANDIDATES), method="higher"))
    k = len(cand)
    group = np.searchsorted(cand, lens, side="left")  # each sample -> smallest candidate >= it
    count = np.concatenate([[0], np.cumsum(np.bincount(group, minlength=k))]).astype(np.float64)
    real = np.concatenate([[0], np.cumsum(np.bincount(group, weights=lens, minlength=k))])
    i, j = np.arange(k + 1)[:, None], np.arange(k + 1)[None, :]  # bucket [i, j): groups i..j-1
    pop, width = count[j] - count[i], np.concatenate([[0], cand]).astype(np.float64)[j]
    valid = (j > i) & (pop >= min(batch_size, n))
    fixed, per_timestep, per_token = (float(c) for c in step_cost)
    steps = np.ceil(pop / batch_size)  # the short last batch costs a step too
    time = np.where(valid, steps * (fixed + per_timestep * width) + per_token * pop * width, np.inf)
    pad = np.where(valid, pop * width - (real[j] - real[i]), 0.0)

    def solve(weight: float) -> tuple[list[int], bool]:
        ends = _cheapest_split(time + weight * pad, max_buckets)
        padded = sum(pad[a, b] for a, b in zip([0, *ends[:-1]], ends))
        return ends, padded <= padding_target * (real[k] + padded)

    ends, ok = solve(0.0)
    if not ok:  # padding falls as its weight grows; above every plan's time: least padding
        lo, hi = 0.0, float(np.max(time, where=valid, initial=0.0)) * max_buckets + 1.0
        ends, ok = solve(hi)
        for _ in range(12 if ok else 0):  # geometric: a 1e9 range to within 1%
            mid = math.sqrt(max(lo, 1e-9 * hi) * hi)
            mid_ends, mid_ok = solve(mid)
            lo, hi, ends = (lo, mid, mid_ends) if mid_ok else (mid, hi, ends)
    return [int(cand[e - 1]) for e in ends]


def _cheapest_split(cost: np.ndarray, max_buckets: int) -> list[int]:
    """Exact DP: split candidates 0..k-1 into at most ``max_buckets`` consecutive buckets of
    least total ``cost[i, j]`` (one bucket = candidates i..j-1); each bucket's end ``j``."""
    k = cost.shape[0] - 1
    best = np.concatenate([[0.0], np.full(k, np.inf)])  # best[j]: candidates 0..j-1 split
    cols, parents = np.arange(k + 1), []
    for _ in range(max_buckets):  # layer m: at most m + 1 buckets
        total = best[:, None] + cost
        arg = total.argmin(axis=0)
        better = total[arg, cols] < best  # strict: on a tie the fewer buckets stay
        if not better.any():  # no extra bucket helps anywhere: the optimum is reached
            break
        parents.append(np.where(better, arg, -1))
        best = np.where(better, total[arg, cols], best)
    ends, end = [], k
    for arg in reversed(parents):  # -1: the same split as one layer down
        if arg[end] >= 0:
            ends.append(end)
            end = int(arg[end])
    return ends[::-1]


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
        self.buckets = self._check_buckets(buckets)
        self.shuffle, self.include_lengths = bool(shuffle), bool(include_lengths)
        # Drawn from the global RNG so torch.manual_seed(...) reproduces a seed=None run.
        self.seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        # _restarts counts set_epoch/load_state_dict calls: a live iteration stops on a change.
        self._epoch = self._position = self._restarts = 0
        # A pass ran to the epoch's end since the last set_epoch/load_state_dict: the next
        # iteration starts the next epoch. Not a position at the end (a loaded one, or a pass
        # stopped after the last batch): fit then asks for the next epoch itself.
        self._ran_out = False

        bucket_of = torch.searchsorted(torch.tensor(self.buckets), self._lengths)
        width = torch.tensor(self.buckets)[bucket_of]
        self._members = [torch.nonzero(bucket_of == b)[:, 0] for b in range(len(self.buckets))]
        self._num_batches = sum(math.ceil(len(m) / batch_size) for m in self._members)
        self.num_tokens = int(self._lengths.sum())
        self.padding_fraction = float((width - self._lengths).sum()) / float(width.sum())
        self._order_cache: tuple[tuple[int, int], list[tuple[int, torch.Tensor]]] | None = None

    def _check_buckets(self, buckets: Sequence[int] | None) -> list[int]:
        """Validate user buckets (or choose them) and check every sequence fits."""
        longest = int(self._lengths.max())
        if buckets is None:
            return choose_buckets(self._lengths.numpy(), self.batch_size)
        if isinstance(buckets, (torch.Tensor, np.ndarray)):
            buckets = buckets.tolist()
        fix = "pass positive ints, e.g. buckets=[16, 32, 64], or buckets=None"
        if not isinstance(buckets, (list, tuple)) or not buckets:
            error = ValueError if isinstance(buckets, (list, tuple)) else TypeError
            raise error(f"buckets: received {buckets!r}; expected a non-empty list. Fix: {fix}.")
        out = sorted({check_int("buckets", b, 1, fix=fix) for b in buckets})
        if longest > out[-1]:
            raise ValueError(
                f"sequences[{int(torch.argmax(self._lengths))}] has length {longest}, longer "
                f"than the largest bucket {out[-1]} (buckets={out}). Fix: add a bucket >= "
                f"{longest}, or pass buckets=None to choose them from the lengths.")
        return out

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
        keys = tuple(k for k, m in zip(self.buckets, self._members) if len(m))
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

    def _epoch_order(self, epoch: int) -> list[tuple[int, torch.Tensor]]:
        """(bucket length, sample indices) of every batch of ``epoch``; depends on (seed, epoch)."""
        if self._order_cache is not None and self._order_cache[0] == (self.seed, epoch):
            return self._order_cache[1]
        g = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + epoch) % 2**64)
        batches: list[tuple[int, torch.Tensor]] = []
        for width, members in zip(self.buckets, self._members):
            if self.shuffle:
                members = members[torch.randperm(len(members), generator=g)]
            if len(members):  # split() of an empty bucket would yield one empty batch
                batches.extend((width, part) for part in members.split(self.batch_size))
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        self._order_cache = ((self.seed, epoch), batches)  # by seed: load_state_dict sets it
        return batches

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
        restarts, order = self._restarts, self._epoch_order(self._epoch)
        while self._restarts == restarts and self._position < len(order):
            width, index = order[self._position]
            self._position += 1  # counted before the yield: a checkpoint taken in the step
            yield self._make_batch(width, index)  # that trains this batch resumes after it
        self._ran_out = self._restarts == restarts  # (not when set_epoch ended this pass)
