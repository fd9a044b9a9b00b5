"""The reproducible step: the same numbers on any device list, work loads or world size.

``fit(..., reproducible=True, micro_batch_size=k)`` binds a ``ReproducibleStep`` in place
of the ordinary ``Step`` (same call: ``step(batch, zero_grad=, step=, total_rows=)``).
What normally depends on the layout is fixed by the micro-batch index instead:

- **Work.** A batch (under torchrun: the global batch, each rank holding a contiguous run
  of it) is cut into micro-batches of ``k`` rows, numbered in row order. Each runs forward
  and backward on its own, so every layer sees the same shapes (BLAS the same kernels,
  BatchNorm the same batch statistics) whoever runs it; a device takes a contiguous run of
  whole micro-batches by its work load.
- **Sums.** Gradients are added over a fixed binary tree of micro-batch indices
  (``canonical_sum``): node ``(level, j)`` is the sum over the aligned block
  ``[j * 2**level, (j + 1) * 2**level)``. A device sums the aligned blocks inside its run
  as they complete (``BlockStack``: at most one partial sum per level), device 0 (every
  rank, after an ``all_gather``) joins the blocks in the tree's order. The logged loss and
  the metric updates take the micro-batches in index order on one device.
- **Random numbers.** Each micro-batch's forward draws from the generator seeded with
  ``(base + index)``, ``base`` drawn once per batch from torch's global generator (saved
  with checkpoints; nothing else in the step draws from it), not from the device's.
- **BatchNorm statistics.** Each micro-batch's forward records its own batch statistics
  (momentum 1 over zeroed running buffers: exactly the statistics); after the batch they
  are folded into the step's starting statistics in index order, with the layer's
  momentum, and copied to every replica.

The optimizer step is the executor's ``Update`` (clip, step, broadcast), given the
canonical gradient on device 0 with nothing left to reduce: the engine's own reduction is
switched off (DDP's ``no_sync``, ``Engine.prepare(False)``) and its cross-rank sum not bound.
An engine that shards the weights (FSDP2) reduce-scatters in backward, in its own order, and
is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fitdp.data.batch import DataBatch, checked_rows, take_rows, tree_cat, tree_map
from fitdp.executor.replica import Executor
from fitdp.executor.shared_generator import SHARED, generator
from fitdp.executor.slicing import device_slices
from fitdp.executor.step import metric_pair
from fitdp.executor.update import Update

# (multiplies each loss before backward: a ``GradScaler``'s ``scale``)
Scale = Callable[[torch.Tensor], torch.Tensor]
Grads = list[torch.Tensor]
Block = tuple[int, int]  # (level, index): the aligned block [index * 2**level, ...)


def micro_batches(rows: int, size: int) -> list[slice]:
    """``rows`` rows cut into runs of ``size`` (the last may be shorter).

    Example:
        >>> micro_batches(10, 4)
        [slice(0, 4, None), slice(4, 8, None), slice(8, 10, None)]
    """
    return [slice(a, min(a + size, rows)) for a in range(0, rows, size)]


class BlockStack:
    """Partial sums of consecutive micro-batches' gradients, merged as aligned blocks
    complete: pushing leaves ``a, ..., b - 1`` keeps the maximal aligned blocks of
    ``[a, b)`` seen so far, at most one per level (O(log n) gradients held).

    Example:
        >>> s = BlockStack()
        >>> for i in (1, 2, 3): s.push(i, [torch.tensor(float(i))])
        >>> [(block, g[0].item()) for block, g in s.blocks]
        [((0, 1), 1.0), ((1, 1), 5.0)]
    """

    def __init__(self) -> None:
        self.blocks: list[tuple[Block, Grads]] = []

    def push(self, index: int, grads: Grads) -> None:
        """Micro-batch ``index``'s gradients (the one after the last pushed)."""
        blocks = self.blocks
        blocks.append(((0, index), grads))
        while len(blocks) >= 2:
            (lv, j), right = blocks[-1]
            (lv0, i), left = blocks[-2]
            if lv0 != lv or i != j - 1 or i % 2:
                break
            blocks[-2:] = [((lv + 1, i // 2), list(torch._foreach_add(left, right)))]


def canonical_sum(blocks: dict[Block, Grads], n: int) -> Grads:
    """The sum over ``n`` micro-batches along the fixed tree: node ``(level, j)`` is the
    sum of its two children (the right one only where it holds micro-batches), or the
    block itself when a device handed it over whole. Every layout gives the same bits.

    Example:
        >>> leaves = {(0, i): [torch.tensor(v)] for i, v in enumerate([1e8, 1.0, -1e8])}
        >>> canonical_sum(leaves, 3)[0].item()  # (1e8 + 1) + (-1e8), in float32
        0.0
    """
    def value(level: int, j: int) -> Grads:
        got = blocks.get((level, j))
        if got is not None:
            return got
        if level == 0:
            raise KeyError(f"micro-batch {j}: no gradients were handed over")
        left = value(level - 1, 2 * j)
        if (2 * j + 1) << (level - 1) >= n:
            return left
        return list(torch._foreach_add(left, value(level - 1, 2 * j + 1)))

    return value(max(0, (n - 1).bit_length()), 0)


class BatchNormFold:
    """Each micro-batch's BatchNorm batch statistics, folded in index order (see the
    module docstring). One list of layers per replica, in the same order on each."""

    def __init__(self, replicas: Sequence[nn.Module]) -> None:
        self.layers = [[m for m in r.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
                       for r in replicas]
        self.momenta: list[float | None] = [m.momentum for m in self.layers[0]]
        self.active: list[bool] = []
        self.start: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def begin(self) -> None:
        """The batch's starting statistics (device 0's), and each replica's tracking layers
        set to record plain batch statistics."""
        self.active = [m.training and m.track_running_stats and m.running_mean is not None
                       for m in self.layers[0]]
        self.start = [(m.running_mean.clone(), m.running_var.clone(),  # type: ignore[union-attr]
                       m.num_batches_tracked.clone())  # type: ignore[union-attr]
                      for m, on in zip(self.layers[0], self.active) if on]
        for layers in self.layers:
            for m, on in zip(layers, self.active):
                if on:
                    m.momentum = 1.0

    def before(self, d: int) -> None:
        """Before a forward on replica ``d``: zeroed running buffers (momentum 1 makes them
        the micro-batch's statistics exactly)."""
        for m, on in zip(self.layers[d], self.active):
            if on:
                m.running_mean.zero_()  # type: ignore[union-attr]
                m.running_var.zero_()  # type: ignore[union-attr]

    def after(self, d: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batch's statistics recorded by replica ``d``'s forward."""
        return [(m.running_mean.clone(), m.running_var.clone())  # type: ignore[union-attr]
                for m, on in zip(self.layers[d], self.active) if on]

    def end(self, stats: Sequence[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Fold every micro-batch's ``stats`` (index order) into the starting statistics on
        replica 0, copy them to the others, and put the momenta back."""
        layers = [m for m, on in zip(self.layers[0], self.active) if on]
        momenta = [mo for mo, on in zip(self.momenta, self.active) if on]
        with torch.no_grad():
            for k, (m, momentum) in enumerate(zip(layers, momenta)):
                mean, var, tracked = (t.clone() for t in self.start[k])
                for s in stats:
                    tracked += 1
                    f = 1.0 / float(tracked) if momentum is None else momentum
                    batch_mean, batch_var = (t.to(mean.device) for t in s[k])
                    mean = batch_mean * f + mean * (1.0 - f)
                    var = batch_var * f + var * (1.0 - f)
                m.running_mean.copy_(mean)  # type: ignore[union-attr]
                m.running_var.copy_(var)  # type: ignore[union-attr]
                m.num_batches_tracked.copy_(tracked)  # type: ignore[union-attr]
            for layers_d in self.layers[1:]:
                for m0, m, on in zip(self.layers[0], layers_d, self.active):
                    if on:
                        for name in ("running_mean", "running_var", "num_batches_tracked"):
                            getattr(m, name).copy_(getattr(m0, name))
        self.restore()

    def abort(self) -> None:
        """After a failed batch: the starting statistics back on every replica."""
        with torch.no_grad():
            for layers in self.layers:
                for m, saved in zip([m for m, on in zip(layers, self.active) if on], self.start):
                    for name, value in zip(("running_mean", "running_var",
                                            "num_batches_tracked"), saved):
                        getattr(m, name).copy_(value)
        self.restore()

    def restore(self) -> None:
        """Every layer's own momentum back."""
        for layers in self.layers:
            for m, momentum in zip(layers, self.momenta):
                m.momentum = momentum


class _Recorded:
    """A replica's ``compute`` that keeps the unweighted loss it returned (the logs)."""

    def __init__(self, compute: Callable[[Executor, bool], tuple[Any, Any]]) -> None:
        self.compute = compute
        self.loss: torch.Tensor | None = None

    def __call__(self, ex: Executor, training: bool) -> tuple[Any, Any]:
        loss, outputs = self.compute(ex, training)
        self.loss = loss
        return loss, outputs


class _Share:
    """What one device did with its run of micro-batches in one batch."""

    def __init__(self) -> None:
        self.stack = BlockStack()
        self.losses: list[tuple[float, float]] = []  # (mean loss, what it means over)
        self.outputs: list[tuple[Any, Any, Any]] = []  # (outputs, labels, weights)
        self.stats: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.draws = False


class ReproducibleStep:
    """The step of a ``reproducible=True`` fit, bound once per call (module docstring).

    Args:
        mgr: the manager.
        is_train: train, or evaluate (forward, logged loss and metrics only).
        micro_batch_size: rows per micro-batch.
        update: the manager's update (training; its options leave the ranks' sum to this
            step), or None.
        scale: multiplies each loss before backward (a ``GradScaler``'s), or None.
        metric: a ``DeviceMetrics``, updated on device 0 with the batch's micro-batches
            joined in index order, or None.

    Raises:
        ValueError: an engine that shards the weights (FSDP2: it reduce-scatters the
            gradients in backward, in its own order).
    """

    def __init__(self, mgr: Any, is_train: bool, micro_batch_size: int, *,
                 update: Update | None = None, scale: Scale | None = None,
                 metric: Any = None) -> None:
        if mgr.engine.shards_weights:
            raise ValueError("fit(reproducible=True): got strategy='fsdp'; expected DDP or "
                             "fitdp's own reduction (FSDP2 reduce-scatters in backward, in "
                             "its own order). Fix: compile(strategy='auto') or 'ddp'.")
        self.mgr = mgr
        self.is_train, self.size = is_train, micro_batch_size
        self.scale, self.metric = scale, metric
        self.autocast = mgr.autocast_dtype
        self.distributed = mgr.distributed
        # Told, per training batch, that its backward is not the engine's to reduce.
        self.engine = mgr.engine if is_train else None
        self.weighing = mgr.weighing()  # what each micro-batch's mean divides by
        # Nothing left to reduce for the update (no cross-rank sum): the canonical sum is
        # device 0's gradient, the ranks' joined already.
        self.update = update
        self.computes = [_Recorded(mgr.compute) for _ in mgr.devices]
        self.samples = 0  # rows run so far (a call's throughput reads it)
        self.draws: bool | None = None  # whether forward draws random numbers (first batch)
        self.folds: dict[int, BatchNormFold] = {}  # per bucket group

    def fits(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether this step still describes ``optimizer``."""
        return self.update is None or self.update.fits(optimizer)

    # -- one batch --------------------------------------------------------------------------

    def __call__(self, batch: DataBatch, *, zero_grad: bool = False, step: bool = False,
                 total_rows: int | torch.Tensor | None = None) -> None:
        """Forward (and backward) of ``batch`` micro-batch by micro-batch, the canonical
        gradient into device 0's (added to the accumulated one unless ``zero_grad``), the
        logs and BatchNorm statistics; with ``step``, the optimizer step. ``total_rows`` is
        not read: each micro-batch weighs its share of the (global) batch's rows, or of its
        counted targets."""
        mgr = self.mgr
        rows, axis = checked_rows(batch)
        valid = rows - batch.pad
        self.samples += valid
        group = mgr.group_of(batch, checked=True)
        executors = group.executors
        parts = micro_batches(valid, self.size)
        counts = [self.weighing.count(batch, sl, axis) for sl in parts]
        offset, n, total = 0, len(parts), sum(counts)
        if self.distributed:  # where this rank's micro-batches sit in the global batch
            sizes: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(sizes, (len(parts), total))
            offset = sum(c for c, _ in sizes[:dist.get_rank()])
            n, total = sum(c for c, _ in sizes), sum(t for _, t in sizes)
        training = self.is_train
        base = int(torch.randint(0, 2**62, (1,))) if training else 0
        runs = device_slices(len(parts), mgr.work_load_list)
        shares = [_Share() for _ in executors]
        bn = self._fold(group) if training else None
        if self.engine is not None:
            self.engine.prepare(False)  # DDP's own reduction never runs here: the tree's does
        prev = mgr.loss_state()
        ok = False
        try:
            if bn is not None:
                bn.begin()
            tasks = [self._task(batch, axis, parts, counts, total, offset, base, run, d,
                                executors[d], shares[d], bn)
                     for d, run in enumerate(runs)]
            mgr.workers.run(tasks)
            if self.draws is None and training:
                self.draws = any(s.draws for s in shares)
            gathered = self._gather(shares)
            ok = True
        finally:
            if bn is not None and not ok:
                bn.abort()
        losses = [x for s in gathered for x in s[1]]
        if bn is not None:
            bn.end([x for s in gathered for x in s[2]])
        self._log(prev, losses)
        if self.metric is not None:
            self._update_metric([x for s in gathered for x in s[3]])
        if training:
            blocks = {block: [g.to(mgr.devices[0]) for g in grads]
                      for s in gathered for block, grads in s[0]}
            self._accumulate(canonical_sum(blocks, n) if n else None, zero_grad)
            if step:
                self.step_now()

    def _fold(self, group: Any) -> BatchNormFold | None:
        """The BatchNorm layers of ``group``'s replicas (found once per group), or None."""
        fold = self.folds.get(id(group))
        if fold is None:
            fold = self.folds[id(group)] = BatchNormFold([ex.module for ex in group.executors])
        return fold if fold.layers[0] else None

    def step_now(self) -> None:
        """The optimizer step alone, from the gradients of the batches run so far."""
        update = self.update
        if update is not None and update.optimizer is not None:
            update.apply()

    def _task(self, batch: DataBatch, axis: int, parts: list[slice], counts: list[float],
              total: float, offset: int, base: int, run: slice, d: int, ex: Executor,
              share: _Share, bn: BatchNormFold | None) -> Callable[[], None]:
        """Device ``d``'s run of micro-batches, as one task for its thread."""
        training, compute = self.is_train, self.computes[d]
        params = [p for p, on in zip((row[d] for row in self.mgr.param_arrays),
                                     self.mgr.trainable) if on] if training else []
        cpu = ex.device.type == "cpu"

        def task() -> None:
            for i in range(run.start, run.stop):
                sl = parts[i]
                w = None if batch.sample_weight is None else batch.sample_weight[sl]
                ex.load(take_rows(batch.data, sl, axis), None if batch.label is None else
                        take_rows(batch.label, sl, axis), sl.stop - sl.start, w, axis,
                        sl.stop - sl.start)
                if bn is not None:
                    bn.before(d)
                weight = counts[i] / max(total, 1.0)
                if training and self.draws is not False:
                    self._forward_seeded(ex, compute, weight, counts[i], base + offset + i,
                                         cpu, share)
                else:
                    ex.forward(training, compute, weight, self.autocast, int(counts[i]))
                if bn is not None:
                    share.stats.append(bn.after(d))
                loss = compute.loss
                share.losses.append((0.0 if loss is None else float(loss.detach()), counts[i]))
                if self.metric is not None and ex.outputs is not None:
                    outputs, labels = metric_pair(ex.outputs, ex.inputs, ex.labels)
                    if labels is not None:
                        share.outputs.append(tree_map(lambda t: t.detach(), (
                            ex.valid_outputs(outputs), ex.valid_rows(labels),
                            None if ex.weights is None else ex.valid_rows(ex.weights))))
                if training:
                    share.stack.push(offset + i, self._grads(ex, params))
            if run.start == run.stop:
                ex.valid = 0  # idle this batch: no outputs of an earlier one are read

        return task

    def _forward_seeded(self, ex: Executor, compute: _Recorded, weight: float, count: float,
                        seed: int, cpu: bool, share: _Share) -> None:
        """A training forward drawing from the generator seeded with ``seed``; the
        device's generator is given back as it was (CPU replicas share one: held alone, as
        a checkpointed block's recompute holds it)."""
        gen = generator(ex.device)
        with SHARED if cpu else _NULL_LOCK:
            state = gen.get_state()
            gen.manual_seed(seed % 2**63)
            seeded = gen.get_state()
            try:
                ex.forward(True, compute, weight, self.autocast, int(count))
                share.draws = share.draws or not torch.equal(gen.get_state(), seeded)
            finally:
                gen.set_state(state)

    def _grads(self, ex: Executor, params: list[nn.Parameter]) -> Grads:
        """The micro-batch's weighted gradients (zeros where it reaches no parameter),
        without touching ``.grad``."""
        loss, ex.loss = ex.loss, None
        if loss is None or not loss.requires_grad or not params:
            return [torch.zeros_like(p) for p in params]
        if self.scale is not None:
            loss = self.scale(loss)
        got = torch.autograd.grad(loss, params, allow_unused=True)
        # Contiguous: an accumulated step adds into them in place (an expanded one could not).
        return [torch.zeros_like(p) if g is None else g.contiguous()
                for p, g in zip(params, got)]

    # -- after the devices ------------------------------------------------------------------

    def _gather(self, shares: list[_Share]) -> list[tuple[Any, Any, Any, Any]]:
        """Every device's (and rank's) blocks, losses, statistics and metric rows, in
        micro-batch order (devices and ranks hold contiguous runs, in order)."""
        mine = [(s.stack.blocks, s.losses, s.stats, s.outputs) for s in shares]
        if not self.distributed:
            return mine
        if any(ex.device.type != "cpu" for ex in self.mgr.execgrp.executors):
            mine = tree_map(lambda t: t.cpu(), mine)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return [s for rank in everyone for s in rank]

    def _log(self, prev: tuple[torch.Tensor, torch.Tensor],
             losses: list[tuple[float, float]]) -> None:
        """The batch's logged loss, summed in index order, onto executor 0 (rank 0): the
        sums the forwards kept per device are replaced."""
        total = count = 0.0
        for value, c in losses:
            total += value * c
            count += c
        if self.distributed and dist.get_rank() != 0:
            total = count = 0.0
        self.mgr.restore_loss([(prev[0] + total, prev[1] + count)])

    def _update_metric(self, rows: list[tuple[Any, Any, Any]]) -> None:
        """One update of device 0's metrics with the batch's rows in index order. Under
        torchrun rank 0 updates with every rank's rows and the others not at all: their
        states stay the defaults, so the ranks' sum of states, which torchmetrics takes when
        it computes, is rank 0's alone, bit for bit."""
        if not rows:
            return
        dev = self.mgr.devices[0]
        moved = [tree_map(lambda t: t.to(dev), r) for r in rows]
        joined: list[Any] = [None if moved[0][i] is None else
                             tree_cat([r[i] for r in moved], 0) for i in range(3)]
        if self.distributed and dist.get_rank() != 0:
            # Built (a Keras name on first sight) but never updated; computed without
            # torchmetrics' cache, so every rank joins each compute's gather of states.
            for spec in self.metric.specs[0].values():
                outputs, labels = joined[0], joined[1]
                if spec.output is not None:
                    outputs, labels = outputs[spec.output], labels[spec.output]
                spec.build(outputs, labels).compute_with_cache = False
            return
        self.metric.update(0, *joined)
        self.metric.end_batch()

    def _accumulate(self, grads: Grads | None, zero: bool) -> None:
        """Device 0's gradients: the batch's canonical sum, added to those accumulated
        since the last step unless ``zero``; every other replica's left empty."""
        update = self.update
        assert update is not None  # noqa: S101 - training
        for d in range(1, len(self.mgr.devices)):
            update.zero_device(d)
        masters = update.masters
        if grads is None:
            grads = [torch.zeros_like(p) for p in masters]
        for p, g in zip(masters, grads):
            if p.grad is None:
                p.grad = g
            elif zero:
                p.grad.copy_(g)
            else:
                p.grad.add_(g)


class _NullLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_LOCK = _NullLock()
