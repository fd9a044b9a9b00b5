"""Data sources: every form ``fit``/``evaluate``/``predict`` accept, as epochs of DataBatch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from fitdp.batch import DataBatch, batch_length, tree_map, tree_structure
from fitdp.sharding import ShardedSource


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    # Mix seed and epoch so that every epoch (and every seed) has its own order.
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))


def as_tensors(x: Any, name: str) -> Any:
    """numpy arrays -> tensors (float64 -> float32, as Keras does); validate the nesting."""
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(x)
        return t.float() if t.dtype == torch.float64 else t
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Mapping):
        return {k: as_tensors(v, f"{name}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (tuple, list)) and x and all(
        isinstance(v, (torch.Tensor, np.ndarray, Mapping, tuple, list)) for v in x
    ):
        return tuple(as_tensors(v, f"{name}[{i}]") for i, v in enumerate(x))
    raise TypeError(
        f"{name}: got {type(x).__name__}; expected a tensor, a numpy array, or a tuple/list/dict "
        f"of them"
    )


class TensorSource:
    """In-memory tensors, batched by slicing a permuted copy once per epoch (no collate).

    Example:
        >>> src = TensorSource(torch.arange(5.0), None, batch_size=2, shuffle=False)
        >>> [b.data.tolist() for b in src]
        [[0.0, 1.0], [2.0, 3.0], [4.0]]
    """

    def __init__(
        self, x: Any, y: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
        rank: int = 0, world_size: int = 1,
    ) -> None:
        self.x, self.y = x, y
        self.num_samples = batch_length(x)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        # Under torch.distributed every step takes one global batch of batch_size rows per
        # rank, split evenly; every rank runs the same number of steps.
        self.global_batch = batch_size * world_size
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return -(-self.num_samples // self.global_batch)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[DataBatch]:
        x, y = self.x, self.y
        if self.shuffle:
            # One gather per epoch, then every batch is a view: the cheapest way to batch.
            order = torch.randperm(self.num_samples,
                                   generator=_epoch_generator(self.seed, self.epoch))
            x, y = tree_map(lambda t: t[order], (x, y))
        # Plain tensors (the common case) are sliced directly: this runs once per step.
        take = _slicer(x)
        take_y = _slicer(y)
        steps = len(self)
        while self.position < steps:
            sl, rows = self._rows(self.position)
            self.position += 1
            # No per-batch index: predict never shuffles, so batch order is input order.
            yield DataBatch(take(sl), take_y(sl), global_rows=rows)
        self.epoch, self.position = self.epoch + 1, 0

    def _rows(self, step: int) -> tuple[slice, int]:
        """This rank's rows of global batch ``step`` (an even split, earlier ranks first), and
        the global batch's size."""
        start = step * self.global_batch
        rows = min(self.global_batch, self.num_samples - start)
        base, extra = divmod(rows, self.world_size)
        begin = start + self.rank * base + min(self.rank, extra)
        return slice(begin, begin + base + (self.rank < extra)), rows

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.seed, self.epoch = state["seed"], state["epoch"]
        # Resuming with another world size or batch: continue after the samples already seen
        # (exact when the old global batch is a multiple of the new one).
        self.position = state["position"] * state.get("global_batch", self.global_batch)
        self.position //= self.global_batch


def _slicer(tree: Any) -> Any:
    """``sl -> tree[sl]`` for a tensor, a tree of tensors or None."""
    if tree is None:
        return lambda sl: None
    if isinstance(tree, torch.Tensor):
        return tree.__getitem__
    return lambda sl: tree_map(lambda t: t[sl], tree)


class EpochSampler(torch.utils.data.Sampler[int]):
    """Sample order as a function of (seed, epoch) alone, so a resumed run sees the same order."""

    def __init__(self, n: int, *, seed: int, shuffle: bool) -> None:
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.n))
        order = torch.randperm(self.n, generator=_epoch_generator(self.seed, self.epoch))
        return iter(order.tolist())


