"""In-memory tensors as a data source: batches are slices of a once-per-epoch permutation."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fitdp.checks import FitdpWarning
from fitdp.data.batch import DataBatch, batch_length, tree_map
from fitdp.data.sources.protocol import SourcePlan, past_end_problem, position_problem


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of one epoch's order: a function of ``(seed, epoch)`` alone, so a
    resumed run sees the same order."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))


class TensorSource:
    """In-memory tensors, batched by slicing a permuted copy made once per epoch (no collate).

    Under torch.distributed every step takes one global batch of ``batch_size`` rows per
    rank, split evenly over the ranks, so every rank runs the same number of steps.

    Args:
        x: a tensor, or a tuple/list/dict of tensors with the same number of rows.
        y: the targets (same forms), or None (predict).
        batch_size: rows per step of this process.
        sample_weight: per-row loss weights, shape ``(rows,)``, or None.
        shuffle: a new order every epoch.
        seed: seed of the orders (with the epoch).
        rank, world_size: this process's place in a torch.distributed job.
        pin_memory: gather each shuffled epoch into pinned host memory (for CUDA devices:
            their ``non_blocking`` input copies are then asynchronous).
        rank_unit: a rank's part of a global batch is whole runs of this many rows, earlier
            ranks first (the micro-batches of ``fit(reproducible=True)``: the ranks'
            micro-batches are then one process's).

    Example:
        >>> src = TensorSource(torch.arange(5.0), None, batch_size=2, shuffle=False)
        >>> [b.data.tolist() for b in src]
        [[0.0, 1.0], [2.0, 3.0], [4.0]]
    """

    def __init__(
        self, x: Any, y: Any, batch_size: int, *, sample_weight: torch.Tensor | None = None,
        shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
        pin_memory: bool = False, rank_unit: int = 1,
    ) -> None:
        self.x, self.y, self.w = x, y, sample_weight
        self.pin_memory = pin_memory
        self.num_samples = batch_length(x)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        self.rank_unit = rank_unit
        self.epoch = 0
        self.position = 0

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.global_batch)

    def __len__(self) -> int:
        return self.num_batches

    def plan(self) -> SourcePlan:
        return SourcePlan(rows_per_step=self.batch_size, num_samples=self.num_samples,
                          targets=self.y)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[DataBatch]:
        x, y, w = self.x, self.y, self.w
        if self.shuffle:
            # One gather per epoch, then every batch is a view: the cheapest way to batch.
            order = torch.randperm(self.num_samples,
                                   generator=epoch_generator(self.seed, self.epoch))
            x, y, w = tree_map(lambda t: _gather(t, order, self.pin_memory), (x, y, w))
        take, take_y = _slicer(x), _slicer(y)
        take_w = None if w is None else _slicer(w)
        steps, size, n = self.num_batches, self.global_batch, self.num_samples
        one = self.world_size == 1
        while self.position < steps:
            if one:  # (every step: the common case without _rows' arithmetic)
                start = self.position * size
                stop = min(start + size, n)
                sl, rows = slice(start, stop), stop - start
            else:
                sl, rows = self._rows(self.position)
            self.position += 1
            # No per-batch index: predict never shuffles, so batch order is input order.
            yield DataBatch.of_rows(take(sl), take_y(sl), rows,
                                    None if take_w is None else take_w(sl))

    def _rows(self, step: int) -> tuple[slice, int]:
        """This rank's rows of global batch ``step`` (an even split of its runs of
        ``rank_unit`` rows, earlier ranks first), and the global batch's size."""
        start = step * self.global_batch
        rows = min(self.global_batch, self.num_samples - start)
        unit = self.rank_unit
        base, extra = divmod(-(-rows // unit), self.world_size)
        first = self.rank * base + min(self.rank, extra)
        stop = min((first + base + (self.rank < extra)) * unit, rows)
        return slice(start + first * unit, start + stop), rows

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "global_batch": self.global_batch, "batch_size": self.batch_size,
                "samples": self.num_samples}

    def check_resume(self, state: Any, *, continues: bool) -> str | None:
        problem = position_problem(state, ("seed", "epoch", "position"), "in-memory tensors")
        if problem or not continues:
            return problem
        return past_end_problem(state, rows=state.get("global_batch", self.global_batch),
                                samples=self.num_samples, batches=self.num_batches)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        old = int(state.get("global_batch", self.global_batch))
        self.position = rebatched(int(state["position"]), old, self.global_batch,
                                  self.num_samples, self.epoch,
                                  int(state.get("batch_size", old)), self.batch_size)


def rebatched(position: int, old: int, new: int, samples: int | None, epoch: int,
              old_batch_size: int, batch_size: int) -> int:
    """The position (in batches of ``new`` rows) that continues after the samples that
    ``position`` batches of ``old`` rows trained: a resume with another batch size (or
    world size). Mid-epoch that is another run than the checkpoint's, so it warns, naming
    both sizes, and says which samples train again (the old position rounded down to a
    whole new batch); at an epoch's end it lines up and says nothing."""
    seen = position * old
    if old == new or position == 0 or (samples is not None and seen >= samples):
        return seen // new
    again = seen - seen // new * new
    sizes = (f"batch_size={old_batch_size}, this fit has batch_size={batch_size}"
             if old_batch_size != batch_size else
             f"a global batch of {old} rows, this fit has {new} (another world size)")
    warnings.warn(
        f"resume: the checkpoint was taken {position} batches into epoch {epoch} with {sizes}; "
        f"the epoch continues after the {seen} samples already trained"
        f"{f', and the last {again} of them train again' if again else ''}. The rest of the "
        f"run is not the one the checkpoint came from (its batches, steps and schedule). "
        f"Fix: resume with batch_size={old_batch_size} to continue it exactly.",
        FitdpWarning, stacklevel=3)
    return seen // new


def _gather(t: torch.Tensor, order: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t[order]``; with ``pin``, into pinned memory (host tensors only): the epoch's copy
    exists anyway, so pinning it costs no extra pass, and torch's caching host allocator
    hands the block out again only once the copies queued from it have finished."""
    if not pin or t.device.type != "cpu":
        return t[order]
    out = torch.empty((len(order), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
    return torch.index_select(t, 0, order, out=out)


def _slicer(tree: Any) -> Any:
    """``sl -> tree[sl]`` for a tensor, a tree of tensors or None."""
    if tree is None:
        return lambda sl: None
    if isinstance(tree, torch.Tensor):
        return tree.__getitem__
    return lambda sl: tree_map(lambda t: t[sl], tree)
