"""`BucketIterator`: variable-length sequences -> padded batches grouped by bucket length."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from fitdp.batch import DataBatch, DataDesc

# Automatic buckets: the fewest buckets whose padding is at most this share of all tokens...
# (just under 5%: every bucket adds a short last batch, and on the CPU a short batch costs
# almost as much per step as a full one, so fewer buckets beat less padding; measured on the
# GRU benchmark, 0.04 -> 0.048 took 32 buckets to 27 and tokens/s from 0.95-0.97x to 0.97x
# of a length-grouped sampler)
AUTO_PADDING_TARGET = 0.048
# ...but never more buckets than this: each one is an executor group (and a compiled graph).
AUTO_MAX_BUCKETS = 64
# Bucket boundaries are searched among at most this many lengths; the DP costs O(buckets * K^2).
_MAX_CANDIDATES = 512


def choose_buckets(
    lengths: Sequence[int] | torch.Tensor | np.ndarray,
    batch_size: int,
    padding_target: float = AUTO_PADDING_TARGET,
    max_buckets: int = AUTO_MAX_BUCKETS,
) -> list[int]:
    """Bucket lengths that keep padding small without making buckets tiny.

    Rule: every bucket holds at least ``min(batch_size, len(lengths))`` samples (at least one
    full batch, at most one smaller last batch). Under that constraint an exact dynamic program
    over the distinct lengths (at most 512 candidates, quantiles when there are more) finds the
    least-padding boundaries for 1, 2, ... buckets; the fewest buckets whose padding is at most
    ``padding_target`` of all (real + pad) tokens win. If ``max_buckets`` buckets cannot reach
    the target, the least-padding choice found is returned.

    Args:
        lengths: the length of every sample (positive ints).
        batch_size: samples per batch; the minimum bucket population.
        padding_target: the padding share (pad / (real + pad)) to stop at.
        max_buckets: the most buckets to use.

    Returns:
        Sorted bucket lengths; the last one is the longest sample.

    Example:
        >>> choose_buckets([2, 2, 3, 9, 9, 10], batch_size=2)
        [3, 10]
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    n, batch_size = len(lens), _check_int("batch_size", batch_size, 1)
    if n == 0 or lens.min() < 1:
        raise ValueError(f"lengths: received {lens.tolist()[:8]}...; expected ints >= 1.")
    cand = np.unique(lens)
    if len(cand) > _MAX_CANDIDATES:  # keep the DP's K x K matrix small: quantiles as candidates
        cand = np.unique(np.quantile(lens, np.linspace(0, 1, _MAX_CANDIDATES), method="higher"))
    k = len(cand)
    group = np.searchsorted(cand, lens, side="left")  # each sample -> smallest candidate >= it
    count = np.concatenate([[0], np.cumsum(np.bincount(group, minlength=k))]).astype(np.float64)
    real = np.concatenate([[0], np.cumsum(np.bincount(group, weights=lens, minlength=k))])
    # cost[i, j]: padding of one bucket of length cand[j-1] holding candidate groups i..j-1.
    i, j = np.arange(k + 1)[:, None], np.arange(k + 1)[None, :]
    pop = count[j] - count[i]
    width = np.concatenate([[0], cand]).astype(np.float64)[j]
    valid = (j > i) & (pop >= min(batch_size, n))
    cost = np.where(valid, pop * width - (real[j] - real[i]), np.inf)
    dp = np.concatenate([[0.0], np.full(k, np.inf)])
    parents: list[np.ndarray] = []
    best_pad, best_m = math.inf, 0
    for m in range(1, max(1, max_buckets) + 1):
        total = dp[:, None] + cost
        arg = total.argmin(axis=0)
        dp = total[arg, np.arange(k + 1)]
        parents.append(arg)
        pad = dp[k]
        if pad < best_pad:
            best_pad, best_m = pad, m
        # Feasibility only shrinks as m grows (merging two valid buckets stays valid).
        if not np.isfinite(pad) or pad <= padding_target * (real[k] + pad):
            break
    bounds, end = [], k
    for arg in reversed(parents[:best_m]):
        bounds.append(int(cand[end - 1]))
        end = int(arg[end])
    return sorted(bounds)


