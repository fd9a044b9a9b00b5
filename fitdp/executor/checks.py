"""Argument checks of the public executor layer, in the Model layer's message form.

``fitdp.executor`` is usable on its own (MXNet's ``executor_manager`` was), so each public
method of the manager and ``split_input_slice`` checks its arguments here, first thing, and
raises ``<argument>: got ...; expected .... Fix: ...`` before anything changes. Each check is a
few ``isinstance`` tests or one pass over the names; none touches tensor data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fitdp.checks import check_int, fail
from fitdp.data.batch import DataBatch


def check_module(module: Any) -> None:
    """``module`` is an ``nn.Module``."""
    if not isinstance(module, nn.Module):
        fail("module", module, "a torch.nn.Module (the network to run data-parallel)",
             "pass the network itself, e.g. nn.Linear(4, 2)", error=TypeError)


def check_bucket_module(bucket_module: Any) -> None:
    """``bucket_module`` is None or a ``callable(bucket_key) -> nn.Module``."""
    if bucket_module is not None and not callable(bucket_module):
        fail("bucket_module", bucket_module, "a callable(bucket_key) -> nn.Module (MXNet's "
             "sym_gen), or None", "pass a function, e.g. lambda key: Net(seq_len=key)",
             error=TypeError)


def check_batch(data_batch: Any) -> None:
    """``data_batch`` is a ``DataBatch``."""
    if not isinstance(data_batch, DataBatch):
        fail("data_batch", f"a {type(data_batch).__name__}", "a fitdp.data.batch.DataBatch",
             "wrap the tensors: DataBatch(x, y)", error=TypeError, described=True)


def check_monitor(monitor: Any) -> None:
    """``monitor`` can be installed (a ``fitdp.Monitor`` or anything with ``install``)."""
    if not callable(getattr(monitor, "install", None)):
        fail("monitor", monitor, "a fitdp.Monitor (an object with install(module, prefix, "
             "params))", "pass fitdp.Monitor(interval=...)", error=TypeError)


def check_metric(metric: Any) -> None:
    """``metric`` is a torchmetrics-like metric or a ``fitdp.compiled.metrics.DeviceMetrics``."""
    if not (hasattr(metric, "clones") or callable(getattr(metric, "update", None))):
        fail("metric", metric, "a torchmetrics Metric or a fitdp.compiled.metrics.DeviceMetrics",
             "pass e.g. torchmetrics.classification.MulticlassAccuracy(num_classes=10)",
             error=TypeError)


def check_named(
    method: str, arg: str, given: Any, names: Sequence[str],
    arrays: Sequence[Sequence[torch.Tensor]],
) -> None:
    """``given`` maps known names to tensors shaped like the replicas' (``[name][device]``
    ``arrays``). Run for both mappings before ``set_params`` copies anything: it is atomic.

    Raises:
        TypeError: not a mapping, or a value that is not a tensor.
        ValueError: an unknown name or a wrong shape, naming it.
    """
    where = f"{method}({arg}=...)"
    if not isinstance(given, Mapping):
        fail(where, given, "a mapping of names to tensors, e.g. dict(module.named_parameters())",
             "pass {} to leave them as they are", error=TypeError)
    unknown = sorted(set(given) - set(names))
    if unknown:
        fail(where, f"unknown names {unknown}", f"names of the module: {sorted(names)}",
             "leave out the names the module does not have", described=True)
    for name, block in zip(names, arrays):
        if name not in given:
            continue
        value = given[name]
        if not isinstance(value, torch.Tensor):
            fail(f"{where}[{name!r}]", value, "a tensor", error=TypeError)
        if value.shape != block[0].shape:
            fail(f"{where}[{name!r}]", f"shape {list(value.shape)}",
                 f"shape {list(block[0].shape)} (the module's {name})",
                 f"pass a tensor of shape {list(block[0].shape)}", described=True)


def check_split(batch_size: Any, work_load_list: Any) -> None:
    """``batch_size`` is an int >= 1 and ``work_load_list`` a non-empty list (its entries are
    checked by ``check_work_load_list``)."""
    check_int("batch_size", batch_size, 1, fix="pass the number of rows in the batch")
    if isinstance(work_load_list, (str, bytes)) or not isinstance(work_load_list, Sequence):
        fail("work_load_list", work_load_list, "a list of positive numbers, one per device",
             "pass e.g. [1, 1] for two equal devices", error=TypeError)
    if not work_load_list:
        fail("work_load_list", work_load_list, "at least one positive number (one per device)",
             "pass e.g. [1, 1] for two equal devices")


def check_loss(loss: Any) -> None:
    """A slice's loss must be a scalar tensor (the mean over the slice)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
        raise ValueError(
            f"loss: the loss function returned {shape}; expected a scalar tensor "
            f"(the mean over the batch). Fix: reduce with .mean() or use "
            f"reduction='mean'."
        )