class LoaderSource:
    """A user's DataLoader (or any re-iterable of ``(x, y)`` batches), used as it is.

    Checks that every batch has the structure of the first one, so a loader that changes
    shape mid-epoch fails with a clear message instead of deep inside the model.
    """

    def __init__(self, loader: Iterable[Any], *, has_labels: bool = True) -> None:
        self.loader = loader
        self.has_labels = has_labels
        self.structure: Any = None
        self.epoch = 0
        self.position = 0
        self.epoch_rng: torch.Tensor | None = None
        self.num_samples = _maybe_len(getattr(loader, "dataset", None))

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # unsized loaders raise TypeError

    def check_epochs(self, epochs: int) -> None:
        """A one-shot iterator (a generator) runs dry after one epoch: refuse more up front.

        Raises:
            ValueError: ``epochs > 1`` with an iterator that is its own ``iter()``.
        """
        if epochs > 1 and iter(self.loader) is self.loader:
            raise ValueError(
                f"data: a one-shot iterator ({type(self.loader).__name__}) yields its batches "
                f"once, but {epochs} epochs were asked for. Fix: pass a list, a DataLoader or "
                f"a re-iterable object, or train one epoch per fit call."
            )

    def set_epoch(self, epoch: int) -> None:
        sampler: Any = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[DataBatch]:
        # A shuffling DataLoader draws its order from torch's global RNG when the iterator is
        # made: remember that state, so a run resumed mid-epoch replays the same order.
        now = torch.get_rng_state()
        if self.position > 0 and self.epoch_rng is not None:
            torch.set_rng_state(self.epoch_rng)
        self.epoch_rng = torch.get_rng_state()
        batches = iter(self.loader)
        torch.set_rng_state(now)
        for i, item in enumerate(batches):
            if i < self.position:
                continue  # resuming mid-epoch: these batches were trained before the stop
            batch = item if isinstance(item, DataBatch) else self._to_batch(item, i)
            self.position = i + 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def _to_batch(self, item: Any, i: int) -> DataBatch:
        if self.has_labels and isinstance(item, (tuple, list)) and len(item) == 2:
            x, y = item
        elif self.has_labels:
            raise ValueError(
                f"data: batch {i} of the DataLoader is {type(item).__name__}"
                f"{f' of length {len(item)}' if isinstance(item, (tuple, list)) else ''}; "
                f"expected (inputs, targets) pairs. Fix: make the dataset return (x, y)."
            )
        else:
            pair = isinstance(item, (tuple, list)) and len(item) == 2
            x, y = (item[0], None) if pair else (item, None)
        x = as_tensors(x, "data")
        y = None if y is None else as_tensors(y, "targets")
        structure = (tree_structure(x), tree_structure(y))
        if self.structure is None:
            self.structure = structure
        elif structure != self.structure:
            raise ValueError(
                f"data: batch {i} of the DataLoader has structure {structure}, but the first "
                f"batch had {self.structure}; every batch must hold the same tensors (same "
                f"nesting, rank and dtype). Fix: make the dataset/collate_fn return one format."
            )
        return DataBatch(x, y)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "rng": self.epoch_rng}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.epoch_rng = state.get("rng")


