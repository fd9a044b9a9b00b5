"""One replica on one device: its module, its input buffers, its outputs and loss.

The loss of a slice goes through one bound callable, ``compute(executor, training) ->
(loss, outputs)`` (``Compute``): it runs the replica on the executor's staged slice
(``Executor.run``) and returns the slice's mean loss (or None) with the outputs. The default
is ``ModuleLoss``: forward, then compile's loss on the valid (not padding) rows, with the
slice's sample weights. A custom training step or a loss that says what it averages over
replaces it without touching the per-replica routine (``fitdp.executor.step``); the executor
then weighs the loss by the slice's share (``fitdp.executor.weighing``) and keeps it for the
logs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch import nn

from fitdp.checks import first_line, reworded
from fitdp.data.batch import (
    Axes,
    axis_of,
    batch_length,
    output_axes,
    take_rows,
    tree_leaves,
    tree_map,
    tree_names,
)
from fitdp.executor.checks import check_loss
from fitdp.executor.compile_config import (
    COMPILE_LOCK,
    LIMIT_MARGIN,
    CompileConfig,
    compile_replica,
    raise_recompile_limit,
)
from fitdp.executor.engine import empty_share
from fitdp.executor.weighing import weighted

# (outputs, targets) -> scalar mean loss; called (outputs, targets, sample_weight) when the
# batch carries per-sample weights.
LossFn = Callable[..., torch.Tensor]
# (executor, training) -> (the slice's mean loss or None, outputs); see the module docstring
# (a custom step: ``fitdp.call.custom_step``).
Compute = Callable[["Executor", bool], tuple["torch.Tensor | None", Any]]
_NULL = contextlib.nullcontext()  # reusable: entering it has no state

def call_module(fn: Callable[..., Any], inputs: Any, kwargs: Mapping[str, Any] | None = None
                ) -> Any:
    """Call ``fn`` with a tensor, ``*tuple`` or ``**dict`` of inputs (and ``kwargs``)."""
    kwargs = kwargs or {}
    if isinstance(inputs, torch.Tensor):  # (asked first: Mapping's check is an ABC's)
        return fn(inputs, **kwargs)
    if isinstance(inputs, Mapping):
        return fn(**inputs, **kwargs)
    if isinstance(inputs, (tuple, list)):
        return fn(*inputs, **kwargs)
    return fn(inputs, **kwargs)


def per_row_outputs(outputs: Any) -> Any:
    """A module's dict of outputs (a Hugging Face ``ModelOutput``) as a plain dict of its
    per-row tensor fields: scalars (the loss) and what is not a tensor (a ``DynamicCache``)
    cannot be sliced into rows, joined over batches or read by metrics, so they are dropped.
    Other outputs are returned as they are."""
    if not isinstance(outputs, Mapping):
        return outputs
    return {k: v for k, v in outputs.items() if _rows_of(v)}


def _rows_of(value: Any) -> bool:
    """A tensor with a batch axis, or a tuple/list of them (hidden states per layer)."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_rows_of(v) for v in value)
    return isinstance(value, Mapping) and bool(value) and all(_rows_of(v) for v in value.values())


