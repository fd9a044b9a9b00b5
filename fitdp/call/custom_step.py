"""A ``fitdp.Model`` subclass's own step (Keras 3's ``train_step`` / ``test_step`` /
``predict_step`` / ``compute_loss``), run per device slice on that device's replica.

``CustomStep`` is the executor's ``compute`` (``compute(executor, training) -> (loss,
outputs)``, ``fitdp.executor.replica``): on each device thread it sets the replica the step
runs on (``fitdp.call.gather.running``: ``self(x)``, ``self.module`` and ``all_gather``
read it), hands the slice to the model's step as Keras's ``data`` and returns the step's loss
for fitdp to weigh, backpropagate, reduce and step, as it does the built-in loss. It is made
only for a subclass that overrides a step: a model that overrides nothing keeps the built-in
path and its speed.
"""

from __future__ import annotations

from typing import Any

import torch

from fitdp.call.gather import Meeting, ReplicaContext, running
from fitdp.checks import fail
from fitdp.executor.weighing import weighted

STEPS = ("train_step", "test_step", "predict_step", "compute_loss")


def overridden(model: Any, base: type) -> bool:
    """Whether ``model``'s class overrides one of Keras's steps of ``base``."""
    return any(getattr(type(model), name) is not getattr(base, name) for name in STEPS)


def step_data(x: Any, y: Any, sample_weight: Any) -> tuple[Any, ...]:
    """Keras's ``data``: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``."""
    if sample_weight is not None:
        return x, y, sample_weight
    return (x,) if y is None else (x, y)