class BucketIterator:
    """Variable-length sequences -> padded batches grouped by length (MXNet's bucketing).

    Each sample goes to the smallest bucket length >= its length; a batch holds samples of one
    bucket only and is padded with ``pad_value`` to that bucket's length, so short sequences
    never pay for long ones. Per bucket, batches are full except possibly the last, smaller one
    (kept: no sample is dropped or duplicated; ``pad`` is always 0).

    Epochs and exact resume: an epoch's order depends only on ``(seed, epoch)``. Iterating
    yields the current epoch's batches from ``position`` on (a batch counts as consumed once
    yielded); ``state_dict``/``load_state_dict`` carry ``seed, epoch, position``. The trainer
    calls ``set_epoch(e)`` before each epoch; given the current epoch it keeps a partly consumed
    position (so: load state, then set_epoch as usual). Iterating a finished epoch again without
    ``set_epoch`` starts the next epoch instead of yielding nothing. One live iteration at a time.

    Args:
        sequences: 1-D tensors, lists of ints or numpy arrays, one per sample.
        labels: one label per sequence (tensor, list or array; dim 0 is the sample), or None.
        batch_size: samples per batch.
        buckets: bucket lengths, or None to choose them with `choose_buckets`.
        pad_value: the value written after each sequence.
        shuffle: reshuffle samples within buckets and the order of batches every epoch.
        seed: seed of the shuffles; None draws one from torch's global RNG (so
            ``torch.manual_seed`` makes it reproducible).
        include_lengths: yield ``data=(padded, lengths)`` instead of ``padded``.

    Raises:
        TypeError: an argument, sequence or label of the wrong type.
        ValueError: empty input or sequence, mismatched counts, a sequence longer than every
            bucket, a bad bucket length or batch size, a sequence that is not 1-D.

    Example:
        >>> seqs = [torch.arange(1, n + 1) for n in (3, 5, 2, 7)]
        >>> it = BucketIterator(seqs, [0, 1, 0, 1], batch_size=2, buckets=[4, 8], shuffle=False)
        >>> [(b.bucket_key, tuple(b.data.shape), b.index.tolist()) for b in it]
        [(4, (2, 4), [0, 2]), (8, (2, 8), [1, 3])]
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
    ) -> None:
        self.batch_size = _check_int("batch_size", batch_size, 1)
        seed = None if seed is None else _check_int("seed", seed, None)
        seqs = _as_sequences(sequences)
        self._dtype = seqs[0].dtype
        for s in seqs[1:]:
            self._dtype = torch.promote_types(self._dtype, s.dtype)
        if isinstance(pad_value, bool) or not isinstance(pad_value, (int, float)) or (
            not self._dtype.is_floating_point and not float(pad_value).is_integer()
        ):  # torch.full would silently truncate 0.5 to 0 in an int64 batch
            raise TypeError(
                f"pad_value: received {pad_value!r} for sequences of dtype {self._dtype}; "
                "expected a number of that dtype. Fix: pass e.g. pad_value=0."
            )
        self.pad_value = pad_value if self._dtype.is_floating_point else int(pad_value)

        # One flat tensor + offsets: a batch is built with one gather, not a per-row collate.
        self._lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        self._offsets = torch.cumsum(self._lengths, 0) - self._lengths
        self._flat = torch.cat([s.to(self._dtype) for s in seqs])
        self.labels = _as_labels(labels, len(seqs))

        self.buckets = self._check_buckets(buckets)
        self.shuffle = bool(shuffle)
        self.include_lengths = bool(include_lengths)
        # Drawn from the global RNG so torch.manual_seed(...) reproduces a seed=None run.
        self.seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        self._epoch, self._position = 0, 0

        bucket_of = torch.searchsorted(torch.tensor(self.buckets), self._lengths)
        width = torch.tensor(self.buckets)[bucket_of]
        self._members = [torch.nonzero(bucket_of == b)[:, 0] for b in range(len(self.buckets))]
        self._num_batches = sum(math.ceil(len(m) / batch_size) for m in self._members)
        self.num_tokens = int(self._lengths.sum())
        self.padding_fraction = float((width - self._lengths).sum()) / float(width.sum())
        self._plan_cache: tuple[tuple[int, int], list[tuple[int, torch.Tensor]]] | None = None

    def _check_buckets(self, buckets: Sequence[int] | None) -> list[int]:
        """Validate user buckets (or choose them) and check every sequence fits."""
        longest = int(self._lengths.max())
        if buckets is None:
            return choose_buckets(self._lengths.numpy(), self.batch_size)
        if isinstance(buckets, (torch.Tensor, np.ndarray)):
            buckets = buckets.tolist()
        fix = " Fix: pass positive ints, e.g. buckets=[16, 32, 64], or buckets=None."
        if not isinstance(buckets, (list, tuple)):
            raise TypeError(f"buckets: received {type(buckets).__name__}; expected a list.{fix}")
        if not buckets:
            raise ValueError(f"buckets: received []; expected at least one bucket length.{fix}")
        out = sorted({_check_int("buckets", b, 1, fix) for b in buckets})
        if longest > out[-1]:
            raise ValueError(
                f"sequences[{int(torch.argmax(self._lengths))}] has length {longest}, longer "
                f"than the largest bucket {out[-1]} (buckets={out}). Fix: add a bucket >= "
                f"{longest}, or pass buckets=None to choose them from the lengths."
            )
        return out

    @property
    def default_bucket_key(self) -> int:
        """The largest bucket: its executor group is built first and sized for all others."""
        return self.buckets[-1]

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    @property
    def provide_data(self) -> list[DataDesc]:
        """Inputs of a full batch of the default bucket (MXNet style)."""
        shape = (self.batch_size, self.default_bucket_key)
        if self.include_lengths:
            lengths = DataDesc("data1", (self.batch_size,), torch.int64)
            return [DataDesc("data0", shape, self._dtype), lengths]
        return [DataDesc("data", shape, self._dtype)]

    @property
    def provide_label(self) -> list[DataDesc]:
        """Labels of a full batch ([] without labels)."""
        if self.labels is None:
            return []
        return [DataDesc("label", (self.batch_size, *self.labels.shape[1:]), self.labels.dtype)]

    def __len__(self) -> int:
        return self._num_batches

    @property
    def num_batches(self) -> int:  # TEMPORARY: the bucketing branch brings the real one
        return self._num_batches

    def plan(self) -> Any:  # TEMPORARY: the bucketing branch brings the real one
        from fitdp.sources.protocol import SourcePlan
        return SourcePlan(bucket_keys=tuple(self.buckets), default_bucket_key=self.buckets[-1],
                          inputs=(*self.provide_data, *self.provide_label),
                          num_samples=self.num_samples)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate; keeps the position of a partly consumed current epoch.

        Args:
            epoch: the epoch index (>= 0); the shuffle order depends on it.

        Raises:
            TypeError, ValueError: ``epoch`` is not an int >= 0.
        """
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self._epoch or self._position >= self._num_batches:
            self._epoch, self._position = epoch, 0

    def state_dict(self) -> dict[str, int]:
        """Seed, epoch and batches already yielded in this epoch (plain ints)."""
        return {"seed": self.seed, "epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` left off: the next iteration yields the remaining batches.

        Raises:
            ValueError: a key is missing or the position does not fit this data.
        """
        if missing := {"seed", "epoch", "position"} - set(state):
            raise ValueError(f"state: lacks {sorted(missing)}; expected a state_dict() result.")
        if not 0 <= int(state["position"]) <= self._num_batches:
            raise ValueError(
                f"state: position {state['position']} does not fit this iterator's "
                f"{self._num_batches} batches per epoch. Fix: build the iterator with the same "
                "sequences, batch_size and buckets as the run that saved it."
            )
        self.seed, self._epoch = int(state["seed"]), int(state["epoch"])
        self._position = int(state["position"])

    def _plan(self, epoch: int) -> list[tuple[int, torch.Tensor]]:
        """(bucket length, sample indices) of every batch of ``epoch``; depends on (seed, epoch)."""
        if self._plan_cache is not None and self._plan_cache[0] == (self.seed, epoch):
            return self._plan_cache[1]
        g = torch.Generator()
        g.manual_seed((self.seed * 0x9E3779B97F4A7C15 + epoch) % 2**64)
        batches: list[tuple[int, torch.Tensor]] = []
        for width, members in zip(self.buckets, self._members):
            if self.shuffle:
                members = members[torch.randperm(len(members), generator=g)]
            if len(members):  # split() of an empty bucket would yield one empty batch
                batches.extend((width, part) for part in members.split(self.batch_size))
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        self._plan_cache = ((self.seed, epoch), batches)  # keyed by seed: load_state_dict sets it
        return batches

    def _make_batch(self, width: int, index: torch.Tensor) -> DataBatch:
        """Pad the rows ``index`` to ``width`` with one masked gather."""
        lengths = self._lengths[index]
        cols = torch.arange(width)
        mask = cols < lengths[:, None]
        padded = torch.full((len(index), width), self.pad_value, dtype=self._dtype)
        padded[mask] = self._flat[(self._offsets[index][:, None] + cols)[mask]]
        label = None if self.labels is None else self.labels[index]
        data = (padded, lengths) if self.include_lengths else padded
        return DataBatch(data=data, label=label, bucket_key=width, pad=0, index=index)

    def __iter__(self) -> Iterator[DataBatch]:
        if self._position >= self._num_batches:  # finished epoch, no set_epoch: move on
            self._epoch, self._position = self._epoch + 1, 0
        epoch, plan = self._epoch, self._plan(self._epoch)
        # Stop if set_epoch/load_state_dict moved us elsewhere while this generator was alive.
        while self._epoch == epoch and self._position < len(plan):
            width, index = plan[self._position]
            self._position += 1  # counted before the yield: a checkpoint taken in the step
            yield self._make_batch(width, index)  # that trains this batch resumes after it


def _as_sequences(sequences: Any) -> list[torch.Tensor]:
    """Convert and check every sequence: a non-empty 1-D numeric tensor on the CPU."""
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__"):
        raise TypeError(f"sequences: received {type(sequences).__name__}; expected a list.")
    if len(sequences) == 0:
        raise ValueError("sequences: received an empty list; expected at least one sequence.")
    out = []
    for i, s in enumerate(sequences):
        try:
            t = s.detach().cpu() if isinstance(s, torch.Tensor) else torch.as_tensor(s)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(
                f"sequences[{i}]: received {type(s).__name__} that is not numeric ({e}); "
                "expected a 1-D tensor, list of ints or numpy array."
            ) from None
        if t.dim() != 1 or len(t) == 0:
            empty = t.dim() == 1
            got = "an empty sequence" if empty else f"shape {tuple(t.shape)}"
            fix = "drop empty sequences first" if empty else "flatten it"
            raise ValueError(
                f"sequences[{i}]: received {got}; expected a non-empty 1-D sequence. Fix: {fix}."
            )
        out.append(t)
    return out


def _as_labels(labels: Any, count: int) -> torch.Tensor | None:
    """Labels as one CPU tensor whose dim 0 matches the number of sequences."""
    if labels is None:
        return None
    try:
        t = labels.detach().cpu() if isinstance(labels, torch.Tensor) else torch.as_tensor(labels)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f"labels: received {type(labels).__name__} that cannot become one tensor ({e}); "
            "expected a tensor, list or numpy array with one label per sequence, or None."
        ) from None
    if t.dim() == 0 or t.shape[0] != count:
        got = "a scalar" if t.dim() == 0 else f"{t.shape[0]} labels"
        raise ValueError(
            f"labels: received {got} for {count} sequences; expected one label per "
            "sequence. Fix: pass labels in the same order and number as sequences."
        )
    return t


def _check_int(name: str, value: Any, minimum: int | None, fix: str = "") -> int:
    """``value`` as an int >= ``minimum``, else a TypeError/ValueError naming ``name``."""
    expected = "an int" if minimum is None else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        got = f"{value!r} ({type(value).__name__})"
        raise TypeError(f"{name}: received {got}; expected {expected}.{fix}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: received {value}; expected {expected}.{fix}")
    return int(value)
