"""What a user passed to ``fit``/``evaluate``/``predict``, classified once (``Kind``),
converted once (``read_data``), and made into one ``DataSource`` (``UserData.source``).

Example:
    >>> import torch
    >>> data = read_data(torch.zeros(10, 3), torch.zeros(10))
    >>> data.kind, data.x.shape
    (<Kind.TENSORS: 'in-memory tensors or arrays'>, torch.Size([10, 3]))
    >>> train, val = data.split(0.2)
    >>> train.source(batch_size=4, shuffle=False, seed=0).num_batches, val.x.shape[0]
    (2, 2)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from fitdp.checks import check_number, fail
from fitdp.data.batch import DataBatch, batch_length
from fitdp.data.sources.convert import read_tensors, split_validation
from fitdp.data.sources.loaders import EpochSampler, LoaderSource
from fitdp.data.sources.protocol import DataSource
from fitdp.data.sources.sharded import ShardedSource
from fitdp.data.sources.tensors import TensorSource


class Kind(enum.Enum):
    """What a user's data is, decided once; each kind has one conversion (``UserData.source``).

    Tensors, numpy arrays and tuples/lists/dicts of them (a Hugging Face batch dict) are one
    kind: one conversion (``as_tensors``) reads them all.
    """

    TENSORS = "in-memory tensors or arrays"
    DATASET = "a map-style Dataset"
    STREAM = "an IterableDataset"
    BATCHES = "a DataLoader or another re-iterable object of batches"
    GENERATOR = "a one-shot iterator of batches (a generator)"
    SOURCE = "an object with the DataSource interface"


@dataclasses.dataclass(frozen=True)
class UserData:
    """A user's data after its one classification and conversion.

    Attributes:
        kind: what the data is.
        x: the inputs as tensors (``Kind.TENSORS``), else the user's object as passed.
        y, sample_weight: the targets and per-sample weights as tensors, or None (only
            ``Kind.TENSORS`` has them: other kinds yield their own).
        has_labels: False for predict (targets are not needed).
        labels_optional: batches may hold their own labels (see ``make_source``).
    """

    kind: Kind
    x: Any
    y: Any = None
    sample_weight: Any = None
    has_labels: bool = True
    labels_optional: bool = False

    def split(self, fraction: Any) -> tuple[UserData, UserData]:
        """Keras's ``validation_split``, cut from the converted tensors: the first
        ``floor(n * (1 - fraction))`` samples train, the rest validate (before any shuffle).

        Raises:
            ValueError: data that is not in-memory ``x`` and ``y``, or a split that leaves a
                side empty (naming ``validation_split``).
        """
        if self.kind is not Kind.TENSORS or self.y is None:
            fail("validation_split", fraction, "in-memory x and y (tensors or arrays)",
                 "pass validation_data= for Datasets, DataLoaders and iterators")
        train, val = split_validation(fraction, self.x, self.y, self.sample_weight)
        return (dataclasses.replace(self, x=train[0], y=train[1], sample_weight=train[2]),
                dataclasses.replace(self, x=val[0], y=val[1], sample_weight=val[2]))

    def rows(self) -> int:
        """How many samples in-memory data holds: the batch of a call that takes it whole in
        one step (``train_on_batch`` and the like).

        Raises:
            TypeError: data that is not in memory (naming ``x``).
        """
        if self.kind is not Kind.TENSORS:
            fail("x", self.kind.value, "in-memory inputs (a tensor, an array, or a tuple/list/"
                 "dict of them) for one batch", "pass the batch's tensors",
                 error=TypeError, described=True)
        return batch_length(self.x)  # (of an (x, y) tuple: x's rows)

    def source(self, *, batch_size: int, shuffle: bool, seed: int,
               class_weight: Mapping[int, float] | None = None, rank: int = 0,
               world_size: int = 1, pin_memory: bool = False, rank_unit: int = 1
               ) -> DataSource:
        """The data source of this kind (this rank's share of it under torch.distributed);
        the arguments are ``make_source``'s, and ``rank_unit`` ``TensorSource``'s (other
        sources hand out whole batches per rank already).

        Raises:
            TypeError, ValueError: a bad ``class_weight``.
        """
        if self.kind is Kind.TENSORS:
            w = self.sample_weight
            if class_weight is not None:
                cw = class_weights(class_weight, self.y)
                w = cw if w is None else w * cw
            return TensorSource(self.x, self.y, batch_size, sample_weight=w, shuffle=shuffle,
                                seed=seed, rank=rank, world_size=world_size,
                                pin_memory=pin_memory, rank_unit=rank_unit)
        source: DataSource
        if self.kind is Kind.SOURCE:
            source = self.x  # a source already, e.g. a BucketIterator
        elif self.kind is Kind.STREAM:  # batched in its own order (no sampler)
            source = self._loader(DataLoader(self.x, batch_size=batch_size,
                                             pin_memory=pin_memory))
        elif self.kind is Kind.DATASET:
            sampler = EpochSampler(_maybe_len(self.x) or 0, seed=seed, shuffle=shuffle)
            source = self._loader(DataLoader(self.x, batch_size=batch_size, sampler=sampler,
                                             pin_memory=pin_memory))
        else:  # batches as they come (a DataLoader is used as it is)
            source = self._loader(self.x)
        if class_weight is not None:
            source = ClassWeighted(source, class_weight)
        return source if world_size == 1 else ShardedSource(source, rank, world_size)

    def _loader(self, batches: Iterable[Any]) -> LoaderSource:
        return LoaderSource(batches, has_labels=self.has_labels,
                            labels_optional=self.labels_optional)


def read_data(x: Any, y: Any = None, sample_weight: Any = None, *, has_labels: bool = True,
              labels_optional: bool = False, name: str = "x") -> UserData:
    """Classify what a user passed, once, and convert and check in-memory data, once.

    Args:
        x, y, sample_weight, has_labels, labels_optional, name: as in ``make_source``.

    Raises:
        ValueError: empty data, lengths that differ, targets given twice, a NaN or an
            infinity in in-memory data.
        TypeError: a form fitdp does not accept.
    """
    if x is None:
        fail(name, None, "tensors, a Dataset, a DataLoader or an iterable of batches",
             error=ValueError)
    kind = _kind(x)
    if kind is Kind.TENSORS:
        x, y, sample_weight = read_tensors(x, y, sample_weight, has_labels=has_labels,
                                           labels_optional=labels_optional, name=name)
        return UserData(kind, x, y, sample_weight, has_labels, labels_optional)
    for arg, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            fail(arg, f"a value together with {name} of type {type(x).__name__}",
                 f"{arg}=None: that {type(x).__name__} yields its own "
                 f"{'targets' if arg == 'y' else 'weights'}", described=True)
    if kind is Kind.DATASET and _maybe_len(x) == 0:
        fail(name, "an empty Dataset", "at least one sample", described=True)
    if kind is Kind.BATCHES and _maybe_len(x) == 0:
        fail(name, f"an empty {type(x).__name__}", "at least one batch", described=True)
    return UserData(kind, x, has_labels=has_labels, labels_optional=labels_optional)


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
    of it under torch.distributed): ``read_data`` then ``UserData.source``.

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
    data = read_data(x, y, sample_weight, has_labels=has_labels,
                     labels_optional=labels_optional, name=name)
    return data.source(batch_size=batch_size, shuffle=shuffle, seed=seed,
                       class_weight=class_weight, rank=rank, world_size=world_size,
                       pin_memory=pin_memory)


def is_source(obj: Any) -> bool:
    """Whether ``obj`` already has the ``DataSource`` interface."""
    return all(hasattr(obj, a) for a in ("set_epoch", "state_dict", "load_state_dict", "plan",
                                          "num_batches", "__iter__"))


def _kind(x: Any) -> Kind:
    """The one look at the type of a user's data."""
    if is_source(x):
        return Kind.SOURCE
    if isinstance(x, IterableDataset):
        return Kind.STREAM
    if isinstance(x, Dataset) and not isinstance(x, DataLoader):
        return Kind.DATASET
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):  # DataBatch objects?
        return Kind.BATCHES if x and all(isinstance(b, DataBatch) for b in x) else Kind.TENSORS
    if isinstance(x, (str, bytes, torch.Tensor, np.ndarray, Mapping)) or not isinstance(
            x, Iterable):
        return Kind.TENSORS  # (or nothing fitdp reads: as_tensors names it)
    return Kind.GENERATOR if isinstance(x, Iterator) else Kind.BATCHES


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
