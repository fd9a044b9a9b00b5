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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from fitdp.checks import check_number, fail
from fitdp.data.batch import DataBatch, batch_length
from fitdp.data.length_groups import BucketBatchSampler
from fitdp.data.sources.convert import read_tensors, split_validation
from fitdp.data.sources.grouping import row_lengths
from fitdp.data.sources.hf_datasets import is_hf_dataset, is_map_style, stack_rows, without_unused
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
    DATASET = "a map-style Dataset (or a list of rows)"
    HF = "a Hugging Face datasets.Dataset or IterableDataset"
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
        collate_fn: how rows become a batch (a Dataset, a list of rows, a Hugging Face
            dataset: the kinds fitdp batches); None: torch's default collate (a Hugging Face
            dataset: its rows stacked, ``stack_rows``).
        keep: the forward's argument names: a Hugging Face dataset's other columns are
            dropped (None keeps them).
        name: what to call the data in messages.
        lengths: each row's length (``fit(group_by_length=...)``): rows are batched with
            others of similar length (``BucketBatchSampler``); None batches them in order.
    """

    kind: Kind
    x: Any
    y: Any = None
    sample_weight: Any = None
    has_labels: bool = True
    labels_optional: bool = False
    collate_fn: Callable[[list[Any]], Any] | None = None
    keep: frozenset[str] | None = None
    name: str = "x"
    lengths: torch.Tensor | None = None

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
        """The data source of this kind (this rank's share of it under torch.distributed):
        its entry's adapter in ``KINDS``. The arguments are ``make_source``'s, and
        ``rank_unit`` ``TensorSource``'s (other sources hand out whole batches per rank).

        Raises:
            TypeError, ValueError: a bad ``class_weight``.
        """
        how = Batching(batch_size, shuffle, seed, class_weight, rank, world_size, pin_memory,
                       rank_unit)
        return next(k.adapter for k in KINDS if k.kind is self.kind)(self, how)

    def loader(self, batches: Iterable[Any]) -> LoaderSource:
        """Batches as they come, read as this data's batches."""
        return LoaderSource(batches, has_labels=self.has_labels,
                            labels_optional=self.labels_optional)


class Batching(NamedTuple):
    """How a call batches its data (``UserData.source``'s arguments)."""

    batch_size: int
    shuffle: bool
    seed: int
    class_weight: Mapping[int, float] | None
    rank: int
    world_size: int
    pin_memory: bool
    rank_unit: int


class DataKind(NamedTuple):
    """One entry of ``KINDS``: the kind, the test that recognises it and its adapter."""

    kind: Kind
    test: Callable[[Any], bool]
    adapter: Callable[[UserData, Batching], DataSource]


def _tensors(data: UserData, how: Batching) -> DataSource:
    w = data.sample_weight
    if how.class_weight is not None:
        cw = class_weights(how.class_weight, data.y)
        w = cw if w is None else w * cw
    return TensorSource(data.x, data.y, how.batch_size, sample_weight=w, shuffle=how.shuffle,
                        seed=how.seed, rank=how.rank, world_size=how.world_size,
                        pin_memory=how.pin_memory, rank_unit=how.rank_unit)


def _shared(source: DataSource, how: Batching) -> DataSource:
    """A source of whole batches, class-weighted, and this rank's share of them."""
    if how.class_weight is not None:
        source = ClassWeighted(source, how.class_weight)
    return source if how.world_size == 1 else ShardedSource(source, how.rank, how.world_size)


def _rows(data: UserData, how: Batching, rows: Any = None,
          collate_fn: Callable[[list[Any]], Any] | None = None) -> DataSource:
    """A map-style dataset (``rows``, else the user's) batched by a DataLoader fitdp builds,
    in an order drawn from (seed, epoch) alone."""
    rows = data.x if rows is None else rows
    collate_fn = collate_fn or data.collate_fn
    if data.lengths is not None:  # batches of rows of similar length (group_by_length)
        batches = BucketBatchSampler(data.lengths, how.batch_size, shuffle=how.shuffle,
                                     seed=how.seed, name="group_by_length")
        loader = DataLoader(rows, batch_sampler=batches, pin_memory=how.pin_memory,
                            collate_fn=collate_fn)
    else:
        sampler = EpochSampler(_maybe_len(rows) or 0, seed=how.seed, shuffle=how.shuffle)
        loader = DataLoader(rows, batch_size=how.batch_size, sampler=sampler,
                            pin_memory=how.pin_memory, collate_fn=collate_fn)
    return _shared(data.loader(loader), how)


def _stream(data: UserData, how: Batching, stream: Any = None,
            collate_fn: Callable[[list[Any]], Any] | None = None) -> DataSource:
    """An IterableDataset batched by ``batch_size`` in its own order (no sampler)."""
    loader = DataLoader(data.x if stream is None else stream, batch_size=how.batch_size,
                        pin_memory=how.pin_memory, collate_fn=collate_fn or data.collate_fn)
    return _shared(data.loader(loader), how)


def _hf(data: UserData, how: Batching) -> DataSource:
    """A Hugging Face dataset: the forward's columns, rows (or a stream) collated by the
    user's collator or stacked."""
    dataset, collate = without_unused(data.x, data.keep, data.name,
                                      data.collate_fn or stack_rows)
    make = _rows if is_map_style(dataset) else _stream
    return make(data, how, dataset, collate)


def _batches(data: UserData, how: Batching) -> DataSource:
    return _shared(data.loader(data.x), how)  # as they come (a DataLoader used as it is)


def _source(data: UserData, how: Batching) -> DataSource:
    return _shared(data.x, how)  # a source already, e.g. a BucketIterator


def _rows_of_dicts(x: Any) -> bool:
    """A list of dicts is a list of rows, a map-style dataset, each dict one sample (as
    torch's DataLoader and transformers' Trainer read a list): not a list of dict batches
    (pass those as a DataLoader or a generator) nor several inputs (pass those as a tuple)."""
    return isinstance(x, list) and bool(x) and all(isinstance(r, Mapping) for r in x)


def _in_memory(x: Any) -> bool:
    """Tensors, arrays and tuples/lists/dicts of them (or nothing fitdp reads: as_tensors
    names it)."""
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return not (x and all(isinstance(b, DataBatch) for b in x))
    return isinstance(x, (str, bytes, torch.Tensor, np.ndarray, Mapping)) or not isinstance(
        x, Iterable)


# The kinds in the order they are tried: the first whose test holds is the data's kind.
KINDS: tuple[DataKind, ...] = (
    DataKind(Kind.SOURCE, lambda x: is_source(x), _source),
    DataKind(Kind.HF, is_hf_dataset, _hf),  # before STREAM: its stream is a torch one too
    DataKind(Kind.STREAM, lambda x: isinstance(x, IterableDataset), _stream),
    DataKind(Kind.DATASET, lambda x: isinstance(x, Dataset) and not isinstance(
        x, DataLoader), _rows),
    DataKind(Kind.DATASET, _rows_of_dicts, _rows),
    DataKind(Kind.TENSORS, _in_memory, _tensors),
    DataKind(Kind.GENERATOR, lambda x: isinstance(x, Iterator), _batches),
    DataKind(Kind.BATCHES, lambda x: True, _batches),
)


ROW_KINDS = (Kind.DATASET, Kind.HF, Kind.STREAM)  # batched by fitdp from rows


def batched_from_rows(x: Any) -> bool:
    """Whether fitdp batches ``x`` from its rows itself, so that a ``collate_fn`` applies.

    Example:
        >>> batched_from_rows([{"x": 1}]), batched_from_rows(torch.zeros(4, 2))
        (True, False)
    """
    return _kind(x) in ROW_KINDS


def read_data(x: Any, y: Any = None, sample_weight: Any = None, *, has_labels: bool = True,
              labels_optional: bool = False, name: str = "x",
              collate_fn: Callable[[list[Any]], Any] | None = None,
              keep: frozenset[str] | None = None, group_by_length: Any = False) -> UserData:
    """Classify what a user passed, once, and convert and check in-memory data, once.

    Args:
        x, y, sample_weight, has_labels, labels_optional, name, collate_fn: as in
            ``make_source``.
        keep: the forward's argument names (``UserData.keep``).
        group_by_length: ``fit``'s: False, or how to read each row's length
            (``row_lengths``), for rows fitdp batches (a map-style dataset).

    Raises:
        ValueError: empty data, lengths that differ, targets given twice, a NaN or an
            infinity in in-memory data.
        TypeError: a form fitdp does not accept, or a ``collate_fn`` for data fitdp does not
            batch.
    """
    if x is None:
        fail(name, None, "tensors, a Dataset, a DataLoader or an iterable of batches",
             error=ValueError)
    kind = _kind(x)
    if collate_fn is not None:
        _check_collate(collate_fn, kind, x, name)
    if group_by_length is not None and group_by_length is not False:
        _check_groupable(kind, x, name)
    if kind is Kind.TENSORS:
        x, y, sample_weight = read_tensors(x, y, sample_weight, has_labels=has_labels,
                                           labels_optional=labels_optional, name=name)
        return UserData(kind, x, y, sample_weight, has_labels, labels_optional, name=name)
    for arg, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            fail(arg, f"a value together with {name} of type {type(x).__name__}",
                 f"{arg}=None: that {type(x).__name__} yields its own "
                 f"{'targets' if arg == 'y' else 'weights'}", described=True)
    if kind in (Kind.DATASET, Kind.HF) and _maybe_len(x) == 0:
        fail(name, "an empty Dataset", "at least one sample", described=True)
    if kind is Kind.BATCHES and _maybe_len(x) == 0:
        fail(name, f"an empty {type(x).__name__}", "at least one batch", described=True)
    return UserData(kind, x, has_labels=has_labels, labels_optional=labels_optional,
                    collate_fn=collate_fn, keep=keep, name=name,
                    lengths=row_lengths(x, group_by_length, name=name))


def _check_groupable(kind: Kind, x: Any, name: str) -> None:
    """``group_by_length``: for rows fitdp batches and can read in any order (a TypeError for
    data that comes batched, in-memory tensors and streams)."""
    if kind is Kind.DATASET or (kind is Kind.HF and is_map_style(x)):
        return
    fix = {Kind.SOURCE: "a BucketIterator groups its sequences by length itself: drop "
           "group_by_length", Kind.TENSORS: "in-memory tensors have one length: pass a "
           "Dataset or a list of rows of different lengths with a collate_fn",
           Kind.BATCHES: "pass the dataset itself, or give your DataLoader "
           "batch_sampler=fitdp.BucketBatchSampler(lengths, batch_size)"}.get(
               kind, "a stream has no random access: pass a map-style dataset")
    what = "a datasets.IterableDataset" if kind is Kind.HF else kind.value
    fail("group_by_length", f"length grouping together with {name} of type "
         f"{type(x).__name__} ({what})", "a map-style dataset whose rows fitdp batches (a "
         "datasets.Dataset, a torch Dataset or a list of rows)", fix, error=TypeError,
         described=True)


def _check_collate(collate_fn: Any, kind: Kind, x: Any, name: str) -> None:
    """``collate_fn``: a callable, for data fitdp batches itself."""
    if not callable(collate_fn):
        fail("collate_fn", collate_fn, "a callable that makes one batch of a list of rows "
             "(a DataCollatorWithPadding, or your own function)", error=TypeError)
    if kind not in ROW_KINDS:
        fail("collate_fn", f"a collate function together with {name} of type "
             f"{type(x).__name__} ({kind.value}), which fitdp does not batch",
             "collate_fn with a Dataset, a list of rows, an IterableDataset or a Hugging Face "
             "dataset", "pass the collate_fn to your DataLoader, or pass the dataset itself",
             error=TypeError, described=True)


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
    collate_fn: Callable[[list[Any]], Any] | None = None,
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
        collate_fn: how a ``Dataset``'s, a list's or a Hugging Face dataset's rows become
            one batch (``Trainer(data_collator=)``); a ``TypeError`` with data that comes
            batched.

    Raises:
        ValueError: empty data, lengths that differ, targets given twice.
        TypeError: a form fitdp does not accept.
    """
    data = read_data(x, y, sample_weight, has_labels=has_labels,
                     labels_optional=labels_optional, name=name, collate_fn=collate_fn)
    return data.source(batch_size=batch_size, shuffle=shuffle, seed=seed,
                       class_weight=class_weight, rank=rank, world_size=world_size,
                       pin_memory=pin_memory)


def is_source(obj: Any) -> bool:
    """Whether ``obj`` already has the ``DataSource`` interface."""
    return all(hasattr(obj, a) for a in ("set_epoch", "state_dict", "load_state_dict", "plan",
                                          "num_batches", "__iter__"))


def _kind(x: Any) -> Kind:
    """The one look at the type of a user's data: the first entry of ``KINDS`` that holds."""
    return next(k.kind for k in KINDS if k.test(x))


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
