"""What a slice of a batch weighs, and what the logged loss counts: the one rule.

Every slice's loss is a mean; the executor backpropagates ``loss * weight`` (``weighted``) so
that the summed gradients of the slices are the whole batch's gradient on one device, and
logs ``loss * count`` over the summed counts so that the logged loss is the one-device mean.
What a slice's mean divides by is:

- its valid rows (padding left out), the default; per-sample weights mean over rows too
  (Keras's ``sum_over_batch_size``);
- for a loss that says what it averages over (a ``counts(labels)`` attribute: an ignore
  index, per-token labels padded with -100; ``TokenMean``), the targets it counts;
- for a module's own loss (``compile(loss=None, loss_items=...)``, ``ItemCount`` in
  ``fitdp.compiled.own_loss``: ``reads_inputs``, a Hugging Face batch holds its labels), the
  items of the slice's inputs and labels.

The weight of a slice is its count over the batch's (summed over the ranks under
torch.distributed). The same rule serves the built-in step, a custom ``train_step``
(``fitdp.call.custom_step``, which weighs by what is declared only), and both the bound step
and the MXNet-style ``forward``.

Labels with no ignored target (ordinary class labels) count as their rows: that is found once
per labels tensor (the base tensor an in-memory source slices, while unchanged) and kept in
``Weighing``'s one cache, so most steps make no counting op at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fitdp.data.batch import axis_of, take_rows

# labels -> targets the loss means over; one with ``reads_inputs`` (``loss_items``) is called
# (inputs, labels)
Count = Callable[..., "torch.Tensor | None"]


class Slices(Protocol):
    """A batch's slices as ``weigh`` reads and fills them (``fitdp.executor.step.Job``)."""

    executors: list[Any]  # each with .device, .valid, .inputs, .labels, .valid_rows
    weights: list[Any]
    counts: list[Any]
    valid: list[int]
    slices: list[slice]
    batch: Any
    axis: int

    def load_all(self) -> None: ...