def _maybe_len(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def make_source(
    data: Any,
    y: Any,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    has_labels: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> Any:
    """Turn what a user passed to fit/evaluate/predict into a data source (this rank's share
    of it under torch.distributed).

    Raises:
        ValueError: empty data, or inputs and targets of different lengths.
        TypeError: a form fitdp does not accept.
    """
    if data is None:
        raise ValueError("data: got None; expected tensors, a Dataset, a DataLoader or batches")
    source = _batch_source(data, y, batch_size, shuffle, seed, has_labels)
    if source is None:
        return _tensor_source(data, y, batch_size, shuffle, seed, has_labels, rank, world_size)
    return source if world_size == 1 else ShardedSource(source, rank, world_size)


def _batch_source(
    data: Any, y: Any, batch_size: int, shuffle: bool, seed: int, has_labels: bool
) -> Any:
    """A source for data that comes in batches (or a Dataset); None for in-memory tensors."""
    if all(hasattr(data, a) for a in ("set_epoch", "state_dict", "load_state_dict", "__iter__")):
        return data  # a source already, e.g. a BucketIterator
    if isinstance(data, DataLoader) or _is_batch_iterable(data):
        if y is not None:
            raise ValueError(
                f"y: got targets together with a {type(data).__name__}, which already yields "
                f"targets; pass y=None"
            )
        source = LoaderSource(data, has_labels=has_labels)
        if _maybe_len(data) == 0:
            raise ValueError(
                f"data: the {type(data).__name__} is empty; expected at least one batch"
            )
        return source
    if isinstance(data, Dataset) and not isinstance(data, (torch.Tensor, np.ndarray)):
        n = _maybe_len(data)
        if n == 0:
            raise ValueError("data: the Dataset is empty; expected at least one sample")
        sampler = EpochSampler(n if n is not None else 0, seed=seed, shuffle=shuffle)
        loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
        return LoaderSource(loader, has_labels=has_labels)
    return None


def _tensor_source(
    data: Any, y: Any, batch_size: int, shuffle: bool, seed: int, has_labels: bool, rank: int,
    world_size: int,
) -> TensorSource:
    if y is None and isinstance(data, tuple) and len(data) == 2 and has_labels:
        data, y = data
    x = as_tensors(data, "data")
    n = batch_length(x)
    if n == 0:
        raise ValueError("data: got 0 samples; expected at least one")
    for name, leaf in _leaves_with_names(x, "data"):
        if leaf.dim() == 0 or leaf.shape[0] != n:
            raise ValueError(
                f"data: {name} has {leaf.shape[0] if leaf.dim() else 0} rows but the first input "
                f"has {n}; every input must have the same number of samples"
            )
    if y is not None:
        y = as_tensors(y, "y")
        for _, t in _leaves_with_names(y, "y"):
            if t.dim() == 0 or t.shape[0] != n:
                raise ValueError(
                    f"y: got {t.shape[0] if t.dim() else 0} targets for {n} samples in x; "
                    f"expected one target per sample. Fix: pass x and y of the same length."
                )
    elif has_labels:
        raise ValueError("y: got no targets; pass y=... or data=(x, y) to train or evaluate")
    return TensorSource(x, y, batch_size, shuffle=shuffle, seed=seed, rank=rank,
                        world_size=world_size)


def _leaves_with_names(tree: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        return [(name, tree)]
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
    return [p for k, v in items for p in _leaves_with_names(v, f"{name}[{k!r}]")]


def _is_batch_iterable(data: Any) -> bool:
    """An iterable of DataBatch (a list of them, a generator), not a tensor container."""
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return len(data) > 0 and all(isinstance(b, DataBatch) for b in data)
    if isinstance(data, (str, bytes, torch.Tensor, np.ndarray, Mapping, Dataset)):
        return False
    return isinstance(data, Iterable)


def split_validation(x: Any, y: Any, fraction: float) -> tuple[Any, Any, Any, Any]:
    """Keras's ``validation_split``: the last ``fraction`` of the samples, before shuffling."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation_split: got {fraction}; expected a number in (0, 1)")
    n = batch_length(x)
    cut = n - int(n * fraction)
    if cut <= 0 or cut >= n:
        raise ValueError(
            f"validation_split: {fraction} of {n} samples leaves an empty training or "
            f"validation set; use a fraction that keeps at least one sample in each"
        )
    head, tail = slice(0, cut), slice(cut, n)
    return (
        tree_map(lambda t: t[head], x), tree_map(lambda t: t[head], y),
        tree_map(lambda t: t[tail], x), tree_map(lambda t: t[tail], y),
    )
