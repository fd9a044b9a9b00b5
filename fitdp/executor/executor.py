"""One replica on one device: its module, its input buffers, its outputs and loss."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fitdp.batch import tree_leaves, tree_map, tree_names

LossFn = Callable[[Any, Any], torch.Tensor]


def call_module(fn: Callable[..., Any], inputs: Any) -> Any:
    """Call ``fn`` with a tensor, ``*tuple`` or ``**dict`` of inputs."""
    if isinstance(inputs, dict):
        return fn(**inputs)
    if isinstance(inputs, (tuple, list)):
        return fn(*inputs)
    return fn(inputs)


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
        compile: wrap the replica with ``torch.compile``.
        warn_on_grow: log the seed's warning when a batch outgrows the input buffers
            (bucketing: the default bucket should be the largest).
        logger: where the re-allocation warning goes.

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
        compile: bool = False,
        warn_on_grow: bool = False,
        logger: logging.Logger | None = None,
    ) -> None:
        self.module = module
        self.warn_on_grow = warn_on_grow
        self.device = device
        self.shared_buffers = shared_buffers
        self.logger = logger or logging.getLogger("fitdp")
        self.fn: Callable[..., Any] = torch.compile(module, dynamic=False) if compile else module
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.inputs: Any = None
        self.labels: Any = None
        self.rows = 0
        self.valid = 0
        self.outputs: Any = None
        self.loss: torch.Tensor | None = None
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_count = 0

    def stream_context(self) -> contextlib.AbstractContextManager[Any]:
        """Run on this executor's CUDA stream (a no-op on the CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _buffer(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A view of the shared input buffer shaped like ``src``, re-allocated when too small."""
        numel = src.numel()
        buf, shape = self.shared_buffers.get(name, (None, ()))
        if buf is None or buf.dtype != src.dtype or buf.numel() < numel:
            if self.warn_on_grow and buf is not None and buf.dtype == src.dtype:
                self.logger.warning(
                    'bucketing: data "%s" has a shape %s, which is larger than already allocated '
                    "shape %s. Need to re-allocate. Consider putting default_bucket_key to be "
                    "the bucket taking the largest input for better memory sharing.",
                    name, tuple(src.shape), shape,
                )
            buf = torch.empty(numel, dtype=src.dtype, device=self.device)
            self.shared_buffers[name] = (buf, tuple(src.shape))
        return buf[:numel].view(src.shape)

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Allocate the input buffer ``name`` for ``shape`` up front (the largest bucket)."""
        self._buffer(name, torch.empty(shape, dtype=dtype, device="meta"))

    def load(self, data: Any, label: Any, valid: int) -> None:
        """Copy this device's slice of the batch into the input buffers (non-blocking)."""
        with self.stream_context():
            self.inputs = self._stage(data, "data")
            self.labels = None if label is None else self._stage(label, "label")
        self.rows = _rows(self.inputs)
        self.valid = valid

    def _stage(self, tree: Any, prefix: str) -> Any:
        names = iter(tree_names(tree, prefix))

        def copy(src: torch.Tensor) -> torch.Tensor:
            dst = self._buffer(next(names), src)
            return dst.copy_(src, non_blocking=True)

        return tree_map(copy, tree)

    def forward(
        self,
        is_train: bool,
        loss_fn: LossFn | None = None,
        weight: float = 1.0,
        autocast_dtype: torch.dtype | None = None,
    ) -> Any:
        """Run the replica on its slice; with labels and ``loss_fn``, compute the weighted loss."""
        autocast = (
            torch.autocast(self.device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        self.outputs, self.loss = None, None
        if self.rows == 0:  # a short final batch left this device idle
            return None
        with self.stream_context(), torch.set_grad_enabled(is_train), autocast:
            outputs = call_module(self.fn, self.inputs)
            self.outputs = outputs
            if loss_fn is not None and self.labels is not None and self.valid > 0:
                out, lab = outputs, self.labels
                if self.valid < _rows(lab):
                    out, lab = self.valid_rows(outputs), self.valid_rows(lab)
                loss = loss_fn(out, lab)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                    raise ValueError(
                        f"loss: the loss function returned {shape}; expected a scalar tensor "
                        f"(the mean over the batch). Fix: reduce with .mean() or use "
                        f"reduction='mean'."
                    )
                self.loss_sum.add_(loss.detach(), alpha=self.valid)
                self.loss_count += self.valid
                self.loss = loss if weight == 1.0 else loss * weight
        return outputs

    def backward(self, scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Backpropagate this replica's weighted loss (gradients accumulate into its buffers)."""
        if self.loss is None:
            return
        with self.stream_context():
            (self.loss if scale is None else scale(self.loss)).backward()
        self.loss = None

    def valid_rows(self, tree: Any) -> Any:
        """The rows of ``tree`` that are not padding."""
        n = self.valid
        return tree_map(lambda t: t[:n], tree)

    def reset_loss(self) -> None:
        self.loss_sum.zero_()
        self.loss_count = 0


def _rows(tree: Any) -> int:
    leaves = tree_leaves(tree)
    return int(leaves[0].shape[0]) if leaves else 0