class CustomStep:
    """The executor's ``compute`` for a model that overrides a step (module docstring).

    Args:
        model: the ``fitdp.Model`` subclass.
        devices: the replicas' devices, in order.
        ranks: other ranks take part (torchrun).

    Attributes:
        predicting: set by ``predict``'s pass: forward runs ``predict_step``.
        meeting: where the replica threads meet (``all_gather``, ``optimizer_step``).
    """

    takes_turns = True  # replicas that meet mid-step take turns here (``Meeting.take_turn``)

    def __init__(self, model: Any, devices: list[torch.device], ranks: bool) -> None:
        self.model = model
        self.devices = devices
        self.ranks = ranks
        self.meeting = Meeting(devices) if len(devices) > 1 else None
        self.predicting = False
        self.manual = False  # several optimizers, stepped by train_step (set by Replicas)
        self._index: dict[int, tuple[int, Any]] = {}  # id(executor) -> (device, its job)
        # What a slice's loss means over when declared: compile(loss=None, loss_items=...)
        # or a loss with counts such as TokenMean (``fitdp.executor.weighing`` weighs the
        # slices by it, as on the built-in path); None: rows.
        self.counts: Any = None
        self.manager: Any = None
        self.compiled: Any = None
        # Per device: log key -> (sum of value * rows, rows) of extra logs a step returned.
        self._logs: list[dict[str, list[Any]]] = [{} for _ in devices]

    def bind(self, manager: Any, compiled: Any) -> None:
        """The executor manager the step runs in (a device's index is its executor's place
        in its group; ``optimizer_step`` reduces and steps through its ``Update``) and the
        compiled setup (``Compiled``, or None): with several optimizers ``train_step``
        steps them (``Compiled.manual``), under its scaler and clipping."""
        self.manager, self.compiled = manager, compiled
        self.manual = compiled is not None and compiled.manual
        # Slice weights never come from a loss the step may not call: only from what is
        # declared (compile's loss_items, or a loss with counts such as TokenMean).
        self.counts = compiled.objective.declared_counts if compiled is not None else None

    def _device_index(self, ex: Any) -> tuple[int, Any]:
        index = self._index.get(id(ex))
        if index is None:
            for group in self.manager.groups.values():
                for d, e in enumerate(group.executors):
                    self._index[id(e)] = (d, group.job)
            index = self._index[id(ex)]
        return index

    def __call__(self, ex: Any, training: bool) -> tuple[torch.Tensor | None, Any]:
        d, job = self._device_index(ex)
        model, meeting = self.model, self.meeting
        rows = ex.valid
        x = ex.valid_rows(ex.inputs)
        y = None if ex.labels is None else ex.valid_rows(ex.labels)
        w = None if ex.weights is None else ex.weights[:rows]
        turn = False
        if meeting is not None:
            # A replica a short batch gives no rows never runs its step (nor meets).
            meeting.expect([i for i, sl in enumerate(job.slices) if sl.stop > sl.start])
            turn = training and job.step_turns  # replicas sharing a generator that draw
        context = ReplicaContext(ex.module, ex.device, d, meeting,
                                 getattr(ex, "weight", 1.0), self.ranks, owner=model,
                                 fn=ex.fn, step=self, in_turn=turn)
        try:
            if turn:
                meeting.take_turn(d)  # type: ignore[union-attr]
            with running(context):
                if self.predicting:
                    return None, model.predict_step(step_data(x, None, None))
                data = step_data(x, y, w)
                result = model.train_step(data) if training else model.test_step(data)
        except BaseException as err:
            if meeting is not None:
                meeting.fail(err)
            raise
        finally:
            if turn:
                context.in_turn = False  # its backward (fitdp's, after the step) meets at once
                meeting.end_turn(d)  # type: ignore[union-attr]
        loss = self._loss_of(result, d, rows, training)
        return loss, context.outputs

    def _loss_of(self, result: Any, d: int, rows: int, training: bool
                 ) -> torch.Tensor | None:
        """The step's loss (backpropagated by fitdp) from what it returned; the other logs
        of a dict are kept per device, weighed by the slice's rows."""
        what = "train_step" if training else "test_step"
        manual = training and self.manual
        if isinstance(result, torch.Tensor) and not manual:
            return result
        if isinstance(result, torch.Tensor):
            result = {"loss": result}
        if result is None and not training:
            return None
        if not isinstance(result, dict):
            fail(what, f"a return value of type {type(result).__name__}",
                 "the loss (a scalar tensor) or a dict of logs (holding 'loss' for fitdp to "
                 "backpropagate)", "return loss, or {'loss': loss, ...}", error=TypeError,
                 described=True)
        if training and not manual and "loss" not in result:
            # Else the epoch would run with no backward and no weight would move.
            fail(what, f"a dict with keys {sorted(map(str, result))}", "a dict holding "
                 "'loss' (the tensor fitdp backpropagates)", "return {'loss': loss, ...}",
                 described=True)
        logs = self._logs[d]
        for key, value in result.items():
            if key == "loss" and not manual:
                continue
            # Kept on the value's device until a log point reads it: no host sync per step.
            number = value.detach() if isinstance(value, torch.Tensor) else float(value)
            acc = logs.setdefault(key, [0.0, 0])
            acc[0] = acc[0] + number * rows
            acc[1] += rows
        loss = result.get("loss")
        if loss is None or manual:  # a manual step (``optimizer_step``) used its losses
            return None
        if not isinstance(loss, torch.Tensor):
            fail(f"{what}()['loss']", type(loss).__name__, "a scalar tensor",
                 "return the tensor compute_loss gave", error=TypeError)
        return loss

    def update(self, optimizer: torch.optim.Optimizer) -> Any:
        """The executor's ``Update`` for ``optimizer`` (``manager.manual_update``), under the
        compiled scaler (16-mixed) and ``grad_clip_norm``."""
        compiled = self.compiled
        clip = compiled.config.grad_clip_norm if compiled is not None else None
        scaler = compiled.scaler if compiled is not None else None
        return self.manager.manual_update(optimizer, scaler=scaler, clip_norm=clip)

    def backward(self, context: ReplicaContext, optimizer: torch.optim.Optimizer,
                 loss: torch.Tensor) -> None:
        """One replica's part of ``optimizer_step``: its gradients zeroed, its weighted loss
        (scaled by the 16-mixed ``GradScaler``) backpropagated; then, once every replica
        has, the update (reduce across replicas and ranks, unscale, clip, step,
        broadcast) on the last replica to arrive, before any replica goes on."""
        update = self.update(optimizer)
        update.zero_device(context.index)
        mine = weighted(loss, context.weight)
        scaler = update.scaler
        (mine if scaler is None else scaler.scale(mine)).backward()

        def leader(_: list[Any]) -> list[Any]:
            update.apply()
            return []

        if self.meeting is None:
            leader([])
        else:
            self.meeting.exchange(context.index, None, leader, turn=context.in_turn)

    def logs(self) -> dict[str, list[float]]:
        """Extra logs since the last reset: key -> [sum of value * rows, rows] over devices."""
        merged: dict[str, list[float]] = {}
        for logs in self._logs:
            for key, (total, rows) in logs.items():
                acc = merged.setdefault(key, [0.0, 0.0])
                acc[0] += float(total)  # the log point's read (a host sync on a GPU)
                acc[1] += rows
        return merged

    def reset_logs(self) -> None:
        for logs in self._logs:
            logs.clear()

    def logs_state(self) -> list[dict[str, list[Any]]]:
        """Per device, the extra logs' running ``[sum, rows]`` (copies: a checkpoint's)."""
        return [{key: [total.detach().clone() if isinstance(total, torch.Tensor) else total,
                       rows] for key, (total, rows) in logs.items()} for logs in self._logs]

    def load_logs_state(self, state: list[dict[str, list[Any]]]) -> None:
        """Put ``logs_state`` back (a resume): each device its own sums, bit for bit; those
        of devices beyond these added into the first device's."""
        self.reset_logs()
        for d, saved in enumerate(state):
            mine = d < len(self._logs)
            logs, device = (self._logs[d], self.devices[d]) if mine else (self._logs[0],
                                                                        self.devices[0])
            for key, (total, rows) in saved.items():
                value = total.to(device) if isinstance(total, torch.Tensor) else total
                acc = logs.setdefault(key, [0.0, 0])
                acc[0] = value if mine else acc[0] + value
                acc[1] += rows


def step_context(what: str) -> ReplicaContext:
    """The context of the step this thread runs, or a clear error outside one."""
    from fitdp.call.gather import current

    context = current()
    if context is None:
        raise RuntimeError(f"{what}: called outside a step; call it inside train_step "
                           f"(fitdp runs the step on every device's replica)")
    return context


__all__ = ["CustomStep", "overridden", "step_context", "step_data"]
