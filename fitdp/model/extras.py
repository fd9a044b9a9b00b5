"""The part of ``fitdp.Model`` a Keras user reaches for besides fit/evaluate/predict:
``summary()`` and the one-batch calls ``train_on_batch``/``test_on_batch``/``predict_on_batch``.

The one-batch calls run through the model's call machinery (``Model._call`` with a plan of a
one-batch source), so they share fit's step, checks, rollback and device handling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from fitdp.call.plan import WHOLE, CallPlan, plan_call, plan_fit
from fitdp.call.ranks import DEFAULT_TIMEOUT
from fitdp.checks import check_int, fail
from fitdp.data.batch import DataBatch
from fitdp.executor.devices import DevicesArg
from fitdp.model.summary import summarize, zeros_of

if TYPE_CHECKING:
    from torch import nn

    from fitdp.call.replicas import Replicas
    from fitdp.call.run_state import RunState
    from fitdp.call.session import Session
    from fitdp.compiled.setup import Compiled

KerasLogs = dict[str, float] | list[float] | float


def keras_logs(logs: dict[str, float], compiled: Compiled, return_dict: bool) -> KerasLogs:
    """Keras's return form of evaluate and the ``*_on_batch`` calls: the dict, or the loss
    alone, or ``[loss, *metrics]`` in compile order."""
    if return_dict:
        return logs
    values = [logs[k] for k in ("loss", *compiled.metrics) if k in logs]
    return values[0] if len(values) == 1 else values


class ModelExtras:
    """``summary`` and the one-batch calls for ``fitdp.Model`` (mixed into it).

    Example:
        >>> import torch
        >>> from fitdp import Model
        >>> model = Model(torch.nn.Linear(4, 3))
        >>> model.compile("sgd", "cross_entropy")
        >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        >>> isinstance(model.train_on_batch(x, y), float), model.global_step
        (True, 1)
        >>> tuple(model.predict_on_batch(x).shape)
        (8, 3)
    """

    module: nn.Module
    run: RunState
    _compiled: Compiled | None
    _replicas: Replicas | None

    if TYPE_CHECKING:
        def _call(self, plan: CallPlan, compiled: Compiled | None
                  ) -> AbstractContextManager[Session]: ...

        def _require_compiled(self, what: str) -> Compiled: ...

    def get_compile_config(self) -> dict[str, Any]:
        """What ``compile`` was given, by argument name (Keras's ``get_compile_config``);
        an empty dict before ``compile``. Experiment trackers log it (``MLflowLogger``)."""
        if self._compiled is None:
            return {}
        config = self._compiled.config
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}

    def summary(self, x: Any = None, *, input_shape: Any = None, expand_nested: bool = False,
                show_trainable: bool = False, line_length: int = 80,
                print_fn: Callable[[str], Any] | None = None) -> None:
        """Print a Keras-style table of the module: one row per layer (the
        module's children; every descendant with ``expand_nested``) with its type, output
        shape and parameter count, then the total, trainable and non-trainable counts.

        Output shapes need an example batch: ``x`` (inputs in any form ``predict`` takes:
        a tensor, array, tuple or dict) runs once through the module in eval mode without
        gradients, and each layer's output shape is recorded (shapes include that batch's
        size; a layer called with different shapes shows ``multiple``). Without ``x``, one
        row of ``input_shape`` (zeros) or else of the last ``fit``/``evaluate``'s first
        batch runs instead, and the batch axis shows as ``None`` (Keras's ``(None, 64)``);
        with none of these the shapes show ``?``, as Keras shows them for a model not built
        yet.

        Non-trainable counts are parameters with ``requires_grad=False`` plus floating-point
        buffers (BatchNorm running statistics, non-trainable weights in Keras).

        Args:
            x: an example batch for the output shapes, or None.
            input_shape: one sample's shape without the batch axis (``(784,)``), or a
                tuple/list or dict of those for several inputs (float32 zeros are run;
                pass ``x`` for integer inputs).
            expand_nested: show the layers inside nested modules, indented.
            show_trainable: add a column: ``Y`` trainable, ``N`` frozen, ``-`` no parameters.
            line_length: width of the table in characters.
            print_fn: called once with the text instead of ``print`` (Keras's
                ``print_fn``); ``print_fn=lines.append`` keeps the text. Returns None, as
                Keras's ``summary`` does, so a notebook shows the table once.

        Raises:
            TypeError: ``x`` is not a tensor, array, or tuple/list/dict of them;
                ``input_shape`` is not a shape or a tuple/list/dict of shapes.
        """
        width = check_int("summary(line_length=...)", line_length, 40)
        example, per_sample = x, False
        if x is None:
            example = (zeros_of(input_shape) if input_shape is not None
                       else getattr(self, "example_inputs", None))
            per_sample = example is not None
        text = summarize(self.module, example, expand_nested=expand_nested,
                         show_trainable=show_trainable, line_length=width,
                         per_sample=per_sample)
        (print if print_fn is None else print_fn)(text)

    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Mapping[int, float] | None = None,
                       return_dict: bool = False, *, devices: DevicesArg | None = None
                       ) -> KerasLogs:
        """One optimizer step on one batch (Keras): forward, backward, step.

        Returns the loss and metrics of this batch, computed in the forward pass before the
        step (the metrics restart every call): the loss alone, ``[loss, *metrics]``, or
        with ``return_dict`` a dict. Callbacks do not run; a per-step ``lr_scheduler``
        steps. With ``compile(grad_accum_steps=k)`` the gradients of k calls are summed and
        every k-th call steps, as a Keras optimizer with ``gradient_accumulation_steps``
        does.

        Args:
            x, y: one batch of inputs and targets (any in-memory form ``fit`` takes).
            sample_weight: per-sample loss weights for this batch.
            class_weight: ``{class index: weight}`` (multiplied with ``sample_weight``).
            return_dict: return ``{"loss": ..., <metric>: ...}``.
            devices: where to run; None uses the devices of the model's last call
                (``"auto"`` before any).

        Raises:
            RuntimeError: the model is not compiled.
            ValueError, TypeError: bad data, naming the argument.
        """
        compiled = self._require_compiled("train_on_batch")
        _not_a_data_batch(x)
        place = self._placement(devices)
        plan = plan_fit(
            self, x, y, sample_weight, batch_size=WHOLE, epochs=1, verbose=0, callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=False,
            class_weight=class_weight, initial_epoch=0, steps_per_epoch=None,
            validation_steps=None, validation_batch_size=None, validation_freq=1,
            devices=place[0], work_load_list=place[1], seed=0, monitor=None, resume=None,
            log_every=1, timeout=DEFAULT_TIMEOUT)
        batch = self.run.batch
        with self._call(plan, compiled) as session:
            session.reset_logs()
            session.train_step(next(iter(plan.source)), 0)
            logs = session.read_logs()
        # Keras counts the step (optimizer iterations), not a position in some epoch: a
        # later fit(resume=...) of a checkpoint must not think an epoch is half done.
        self.run.batch = batch
        return keras_logs(logs, compiled, return_dict)

    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                      return_dict: bool = False, *, devices: DevicesArg | None = None
                      ) -> KerasLogs:
        """Loss and metrics of one batch, without training (Keras); the metrics restart
        every call. Same return forms and arguments as ``train_on_batch``."""
        compiled = self._require_compiled("test_on_batch")
        plan = self._one_batch_plan(x, y, sample_weight, devices, has_labels=True)
        with self._call(plan, compiled) as session:
            logs = session.test_pass(plan.source, plan.callbacks, 1)
        return keras_logs(logs, compiled, return_dict)

    def predict_on_batch(self, x: Any, *, devices: DevicesArg | None = None) -> Any:
        """The module's outputs for one batch, on the CPU (Keras; ``predict`` with the whole
        batch as one step). Needs no compile."""
        plan = self._one_batch_plan(x, None, None, devices, has_labels=False)
        with self._call(plan, self._compiled) as session:
            return session.predict_pass(plan.source, plan.callbacks, 1)

    def _one_batch_plan(self, x: Any, y: Any, sample_weight: Any, devices: DevicesArg | None,
                        *, has_labels: bool) -> CallPlan:
        _not_a_data_batch(x)
        return plan_call(self, x, y, sample_weight, batch_size=WHOLE, verbose=0,
                         callbacks=None, steps=None, devices=self._placement(devices)[0],
                         has_labels=has_labels)

    def _placement(self, devices: DevicesArg | None) -> tuple[DevicesArg, Any]:
        """``devices`` and work loads of a one-batch call: as asked, else those of the
        replicas the model already has (no rebuild between calls), else ``"auto"``."""
        if devices is not None:
            return devices, None
        if self._replicas is None:
            return "auto", None
        placement = self._replicas.placement
        return list(placement.devices), list(placement.work_load_list)


def _not_a_data_batch(x: Any) -> None:
    """A one-batch call takes in-memory inputs, not fitdp's own ``DataBatch``.

    Raises:
        TypeError: naming ``x``.
    """
    if isinstance(x, DataBatch) or (isinstance(x, (list, tuple)) and x
                                    and isinstance(x[0], DataBatch)):
        fail("x", "a DataBatch", "in-memory inputs (a tensor, an array, or a tuple/list/dict "
             "of them)", "pass batch.data and batch.label", error=TypeError, described=True)
