"""Rows grouped by length: bucket lengths of the least modelled training time
(``choose_buckets``, MXNet's bucketing with a cost model) and the batches of row indices of
one bucket each (``BucketBatchSampler``), for a ``BucketIterator`` and for rows a collator
pads (``fit(group_by_length=...)``)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from fitdp.checks import check_int, fail


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


class BucketBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of row indices grouped by length: fitdp's bucketing for rows a collator pads
    (``Trainer``'s ``group_by_length``), as a ``DataLoader``'s ``batch_sampler``.

    Each row goes to the smallest bucket length >= its length (``choose_buckets`` picks them
    when ``buckets`` is None); a batch holds rows of one bucket, so a collator that pads to
    the batch's longest row pads little. Per bucket, batches are full except possibly the
    last, smaller one (nothing dropped or repeated). With ``shuffle`` the rows within each
    bucket and the order of the batches are drawn from ``(seed, epoch)`` alone, so a resumed
    run replays an epoch's order; ``set_epoch`` picks the epoch, as ``DistributedSampler``'s
    does (``fit`` calls it). ``BucketIterator`` draws its batches from one.

    Args:
        lengths: each row's length (ints >= 0; a length-0 row groups with length 1).
        batch_size: rows per batch.
        buckets: bucket lengths, or None to choose them from the lengths.
        shuffle: reshuffle within buckets and the order of batches every epoch.
        seed: seed of the shuffles.
        name: what to call ``lengths`` in messages.

    Raises:
        TypeError, ValueError: a bad argument (named in the message).

    Example:
        >>> sampler = BucketBatchSampler([3, 9, 2, 8], batch_size=2, shuffle=False)
        >>> sampler.buckets, list(sampler)
        ([3, 9], [[0, 2], [1, 3]])
    """

    def __init__(self, lengths: Sequence[int] | torch.Tensor | np.ndarray, batch_size: int,
                 *, buckets: Sequence[int] | None = None, shuffle: bool = True,
                 seed: int = 0, name: str = "lengths") -> None:
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed, self.shuffle, self.epoch = check_int("seed", seed, None), bool(shuffle), 0
        self.lengths = as_lengths(lengths, name)
        self.buckets = _check_buckets(buckets, self.lengths, self.batch_size, name)
        bucket_of = torch.searchsorted(torch.tensor(self.buckets), self.lengths.clamp(min=1))
        self.widths = torch.tensor(self.buckets)[bucket_of]  # each row's bucket length
        self.members = [torch.nonzero(bucket_of == b)[:, 0] for b in range(len(self.buckets))]
        self.num_batches = sum(math.ceil(len(m) / self.batch_size) for m in self.members)
        self._cache: tuple[tuple[int, int], list[tuple[int, torch.Tensor]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The next iteration yields epoch ``epoch``'s batches."""
        self.epoch = check_int("epoch", epoch, 0)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        return (index.tolist() for _, index in self.batches(self.seed, self.epoch))

    def batches(self, seed: int, epoch: int) -> list[tuple[int, torch.Tensor]]:
        """(bucket length, row indices) of every batch of ``epoch`` drawn with ``seed``."""
        if self._cache is not None and self._cache[0] == (seed, epoch):
            return self._cache[1]
        g = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + epoch) % 2**64)
        batches: list[tuple[int, torch.Tensor]] = []
        for width, members in zip(self.buckets, self.members):
            if self.shuffle:
                members = members[torch.randperm(len(members), generator=g)]
            if len(members):  # split() of an empty bucket would yield one empty batch
                batches.extend((width, part) for part in members.split(self.batch_size))
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        self._cache = ((seed, epoch), batches)  # by seed: BucketIterator's resume sets it
        return batches


def as_lengths(lengths: Any, name: str) -> torch.Tensor:
    """``lengths`` as a 1-D int64 tensor of ints >= 0.

    Raises:
        TypeError, ValueError: anything else, naming ``name``.
    """
    try:
        out = torch.as_tensor(np.asarray(lengths))
    except (TypeError, ValueError, RuntimeError) as err:
        fail(name, f"{type(lengths).__name__} ({err})", "one int per row",
             "pass a list of ints", error=TypeError, described=True)
    if (out.dim() != 1 or not len(out) or out.is_floating_point() or out.dtype == torch.bool
            or bool((out < 0).any())):
        shown = out.flatten()[:8].tolist()
        fail(name, f"{shown}{'...' if out.numel() > 8 else ''} (shape {tuple(out.shape)})",
             "one int >= 0 per row", "pass each row's length (its number of tokens)",
             described=True)
    return out.to(torch.int64)


def _check_buckets(buckets: Sequence[int] | None, lengths: torch.Tensor, batch_size: int,
                   name: str) -> list[int]:
    """Validate user buckets (or choose them) and check every row fits."""
    longest = max(int(lengths.max()), 1)
    if buckets is None:
        return choose_buckets(lengths.clamp(min=1).numpy(), batch_size)
    if isinstance(buckets, (torch.Tensor, np.ndarray)):
        buckets = buckets.tolist()
    fix = "pass positive ints, e.g. buckets=[16, 32, 64], or buckets=None"
    if not isinstance(buckets, (list, tuple)) or not buckets:
        error = ValueError if isinstance(buckets, (list, tuple)) else TypeError
        raise error(f"buckets: received {buckets!r}; expected a non-empty list. Fix: {fix}.")
    out = sorted({check_int("buckets", b, 1, fix=fix) for b in buckets})
    if longest > out[-1]:
        raise ValueError(
            f"{name}[{int(torch.argmax(lengths))}] has length {longest}, longer than the "
            f"largest bucket {out[-1]} (buckets={out}). Fix: add a bucket >= {longest}, or "
            "pass buckets=None to choose them from the lengths.")
    return out