class Executor:
    """One replica of the module on one device (MXNet's bound executor).

    The executor owns the replica, stages its slice of every batch in input buffers that it
    shares with the other buckets' executors on the same device (``shared_buffers``), runs
    forward and backward, and keeps a running sum of its weighted loss on the device.

    Args:
        module: the replica, already on ``device``.
        device: where it runs.
        shared_buffers: name -> (flat buffer, shape it was allocated for); one dict per
            device, shared by every bucket's executor on that device.
        compile: wrap the replica with ``torch.compile`` (a string: its ``mode``).
        compile_config: the caller's compile settings, set on this thread to compile.
        warn_on_grow: record in ``grown`` each input that outgrows its shared buffer, for the
            group to log the seed's warning (bucketing: the default bucket should be the
            largest).

    Example:
        >>> ex = Executor(nn.Linear(3, 2), torch.device("cpu"), {})
        >>> ex.load(torch.ones(4, 3), None, valid=4)
        >>> ex.forward(is_train=False).shape
        torch.Size([4, 2])
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        shared_buffers: dict[str, tuple[torch.Tensor, tuple[int, ...]]],
        *,
        compile: bool | str = False,
        warn_on_grow: bool = False,
        inputs_need_grad: bool = False,
        compile_config: CompileConfig | None = None,
    ) -> None:
        self.module = module
        self.compile_config = compile_config  # the caller's settings, for this thread
        self.warn_on_grow = warn_on_grow
        self.device = device
        self.shared_buffers = shared_buffers
        self.fn: Callable[..., Any] = (
            compile_replica(module, f"fitdp_executor_{device.type}",
                            compile if isinstance(compile, str) else None)
            if compile else module
        )
        self.compiled = bool(compile)
        self.weight: float | torch.Tensor = 1.0  # this slice's share (a custom step reads it)
        # The module an empty share still runs for the step's collectives (set by the
        # engine's ``bind``: DDP's wrapper, FSDP2's sharded module; see executor.engine)
        self.ranked: nn.Module | None = None
        self.inputs_need_grad = inputs_need_grad
        # The replica runs as called on the staged inputs (``module_outputs`` adds nothing:
        # no compiled graphs to count, no input gradients to track).
        self.plain = not compile and not inputs_need_grad
        self.grad_inputs: Any = None  # the inputs autograd tracked (inputs_need_grad)
        self.signatures: set[Hashable] = set()  # input signatures compiled so far
        self.grown: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.inputs: Any = None
        self.labels: Any = None
        self.weights: torch.Tensor | None = None
        self.rows = 0
        self.valid = 0
        self.axis = 0
        self.outputs: Any = None
        # The class of the module's last dict of outputs (a ModelOutput), which ``outputs``
        # holds as a plain dict: predict gives its rows back in it.
        self.output_type: type | None = None
        self.loss: torch.Tensor | None = None
        self._autocast: torch.dtype | None = None  # this forward's (a compiled graph's key)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_count = torch.zeros((), dtype=torch.float64, device=device)
        # Each step's detached loss and count, folded into the sums at the next log point:
        # no host sync per step, on any device.
        self.pending_losses: list[tuple[torch.Tensor, int | torch.Tensor]] = []

    def _buffer(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A view of the shared input buffer shaped like ``src``, re-allocated when too small."""
        numel = src.numel()
        buf, shape = self.shared_buffers.get(name, (None, ()))
        if buf is None or buf.dtype != src.dtype or buf.numel() < numel:
            if self.warn_on_grow and buf is not None and buf.dtype == src.dtype:
                # The group logs the seed's warning once for all its devices (``grown``).
                self.grown.append((name, tuple(src.shape), shape))
            buf = self._allocate(name, src)
            self.shared_buffers[name] = (buf, tuple(src.shape))
        return buf[:numel].view(src.shape)

    def _allocate(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A new flat buffer for ``src``; a size the device cannot hold is named (the
        allocator's own error says only the bytes)."""
        try:
            return torch.empty(src.numel(), dtype=src.dtype, device=self.device)
        except (RuntimeError, MemoryError) as err:
            size = src.numel() * src.element_size()
            raise reworded(err, f"input {name!r}: a buffer of shape {tuple(src.shape)} "
                           f"{src.dtype} ({size / 1e9:,.1f} GB) cannot be allocated on "
                           f"{self.device} ({first_line(err)}). Fix: a smaller batch_size "
                           f"or bucket (the shape given to reserve or loaded).") from err

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Allocate the input buffer ``name`` for ``shape`` up front (the largest bucket)."""
        self._buffer(name, torch.empty(shape, dtype=dtype, device="meta"))
        self.grown.clear()  # asked for, not a bucket outgrowing its buffer: no warning

    def load(self, data: Any, label: Any, valid: int, weight: torch.Tensor | None = None,
             axis: int = 0, rows: int | None = None) -> None:
        """Copy this device's slice of the batch (and its per-sample loss weights, if any)
        into the input buffers (non-blocking); ``axis`` is the batch axis, ``rows`` the
        slice's rows when the caller knows them (else read from the inputs)."""
        self.inputs = self._stage(data, "data")
        self.labels = None if label is None else self._stage(label, "label")
        self.weights = None if weight is None else self._stage(weight, "weight")
        self.axis, self.valid = axis, valid
        if rows is None:
            inputs = self.inputs
            if isinstance(inputs, torch.Tensor):
                rows = int(inputs.shape[axis_of(inputs, axis)]) if inputs.dim() else 1
            else:
                rows = batch_length(inputs, axis) if tree_leaves(inputs) else 0
        self.rows = rows

    def _stage(self, tree: Any, prefix: str) -> Any:
        """``tree`` on this device: as it is when it is here already and no buckets share
        the input buffers (no copy), else each tensor copied into its shared buffer."""
        if isinstance(tree, torch.Tensor):
            if tree.device == self.device and not self.warn_on_grow:
                return tree
            return self._buffer(prefix, tree).copy_(tree, non_blocking=True)
        if not self.warn_on_grow and all(t.device == self.device for t in tree_leaves(tree)):
            return tree  # (a Hugging Face batch's dict on the CPU, say)
        names = iter(tree_names(tree, prefix))

        def copy(src: torch.Tensor) -> torch.Tensor:
            dst = self._buffer(next(names), src)
            return dst.copy_(src, non_blocking=True)

        return tree_map(copy, tree)

    def forward(
        self,
        is_train: bool,
        compute: Compute | None = None,
        weight: float | torch.Tensor = 1.0,
        autocast_dtype: torch.dtype | None = None,
        count: int | torch.Tensor | None = None,
    ) -> Any:
        """Run ``compute`` (default: the replica alone, no loss) on the slice; keep its
        outputs, and its loss weighted by ``weight`` for backward.

        ``count`` is what the slice's mean loss divides by (``fitdp.executor.weighing``;
        default: its valid rows): the logged loss weighs each slice by it."""
        self.loss = None
        if self.rows == 0:  # a short final batch left this device idle
            self.outputs = None
            if is_train and self.ranked is not None:  # DDP/FSDP2: the step's collectives
                empty_share(self.ranked, self.inputs)
            return None
        compute = compute or _outputs_only
        self._autocast, self.weight = autocast_dtype, weight
        if autocast_dtype is None and torch.is_grad_enabled() is is_train:
            loss, outputs = compute(self, is_train)  # no context to enter
        else:
            autocast = (torch.autocast(self.device.type, dtype=autocast_dtype)
                        if autocast_dtype is not None else _NULL)
            with torch.set_grad_enabled(is_train), autocast:
                loss, outputs = compute(self, is_train)
        if not isinstance(outputs, torch.Tensor):  # a ModelOutput: its per-row tensors
            self.output_type = type(outputs)
            outputs = per_row_outputs(outputs)
        self.outputs = outputs
        if loss is None:
            return outputs
        if not isinstance(loss, torch.Tensor) or loss.dim():
            check_loss(loss)  # a tensor subclass passes; anything else is the user's error
        if count is None:
            count = self.valid
        self.pending_losses.append((loss.detach(), count))
        if len(self.pending_losses) >= 256:  # bound the list between log points
            self.fold_losses()
        self.loss = weighted(loss, weight)
        return outputs

    def module_outputs(self, is_train: bool, kwargs: Mapping[str, Any] | None = None) -> Any:
        """The replica's outputs on the staged inputs (under the caller's grad mode), with
        the keyword arguments ``kwargs`` (``compile(forward_kwargs=...)``)."""
        if self.plain:
            return call_module(self.fn, self.inputs, kwargs)
        return self._call(is_train, self._autocast, kwargs)

    def signature(self, is_train: bool, autocast_dtype: torch.dtype | None) -> Hashable:
        """What a static compiled graph is specialised on: mode and input shapes and dtypes."""
        leaves = tree_leaves(self.inputs)
        return (is_train, autocast_dtype, tuple((tuple(t.shape), t.dtype) for t in leaves))

    def _call(self, is_train: bool, autocast_dtype: torch.dtype | None,
              kwargs: Mapping[str, Any] | None = None) -> Any:
        """Run the replica; with compile, first make room in dynamo's cache for a new shape."""
        first = False
        if self.compiled:
            signature = self.signature(is_train, autocast_dtype)
            first = signature not in self.signatures
            self.signatures.add(signature)
            # Without bucket_module one replica meets every bucket's shapes (and tails): more
            # than dynamo's default limit of 8 graphs, past which it would run eagerly for good.
            raise_recompile_limit(len(self.signatures) + LIMIT_MARGIN)
        inputs = self.inputs
        if self.inputs_need_grad and is_train:
            # Leaves of their own: the staged inputs are views of buffers the next batch
            # reuses, and may be the caller's tensors themselves.
            inputs = tree_map(lambda t: t.detach().requires_grad_() if t.is_floating_point()
                              else t, inputs)
            self.grad_inputs = inputs
        if first:
            with COMPILE_LOCK:  # see COMPILE_LOCK
                if self.compile_config is not None:
                    self.compile_config.apply()  # thread-local since torch 2.12
                return call_module(self.fn, inputs, kwargs)
        return call_module(self.fn, inputs, kwargs)

    def input_grads(self) -> list[torch.Tensor | None]:
        """The gradient of the loss for each input of the last training batch (valid rows;
        None for integer inputs), in ``tree_leaves`` order; needs ``inputs_need_grad``."""
        leaves = tree_leaves(self.grad_inputs)
        return [None if t.grad is None else self.valid_rows(t.grad) for t in leaves]

    def backward(self, scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Backpropagate this replica's weighted loss (gradients accumulate into its buffers).
        A module without trainable parameters makes it a no-op, as in MXNet
        (``test_module_update_no_param``); a loss cut from the graph of a module that has
        them still raises torch's error (it would train nothing)."""
        if self.loss is None or not self.loss.requires_grad and not any(
                p.requires_grad for p in self.module.parameters()):
            self.loss = None
            return
        (self.loss if scale is None else scale(self.loss)).backward()
        self.loss = None
        # Metrics and predict read the outputs without autograd. Kept attached, they would
        # hold this step's graph until this bucket runs again: with 20 buckets, 19 idle graphs
        # (measured: +11 MB peak RSS on the GRU benchmark).
        if self.warn_on_grow:  # bucketed: other groups run in between
            self.outputs = tree_map(lambda t: t.detach(), self.outputs)

    def valid_rows(self, tree: Any) -> Any:
        """The rows of ``tree`` that are not padding."""
        return take_rows(tree, slice(0, self.valid), self.axis)

    def output_axes(self, outputs: Any) -> Axes:
        """Each output's batch axis: the layout's, or 0 for an output of time-major data that
        is batch-first already (``fitdp.data.batch.output_axes``)."""
        return self.axis if self.axis == 0 else output_axes(outputs, self.axis, self.rows,
                                                            self.inputs)

    def valid_outputs(self, outputs: Any) -> Any:
        """The rows of the module's ``outputs`` that are not padding, each on its own batch
        axis."""
        return take_rows(outputs, slice(0, self.valid), self.output_axes(outputs))

    def fold_losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-row losses, rows) so far, as device tensors (no host sync); folds the
        batches' losses kept since the last call into the running sums, in batch order (a
        few ops per log point, not per step)."""
        pending = self.pending_losses
        if pending:
            losses = torch.stack([loss for loss, _ in pending]).double()
            numbers = [n for _, n in pending]
            if all(isinstance(n, int) for n in numbers):  # rows: one copy, staged from the
                counts = torch.tensor(numbers, dtype=torch.float64).to(  # host, no device wait
                    self.device, non_blocking=True)
            else:  # counted targets, on the device already
                counts = torch.stack([torch.as_tensor(n, dtype=torch.float64, device=self.device)
                                      for n in numbers])
            self.loss_sum += (losses * counts).cumsum(0)[-1]  # in order, as one device sums
            self.loss_count += counts.sum()
            self.pending_losses = []
        return self.loss_sum, self.loss_count

    def reset_loss(self) -> None:
        self.loss_sum.zero_()
        self.loss_count.zero_()
        self.pending_losses = []


class ModuleLoss:
    """The default ``Compute``: the replica's forward, then ``loss_fn`` on the valid rows
    (``loss_fn(outputs, targets)``, or ``(outputs, targets, sample_weight)`` when the batch
    carries sample weights). Without labels or ``loss_fn``: the outputs and no loss.

    A ``loss_fn`` with ``loss_of(outputs)`` (``compile(loss=None)``) takes the module's own
    loss from its outputs instead, on the valid rows of the inputs (padding never enters a
    mean the module takes itself; targets ``y`` given apart from the inputs are passed as
    ``labels=``); in evaluation a batch without labels gives no loss.

    Args:
        loss_fn: ``callable(outputs, targets) -> scalar``, the mean over the slice, or None.
        forward_kwargs: keyword arguments of every forward (``compile(forward_kwargs=)``).

    Example:
        >>> ex = Executor(nn.Linear(3, 2), torch.device("cpu"), {})
        >>> ex.load(torch.ones(4, 3), torch.zeros(4, dtype=torch.long), valid=4)
        >>> loss, out = ModuleLoss(nn.functional.cross_entropy)(ex, True)
        >>> loss.dim(), out.shape
        (0, torch.Size([4, 2]))
    """

    def __init__(self, loss_fn: LossFn | None,
                 forward_kwargs: Mapping[str, Any] | None = None) -> None:
        self.loss_fn = loss_fn
        # What a slice's mean divides by when it is not the rows (see ``job.weigh``).
        self.counts = getattr(loss_fn, "counts", None)
        # The loss without sample weights (a compiled ``Objective`` of one loss: that loss's
        # own function).
        self.unweighted = getattr(loss_fn, "unweighted", loss_fn)
        self.own: Callable[[Any], torch.Tensor] | None = getattr(loss_fn, "loss_of", None)
        self.kwargs = dict(forward_kwargs or {})

    def __call__(self, ex: Executor, training: bool) -> tuple[torch.Tensor | None, Any]:
        if self.own is not None:
            return self._own_loss(ex, training)
        # ``module_outputs``'s own plain branch, taken here without the extra call: this
        # is every step's default compute.
        outputs = call_module(ex.fn, ex.inputs, self.kwargs) if ex.plain else \
            ex.module_outputs(training, self.kwargs)
        lab = ex.labels
        if lab is None or ex.valid == 0 or self.loss_fn is None:
            return None, outputs
        w = ex.weights
        if ex.valid < ex.rows:
            out, lab = ex.valid_outputs(outputs), ex.valid_rows(lab)
            w = None if w is None else w[: ex.valid]
        else:
            out = outputs
        if w is None:
            return self.unweighted(out, lab), outputs  # type: ignore[misc]
        return self.loss_fn(out, lab, w), outputs

    def _own_loss(self, ex: Executor, training: bool) -> tuple[torch.Tensor | None, Any]:
        """The module's own loss (``compile(loss=None)``) and its per-row outputs."""
        if ex.valid < ex.rows:  # padding rows would enter the module's own mean
            ex.inputs, ex.labels = ex.valid_rows(ex.inputs), ex.valid_rows(ex.labels)
            ex.rows = ex.valid
        kwargs = self.kwargs
        if ex.labels is not None:  # y given apart from the inputs (a BucketIterator's)
            kwargs = {**kwargs, "labels": ex.labels}
        outputs = ex.module_outputs(training, kwargs)
        lossless = (outputs.get("loss") if isinstance(outputs, Mapping) else getattr(
            outputs, "loss", None)) is None
        loss = None if lossless and not training else self.own(outputs)  # type: ignore[misc]
        return loss, outputs


def _outputs_only(ex: Executor, training: bool) -> tuple[None, Any]:
    return None, ex.module_outputs(training)