def weighted(loss: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """``loss`` times its slice's ``weight`` (what backward runs on)."""
    return loss if isinstance(weight, float) and weight == 1.0 else loss * weight


def all_reduce(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the ranks (a counted loss's denominator), in place."""
    dist.all_reduce(value)
    return value


def global_rows(local: int, device: torch.device) -> int | torch.Tensor:
    """This step's rows summed over the ranks (ranks' batches may differ in size): a number
    on the CPU, a tensor on ``device`` elsewhere (no host sync per step)."""
    # torch.full fills on the device from a kernel argument; torch.tensor([local],
    # device=...) would build it on the host and copy it over, blocking.
    total = torch.full((1,), float(local), device=device)
    dist.all_reduce(total)
    return int(total.item()) if device.type == "cpu" else total


def slice_count(counter: Count, data: Any, labels: Any) -> torch.Tensor | None:
    """What a slice's mean loss divides by: ``counter(data, labels)`` for the items of
    ``compile(loss_items=...)``, ``counter(labels)`` for a loss that counts its targets
    (None without targets)."""
    if getattr(counter, "reads_inputs", False):
        return counter(data, labels)
    return None if labels is None else counter(labels)


class Weighing:
    """The rule of the module docstring for one manager's steps.

    Args:
        counter: what a slice's mean divides by when not its rows (the compute's
            ``counts``), or None: rows.
        devices: the replicas this process runs, in order.
        ranks: other ranks take part (the counts are summed over them).

    Example:
        >>> w = Weighing(None, [torch.device("cpu")] * 2, ranks=False)
        >>> w.counter is None, w.several
        (True, True)
    """

    def __init__(self, counter: Count | None, devices: Sequence[torch.device],
                 ranks: bool) -> None:
        self.counter = counter
        self.items = getattr(counter, "reads_inputs", False)
        # Slices weigh by counts only when there are several (devices or ranks); one
        # device's count is still what its logged loss weighs.
        self.several = len(devices) > 1 or ranks
        self.ranks = ranks
        self.lead = devices[0]  # where the rows summed over the ranks are counted
        # Counted from the batch's rows on this thread: no device needs its slice first.
        self.from_batch = not ranks and all(d.type == "cpu" for d in devices)
        self._clean: tuple[torch.Tensor, int] | None = None  # labels with no target ignored

    def count(self, batch: Any, rows: slice, axis: int) -> float:
        """What the mean loss of ``batch``'s ``rows`` divides by, as a number: the rows, or
        the targets counted as ``weigh`` counts them (the reproducible step's micro-batches,
        ``fitdp.executor.reproducible``, each weigh theirs over the batch's sum)."""
        n = float(rows.stop - rows.start)
        counter = self.counter
        if counter is None or batch.sample_weight is not None or (
                batch.label is None and not self.items):
            return n
        c = slice_count(counter, take_rows(batch.data, rows, axis) if self.items else None,
                        take_rows(batch.label, rows, axis))
        return n if c is None else float(c)

    def weigh(self, job: Slices, total_rows: int | torch.Tensor | None,
              over_ranks: bool = False) -> None:
        """Each device's loss weight and count into ``job``: its valid rows over
        ``total_rows``, or its share of the counted targets. ``total_rows`` None: the
        batch's valid rows, summed over the ranks with ``over_ranks`` (a training step under
        torch.distributed: the ranks' batches may differ in size)."""
        if total_rows is None:
            total_rows = sum(job.valid)
            if over_ranks:
                total_rows = global_rows(total_rows, self.lead)
        executors, weights, counts, valid = job.executors, job.weights, job.counts, job.valid
        if not isinstance(total_rows, torch.Tensor):
            denom = float(max(total_rows, 1))
            for d in range(len(weights)):
                weights[d], counts[d] = valid[d] / denom, valid[d]
        else:  # summed over ranks, on device 0: each device's weight on its own device
            denom_t = total_rows.clamp(min=1)
            for d, ex in enumerate(executors):
                weights[d] = (valid[d] / denom_t).to(ex.device, non_blocking=True)
                counts[d] = valid[d]
        counter, batch = self.counter, job.batch
        if counter is None or batch.sample_weight is not None or (
                batch.label is None and not self.items):
            return  # rows weigh the slices
        if self.from_batch:
            label = batch.label
            # Labels with an integer count of all their targets ignore none: each slice
            # counts as its rows. Counted once per base tensor while unchanged (its version
            # counter); on the CPU no device sync.
            clean = False
            if not self.items and isinstance(label, torch.Tensor):
                base = label if label._base is None else label._base
                seen = self._clean
                clean = seen is not None and seen[0] is base and seen[1] == base._version
                if not clean:
                    whole = counter(base)
                    clean = whole is not None and not whole.is_floating_point() and int(
                        whole) == base.numel()
                    if clean:
                        self._clean = (base, base._version)
            if clean:
                # No target ignored: each slice counts its rows times the targets per row
                # (the weights stay the rows'; the logged count is the targets', which
                # differ from the rows' when batches differ in length: buckets). Labels of
                # one dim have one target per row: the rows' counts.
                if label.dim() > 1:
                    rows = label.shape[axis_of(label, job.axis)]
                    per_row = label.numel() // max(rows, 1)
                    if per_row != 1:
                        for d in range(len(counts)):
                            counts[d] = valid[d] * per_row
                return
            parts: list[tuple[Any, Any] | None] = []
            for sl, v in zip(job.slices, valid):
                rows = slice(sl.start, sl.start + v)
                parts.append((take_rows(batch.data, rows, job.axis) if self.items else None,
                              take_rows(batch.label, rows, job.axis)) if v else None)
        else:  # a collective over the ranks, or counts on the devices: from the loaded slices
            job.load_all()
            parts = [(ex.valid_rows(ex.inputs) if self.items else None, ex.valid_rows(ex.labels))
                     if ex.valid and (self.items or ex.labels is not None) else None
                     for ex in executors]
        counted = self._count(parts, [ex.device for ex in executors])
        if counted is not None:
            per, total = counted
            for d, c in enumerate(per):
                counts[d] = c
                if self.several:
                    weights[d] = c / total.to(c.device, non_blocking=True)

    def _count(self, parts: Sequence[tuple[Any, Any] | None], devices: Sequence[torch.device]
               ) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """Per device, what its slice's mean divides by, and their sum over devices and
        ranks (``parts``: each device's ``(inputs, labels)``, None: no rows). None for a loss
        that means over rows after all."""
        counts = []
        for part, dev in zip(parts, devices):
            c = None if part is None else slice_count(self.counter, *part)  # type: ignore[arg-type]
            if c is None and part is not None:
                return None
            counts.append(torch.zeros((), device=dev) if c is None else c.float().to(dev))
        total = torch.stack([c.to(devices[0], non_blocking=True) for c in counts]).sum()
        if self.ranks:
            total = all_reduce(total)
        return counts, total.clamp(min=1)
