"""What a failed call puts back: the call's start when it took no optimizer step
(``CallStart``), and the replicas' buffers as the running optimizer step found them
(``StepStart``).

A training forward moves BatchNorm's running statistics (and any buffer a module updates in
place: spectral norm's vectors, a MoCo queue) before its loss, backward or metric can fail,
on every replica it reached. A failed call must leave them as after the last completed
optimizer step, or as the call found them when it took none (docs/design.md, "What a call
does"), so the session copies them at the first batch of every optimizer step
(``Session.train_step``) and ``Session.rollback`` writes the copy back.

Which buffers is decided once per call: the call's first step copies every buffer; from the
second on, only the running statistics of torch's normalization layers (``_NormBase``: its
kernels write them without moving their ``Tensor._version``) and the buffers whose version
the first step moved. A model whose buffers never change (position ids, masks) copies
nothing per step; a CNN's copy is its BatchNorm statistics, a few kilobytes, one
``torch._foreach_copy_`` per device and dtype: 10 to 25 us a step, under 0.05% of a small
BatchNorm CNN's CPU step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from fitdp.call.plan import CallPlan, FitPlan
from fitdp.call.run_state import RunState
from fitdp.compiled.setup import Compiled


class StepStart:
    """Copies of the buffers of ``blocks`` (``[buffer][replica]``, the manager's
    ``aux_arrays``) of the replicas ``modules`` as the running optimizer step found them.

    Example:
        >>> norm = nn.BatchNorm1d(2)
        >>> start = StepStart([[b] for b in norm.buffers()], [norm])
        >>> start.save(0); _ = norm(torch.randn(4, 2)); start.save(1)
        >>> kept = norm.running_mean.clone(); _ = norm(torch.randn(4, 2))
        >>> start.restore(1); norm.running_mean.equal(kept)
        True
    """

    def __init__(self, blocks: Sequence[Sequence[torch.Tensor]],
                 modules: Sequence[nn.Module]) -> None:
        self.live = [t for block in blocks for t in block]
        self.native = {id(b) for m in modules for sub in m.modules()
                       if isinstance(sub, _NormBase) for b in sub.buffers(recurse=False)}
        self.kept: list[torch.Tensor] | None = None  # made at the call's first step
        self.versions: list[int] | None = None  # each buffer's version as that step began
        # From the second step: (copies, buffers) of one device and dtype each, one
        # ``_foreach_copy_`` apiece (a list across devices would copy tensor by tensor).
        self.groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self.step = -1  # the optimizer steps completed when the copies were taken

    def save(self, step: int) -> None:
        """Keep the buffers as the step after ``step`` completed ones begins."""
        if self.kept is None:  # the call's first step: every buffer, copied once
            self.versions = [t._version for t in self.live]
            self.kept = [t.detach().clone() for t in self.live]
        else:
            if self.versions is not None:
                self._narrow(self.versions, self.kept)
            for kept, live in self.groups:
                torch._foreach_copy_(kept, live)
        self.step = step

    def _narrow(self, versions: list[int], kept: list[torch.Tensor]) -> None:
        """At the second step: keep only the normalization statistics and the buffers the
        first step wrote to, grouped by device and dtype."""
        keep = [i for i, (t, v) in enumerate(zip(self.live, versions))
                if id(t) in self.native or t._version != v]
        self.live, self.kept = [self.live[i] for i in keep], [kept[i] for i in keep]
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor],
                                                             list[torch.Tensor]]] = {}
        for kept_copy, t in zip(self.kept, self.live):
            group = groups.setdefault((t.device, t.dtype), ([], []))
            group[0].append(kept_copy)
            group[1].append(t)
        self.groups, self.versions = list(groups.values()), None

    def restore(self, step: int) -> None:
        """Put the buffers back if a step began after ``step`` completed ones (a step that
        completed since leaves them)."""
        if self.step == step and self.kept:
            with torch.no_grad():
                torch._foreach_copy_(self.live, self.kept)


class CallStart:
    """What a call that fails before its first optimizer step must leave as it found: the
    run's position and flags (``fit`` resets them when it starts), the optimizer's
    hyperparameters (a callback's ``on_epoch_begin`` sets the rate) and the user's training
    source. Kept once per call; the buffers the failed first forward moved are
    ``StepStart``'s, and the weights need no copy (no step, no change to them)."""

    def __init__(self, run: RunState, compiled: Compiled | None, plan: CallPlan) -> None:
        self.run = dataclasses.replace(run)
        self._live_run = run
        training = isinstance(plan, FitPlan)
        optimizer = compiled.optimizer if training and compiled is not None else None
        self.groups = [] if optimizer is None else [
            (group, {k: copy.copy(v) for k, v in group.items() if k != "params"})
            for group in optimizer.param_groups]
        self.source = plan.source if training and plan.user_source else None
        self.position = self.source.state_dict() if self.source is not None else None

    def restore(self) -> None:
        for field in dataclasses.fields(self.run):
            setattr(self._live_run, field.name, getattr(self.run, field.name))
        for group, values in self.groups:
            group.update(values)
        if self.source is not None and self.position is not None:
            self.source.load_state_dict(self.position)
