"""Data that comes in batches: a DataLoader, a Dataset, any iterable of batches, a generator."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NoReturn

import torch
from torch.utils.data import IterableDataset

from fitdp.checks import fail
from fitdp.data.batch import DataBatch, tree_structure
from fitdp.data.length_groups import BucketBatchSampler
from fitdp.data.sources.convert import as_tensors
from fitdp.data.sources.protocol import SourcePlan, past_end_problem, position_problem
from fitdp.data.sources.tensors import epoch_generator, rebatched

# A dict batch with a compile loss and no targets: the fix for a Hugging Face batch.
_OWN_LOSS = (", or compile(loss=None) for a module that computes its own loss from a dict "
             "batch (a Hugging Face model given labels)")


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
        order = torch.randperm(self.n, generator=epoch_generator(self.seed, self.epoch))
        return iter(order.tolist())


class LoaderSource:
    """Batches from a user's DataLoader, re-iterable object or one-shot iterator, as they are.

    Each item is a ``DataBatch``, an ``(x, y)`` pair or an ``(x, y, sample_weight)`` triple
    (``x`` alone, or ``(x,)``, when predicting); with ``labels_optional`` a dict is ``x``
    alone too (a Hugging Face batch, its labels inside). Every batch must have the structure of the
    first, so a loader that changes shape mid-epoch fails clearly, not deep in the model.

    A re-iterable object (a DataLoader, a list) starts over at every ``set_epoch``. A one-shot
    iterator (a generator: ``iter(g) is g``) cannot: every epoch takes the next batches from
    it, which is how an endless generator trains with ``steps_per_epoch`` (Keras semantics).

    A DataLoader over an ``IterableDataset`` (a stream) makes one pass of it per epoch (the
    dataset's ``set_epoch(epoch)`` is called when it has one). Resuming mid-epoch needs the
    stream to say its position: a dataset with ``state_dict()`` (plain values) and
    ``load_state_dict(state)`` (the next ``iter()`` continues from there), read in this
    process (``num_workers=0``: with workers the position lives in their processes). Without
    that, a mid-epoch resume is a ValueError naming ``resume``, rather than replaying a
    stream that may not replay; a resume from an epoch's end needs nothing.

    Any other DataLoader resumes mid-epoch by replaying its epoch: the states of torch's RNG
    and of the loader's own generators at the epoch's start are saved, so the order and the
    workers' seeds (their augmentation) come out as before, and the batches trained before
    the stop are read and skipped. A loader with ``state_dict()``/``load_state_dict()``
    (torchdata's ``StatefulDataLoader``) is saved and continues by itself instead, workers
    and all, reading nothing twice. Persistent workers cannot be replayed (their random
    draws carry over from earlier epochs): a mid-epoch resume of them is refused.

    Example:
        >>> src = LoaderSource([(torch.zeros(2, 3), torch.zeros(2))])
        >>> [b.batch_size for b in src]
        [2]
    """

    def __init__(self, loader: Iterable[Any], *, has_labels: bool = True,
                 labels_optional: bool = False) -> None:
        self.loader = loader
        self.has_labels = has_labels
        self.labels_optional = labels_optional
        # an iterator is its own iter(); asking iter() of a DataLoader would start (and drop)
        # its worker processes
        self.one_shot = isinstance(loader, Iterator)
        self.structure: Any = None
        self.epoch = 0
        self.position = 0  # batches consumed: in this epoch, or in all (one-shot)
        self.epoch_rng: torch.Tensor | None = None
        self._live: Iterator[Any] | None = None
        # A loader that saves its own position (torchdata's StatefulDataLoader), and the
        # generators its order is drawn from besides torch's global one (saved with it).
        self.stateful_loader = (callable(getattr(loader, "state_dict", None))
                                and callable(getattr(loader, "load_state_dict", None)))
        self.generators = _generators(loader)
        self.epoch_generators: list[torch.Tensor] = []
        self._saved: Mapping[str, Any] | None = None  # a loaded position, applied at _start
        dataset = getattr(loader, "dataset", None)
        # the user's stream, duck-typed: set_epoch, state_dict, load_state_dict when it has them
        self.stream: Any = dataset if isinstance(dataset, IterableDataset) else None
        try:  # (read once: the position is saved after every optimizer step)
            self.num_samples = len(dataset) if dataset is not None else None  # type: ignore[arg-type]
        except TypeError:
            self.num_samples = None
        self._stream_state: Any = None  # where a resumed stream continues
        # Batches of rows grouped by length: their order depends on the batch size and the
        # buckets, so a mid-epoch position is only valid with the same ones.
        batch_sampler = getattr(loader, "batch_sampler", None)
        self.grouped = batch_sampler if isinstance(batch_sampler, BucketBatchSampler) else None
        # (what the epoch's batches depend on besides (seed, epoch), saved with the position)
        self.grouping = None if self.grouped is None else {
            "batch_size": self.grouped.batch_size, "buckets": list(self.grouped.buckets)}

    @property
    def num_batches(self) -> int | None:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            return None

    def plan(self) -> SourcePlan:
        return SourcePlan(num_samples=self.num_samples, replayable=not self.one_shot)

    def set_epoch(self, epoch: int) -> None:
        self._tell_epoch(epoch)
        if not self.one_shot:
            self.position, self._live = 0, None

    def _tell_epoch(self, epoch: int) -> None:
        """The epoch, to the sampler, batch sampler and stream that draw their order from it
        (as ``DistributedSampler``), at every epoch and at a resume into one."""
        self.epoch = epoch
        for owner in (getattr(self.loader, "sampler", None), self.grouped, self.stream):
            if callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(epoch)  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[DataBatch]:
        if self._live is None:
            self._live = self._start()
        for item in self._live:
            self.position += 1
            yield item if isinstance(item, DataBatch) else self._to_batch(item)
        self._live = None if not self.one_shot else self._live

    def _start(self) -> Iterator[Any]:
        """A fresh iterator, past the batches already consumed (resuming mid-epoch)."""
        now = torch.get_rng_state()
        saved, self._saved = self._saved, None  # the loaded position's states, or None
        skip = self.position
        if saved is not None and not skip:  # a new epoch: its order drawn as it was
            _set_states(self.generators, saved.get("generators_now"))
        elif saved is not None and self.stateful_loader and saved.get("loader_at") == skip:
            # The loader continues by itself (a StatefulDataLoader: its workers too).
            self.loader.load_state_dict(saved["loader"])  # type: ignore[attr-defined]
            self.epoch_generators = saved.get("generators", [])
            batches = iter(self.loader)
            # Its own generator (generator=g) as the stop left it: torchdata puts it back at
            # the epoch's start and redraws the order, but not the draw of the workers' seed
            # before it, so the next epoch would be drawn from another state.
            _set_states(self.generators, saved.get("generators_now"))
            torch.set_rng_state(now)
            return batches
        elif skip and self.stream is None:  # replay the epoch's order from its start's states
            if self.epoch_rng is not None:
                torch.set_rng_state(self.epoch_rng)
            _set_states(self.generators, saved.get("generators") if saved else None)
        # A shuffling DataLoader draws its order from torch's global RNG (or its generator)
        # when the iterator is made (and, without workers, at its first batch): remember
        # those states, so a run resumed mid-epoch replays the same order.
        self.epoch_rng = torch.get_rng_state()
        self.epoch_generators = [g.get_state() for g in self.generators]
        if self.stream is not None and skip:
            self._continue_stream()  # the stream itself continues: nothing to skip
            skip = 0
        batches = iter(self.loader)
        torch.set_rng_state(self.epoch_rng)
        for _ in range(skip):
            next(batches, None)  # trained before the stop
        torch.set_rng_state(now)  # (the data's own draws leave the model's RNG as it was)
        return batches

    def _check_workers(self, state: Mapping[str, Any]) -> None:
        """Refuse, before anything loads, a saved position this loader cannot continue from:
        mid-epoch with persistent workers, which keep drawing random numbers from where the
        earlier epochs left them, so no replay gives the same batches.

        Raises:
            ValueError: naming ``resume``, ``num_workers`` and the fix.
        """
        position, total = int(state["position"]), self.num_batches
        workers = getattr(self.loader, "num_workers", 0)
        own = self.stateful_loader and state.get("loader_at") == position
        if (not workers or not getattr(self.loader, "persistent_workers", False) or own
                or position == 0 or self.one_shot or position == total):
            return
        fail("resume", f"a checkpoint taken mid-epoch ({position} batches into epoch "
             f"{state['epoch']}) of a DataLoader with num_workers={workers} and "
             "persistent_workers=True, whose workers' random draws (augmentation) carry "
             "over from every earlier epoch and cannot be replayed",
             "a loader whose epoch can be replayed or that saves its own position",
             "use persistent_workers=False (each epoch's workers are then seeded from the "
             "saved RNG), or torchdata's StatefulDataLoader (its state_dict() is saved), or "
             "resume from a checkpoint saved at an epoch's end (save_freq='epoch')",
             described=True)

    def _stateful(self) -> bool:
        """The stream can say its position, in this process."""
        return (callable(getattr(self.stream, "state_dict", None))
                and callable(getattr(self.stream, "load_state_dict", None))
                and not getattr(self.loader, "num_workers", 0))

    def _continue_stream(self) -> None:
        """Put the stream where the batches consumed so far leave it, or refuse."""
        if self._stream_state is None:
            self._refuse_resume(self.position, self.epoch)
        self.stream.load_state_dict(self._stream_state)

    def check_resume(self, state: Any, *, continues: bool) -> str | None:
        """Why ``state`` cannot load, or None; a stream that would have to continue mid-epoch
        (``continues``) without saying its position is refused (ValueError) before a resume
        changes anything."""
        problem = position_problem(state, ("epoch", "position"), "a DataLoader or iterable")
        if problem or not continues:
            return problem
        if state["position"] and (problem := _regrouped(state, self.grouping)):
            return problem
        if not self.one_shot and (problem := past_end_problem(
                state, rows=state.get("batch_size"), samples=self.num_samples,
                batches=self.num_batches)):
            return problem
        self._check_workers(state)
        if self.stream is None or not state["position"]:
            return None
        if state.get("stream") is None or not self._stateful():
            self._refuse_resume(state["position"], state["epoch"])
        return None

    def _refuse_resume(self, position: int, epoch: int) -> NoReturn:
        name = type(self.stream).__name__
        why = (f"with num_workers={getattr(self.loader, 'num_workers', 0)} its position "
               f"lives in the worker processes" if callable(
                   getattr(self.stream, "state_dict", None)) else
               "it has no state_dict()/load_state_dict()")
        fail("resume", f"a checkpoint taken mid-epoch ({position} batches into epoch "
             f"{epoch}) of a DataLoader over {name}, an IterableDataset that cannot "
             f"say its position ({why})",
             "a stream that can continue where it stopped, or a checkpoint from an "
             "epoch's end", f"give {name} state_dict() -> plain values and "
             "load_state_dict(state) (the next iter() continues from there) and use "
             "num_workers=0, or resume from a checkpoint saved at an epoch's end "
             "(save_freq='epoch')", described=True)

    def _to_batch(self, item: Any) -> DataBatch:
        i = self.position - 1
        dict_item = isinstance(item, Mapping)
        pair = isinstance(item, (tuple, list))
        w = None
        if dict_item and (self.labels_optional or not self.has_labels):
            x, y = item, None  # a dict of inputs (a Hugging Face batch holds its labels)
        elif self.has_labels:
            if not (pair and len(item) in (2, 3)):
                raise ValueError(
                    f"x: batch {i} of the {type(self.loader).__name__} is "
                    f"{type(item).__name__}{f' of length {len(item)}' if pair else ''}; "
                    f"expected (inputs, targets) pairs or (inputs, targets, sample_weight) "
                    f"triples. Fix: make the dataset return (x, y){_OWN_LOSS * dict_item}."
                )
            x, y = item[0], item[1]
            w = item[2] if len(item) == 3 else None
        else:
            x, y = (item[0], None) if pair and len(item) in (1, 2, 3) else (item, None)
        x = as_tensors(x, "x")
        y = None if y is None else as_tensors(y, "y")
        w = None if w is None else as_tensors(w, "sample_weight")
        structure = (tree_structure(x), tree_structure(y), tree_structure(w))
        if self.structure is None:
            self.structure = structure
        elif structure != self.structure:
            raise ValueError(
                f"x: batch {i} of the {type(self.loader).__name__} has structure {structure}, "
                f"but the first batch had {self.structure}; every batch must hold the same "
                f"tensors (same nesting, rank and dtype). Fix: make the dataset/collate_fn "
                f"return one format."
            )
        return DataBatch(x, y, sample_weight=w)

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "position": self.position, "rng": self.epoch_rng,
                 "batch_size": getattr(self.loader, "batch_size", None),
                 "samples": self.num_samples}
        if self.stream is not None:  # read after every optimizer step
            state["stream"] = self.stream.state_dict() if self._stateful() else None
        if self.grouping is not None:
            state["grouped"] = self.grouping
        pending = self._saved
        if pending is not None:  # loaded and not applied yet: saved again as it was
            state.update({k: pending[k] for k in ("generators", "generators_now", "loader",
                                                  "loader_at") if k in pending})
            return state
        if self.generators:
            state["generators"] = self.epoch_generators
            state["generators_now"] = [g.get_state() for g in self.generators]
        if self.stateful_loader and self._live is not None:  # an epoch in flight
            state["loader"] = self.loader.state_dict()  # type: ignore[attr-defined]
            state["loader_at"] = self.position
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._tell_epoch(int(state["epoch"]))  # (a mid-epoch resume sets no epoch)
        self.position = int(state["position"])
        old, new = state.get("batch_size"), getattr(self.loader, "batch_size", None)
        if isinstance(old, int) and isinstance(new, int) and self.stream is None:
            # a DataLoader with another batch_size: skip the samples, not the batches
            self.position = rebatched(self.position, old, new, self.num_samples,
                                      self.epoch, old, new)
        self.epoch_rng = state.get("rng")
        self._stream_state = state.get("stream")
        self._saved = state
        self._live = None


def _regrouped(state: Mapping[str, Any], now: dict[str, Any] | None) -> str | None:
    """Why a mid-epoch ``state`` cannot continue with this fit's length grouping, or None:
    the saved epoch was grouped into other batches (another batch size or buckets), or
    only one of the two runs grouped its rows."""
    saved = state.get("grouped")
    if saved == now:
        return None

    def what(grouping: Any) -> str:
        return ("rows batched in order" if grouping is None else f"rows grouped by length "
                f"into batches of {grouping['batch_size']} (buckets {grouping['buckets']})")

    return (f"it is a position {state['position']} batches into epoch {state['epoch']} of "
            f"{what(saved)}, and this fit has {what(now)}: another order of the same rows. "
            f"Fix: resume with the checkpoint's batch_size and group_by_length, or from a "
            f"checkpoint saved at an epoch's end")


def _generators(loader: Any) -> list[torch.Generator]:
    """The generators a loader draws its order and workers' seeds from, other than torch's
    global one: the DataLoader's ``generator`` and its sampler's (torchdata's RandomSampler
    always has one), each once."""
    found: list[torch.Generator] = []
    sampler = getattr(loader, "sampler", None)
    for owner in (loader, sampler, getattr(getattr(loader, "batch_sampler", None), "sampler",
                                           None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def _set_states(generators: list[torch.Generator], states: list[torch.Tensor] | None) -> None:
    """Put each generator at its saved state (none saved: left as they are)."""
    for g, state in zip(generators, states or ()):
        g.set_state(state)
