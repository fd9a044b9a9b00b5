"""``make_source``: every form ``fit``/``evaluate``/``predict`` accept, as one ``DataSource``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from fitdp.checks import check_number, fail
from fitdp.data.batch import DataBatch, batch_length
from fitdp.data.sources.convert import as_tensors, check_finite, check_rows
from fitdp.data.sources.loaders import EpochSampler, LoaderSource
from fitdp.data.sources.protocol import DataSource
from fitdp.data.sources.sharded import ShardedSource
from fitdp.data.sources.tensors import TensorSource


def make_source(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    has_labels: bool = True,
    labels_optional: bool = False,
    class_weight: Mapping[int, float] | None = None,
    rank: int = 0,
    world_size: int = 1,
    name: str = "x",
    pin_memory: bool = False,
) -> DataSource:
    """Turn what a user passed to fit/evaluate/predict into a data source (this rank's share
    of it under torch.distributed).

    Args:
        x: tensors/arrays (with ``y``), an ``(x, y)`` or ``(x, y, sample_weight)`` tuple, a
            ``Dataset``, a ``DataLoader``, an iterable of batches, a generator, or an object
            with the ``DataSource`` interface (e.g. a ``BucketIterator``).
        y: targets for in-memory ``x``.
        sample_weight: per-sample loss weights for in-memory ``x``.
        batch_size, shuffle, seed: batching of in-memory data and Datasets (an
            ``IterableDataset`` is batched by ``batch_size`` in its own order: shuffle and
            seed are its own business, as in Keras for generators).
        has_labels: False for predict (targets are not needed).
        labels_optional: in-memory ``x`` may come without ``y``, and batches may be dicts of
            inputs alone (a model with its own step, or ``compile(loss=None)``: a Hugging
            Face batch holds its labels); an ``(x, y)`` tuple is still read as inputs and
            targets.
        class_weight: ``{class index: weight}`` (Keras): each sample weighs its class's weight.
        rank, world_size: this process's place in a torch.distributed job.
        name: what to call ``x`` in messages (``validation_data`` for validation).
        pin_memory: host batches go to CUDA devices: shuffled in-memory epochs are gathered
            into pinned memory, and the ``DataLoader`` made for a ``Dataset`` pins its
            batches (a ``DataLoader`` the user passes is left as it is).

    Raises:
        ValueError: empty data, lengths that differ, targets given twice.
        TypeError: a form fitdp does not accept.
    """
    if x is None:
        fail(name, None, "tensors, a Dataset, a DataLoader or an iterable of batches",
             error=ValueError)
    source = _batch_source(x, y, sample_weight, batch_size, shuffle, seed,
                           has_labels, labels_optional, name, pin_memory)
    if source is None:
        return _tensor_source(x, y, sample_weight, batch_size, shuffle, seed, has_labels,
                              labels_optional, class_weight, rank, world_size, name, pin_memory)
    if class_weight is not None:
        source = ClassWeighted(source, class_weight)
    return source if world_size == 1 else ShardedSource(source, rank, world_size)


def is_source(obj: Any) -> bool:
    """Whether ``obj`` already has the ``DataSource`` interface."""
    return all(hasattr(obj, a) for a in ("set_epoch", "state_dict", "load_state_dict", "plan",
                                          "num_batches", "__iter__"))


def _batch_source(x: Any, y: Any, w: Any, batch_size: int, shuffle: bool, seed: int,
                  has_labels: bool, labels_optional: bool, name: str, pin_memory: bool
                  ) -> DataSource | None:
    """A source for data that comes in batches (or a Dataset); None for in-memory tensors."""
    if not (is_source(x) or isinstance(x, (DataLoader, Dataset)) or _is_batch_iterable(x)):
        return None
    for arg, value in (("y", y), ("sample_weight", w)):
        if value is not None:
            fail(arg, f"a value together with {name} of type {type(x).__name__}",
                 f"{arg}=None: that {type(x).__name__} yields its own "
                 f"{'targets' if arg == 'y' else 'weights'}", described=True)
    if is_source(x):
        return x  # a source already, e.g. a BucketIterator
    if isinstance(x, IterableDataset):  # a stream: batched in its own order (no sampler)
        return LoaderSource(DataLoader(x, batch_size=batch_size, pin_memory=pin_memory),
                            has_labels=has_labels, labels_optional=labels_optional)
    if isinstance(x, Dataset) and not isinstance(x, DataLoader):
        n = _maybe_len(x)
        if n == 0:
            fail(name, "an empty Dataset", "at least one sample", described=True)
        sampler = EpochSampler(n or 0, seed=seed, shuffle=shuffle)
        return LoaderSource(DataLoader(x, batch_size=batch_size, sampler=sampler,
                                       pin_memory=pin_memory), has_labels=has_labels,
                            labels_optional=labels_optional)
    if _maybe_len(x) == 0:
        fail(name, f"an empty {type(x).__name__}", "at least one batch", described=True)
    return LoaderSource(x, has_labels=has_labels, labels_optional=labels_optional)


def _tensor_source(x: Any, y: Any, w: Any, batch_size: int, shuffle: bool, seed: int,
                   has_labels: bool, labels_optional: bool,
                   class_weight: Mapping[int, float] | None, rank: int, world_size: int,
                   name: str, pin_memory: bool) -> TensorSource:
    if has_labels and y is None and isinstance(x, tuple) and len(x) in (2, 3):  # (x, y[, w])
        x, y, w = (*x, w) if len(x) == 2 else x
    x = as_tensors(x, name)
    n = batch_length(x)
    if n == 0:
        fail(name, "0 samples", "at least one", described=True)
    check_rows(x, name, n, first=f"{name}'s first input")
    if has_labels:  # fit and evaluate (a NaN there trains or scores silently to NaN)
        check_finite(x, name)
    if y is not None:
        y = as_tensors(y, "y")
        check_rows(y, "y", n, first=name)
        check_finite(y, "y" if name == "x" else f"{name} targets")
    elif has_labels and not labels_optional:
        fail("y", None, f"targets for {name}", "pass y=... or x=(inputs, targets)",
             error=ValueError)
    if w is not None:
        w = _weights(as_tensors(w, "sample_weight"), "sample_weight")
        check_rows(w, "sample_weight", n, first=name)
        check_finite(w, "sample_weight")
    if class_weight is not None:
        cw = class_weights(class_weight, y)
        w = cw if w is None else w * cw
    return TensorSource(x, y, batch_size, sample_weight=w, shuffle=shuffle, seed=seed,
                        rank=rank, world_size=world_size, pin_memory=pin_memory)


def class_weights(class_weight: Mapping[int, float], y: Any) -> torch.Tensor:
    """Keras's ``class_weight``: each sample's weight is its class's (1-D integer targets);
    a class without an entry weighs 1, as in Keras.

    Raises:
        TypeError, ValueError: not a dict of int -> number, or targets that are not class
            indices.
    """
    if not isinstance(class_weight, Mapping) or not class_weight:
        fail("class_weight", class_weight, "a non-empty dict {class index: weight}",
             error=TypeError)
    if y is None:  # fit(x) without y (a custom compute_loss): no class to look up
        fail("class_weight", "no targets (fit was given x without y)", "targets y, one "
             "class index per sample, to weigh each sample by its class",
             "pass y=..., or weigh the samples with sample_weight=...", described=True)
    if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.dim() != 1:
        fail("class_weight", "targets that are not a 1-D tensor of class indices",
             "1-D integer targets (one class per sample)", "use sample_weight instead",
             described=True)
    for k, v in class_weight.items():
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            fail("class_weight", k, "class indices (ints >= 0) as keys", error=TypeError)
        check_number(f"class_weight[{k}]", v, low=0)
    top = int(y.max()) + 1 if y.numel() else 0
    table = torch.ones(max(top, max(class_weight) + 1))
    for k, v in class_weight.items():
        table[int(k)] = float(v)
    return table.to(y.device)[y.clamp(min=0)]


def _weights(w: Any, name: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_floating_point():
        fail(name, f"{type(w).__name__} of shape {tuple(getattr(w, 'shape', ()))}",
             "a 1-D float tensor or array, one weight per sample", described=True)
    return w


class ClassWeighted:
    """A batch source whose batches get their class's weight as sample weight."""

    def __init__(self, source: DataSource, class_weight: Mapping[int, float]) -> None:
        self.source, self.class_weight = source, dict(class_weight)

    def __getattr__(self, name: str) -> Any:  # num_batches, plan, set_epoch, state...
        return getattr(self.source, name)

    def __iter__(self) -> Any:
        for batch in self.source:
            w = class_weights(self.class_weight, batch.label)
            if batch.sample_weight is not None:
                w = w * batch.sample_weight
            yield DataBatch(batch.data, batch.label, batch.bucket_key, batch.pad, batch.index,
                            batch.global_rows, w)


def _maybe_len(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def _is_batch_iterable(data: Any) -> bool:
    """An iterable of batches (a list of DataBatch, a generator), not a tensor container."""
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return len(data) > 0 and all(isinstance(b, DataBatch) for b in data)
    if isinstance(data, (str, bytes, torch.Tensor, np.ndarray, Mapping)):
        return False
    return isinstance(data, Iterable)
