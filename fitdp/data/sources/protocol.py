"""The data-source interface: what ``Model`` and the executor manager need from any data.

Every form that ``fit``/``evaluate``/``predict`` accept (tensors, a ``Dataset``, a
``DataLoader``, an iterable of ``DataBatch``, a ``BucketIterator``) becomes an object with this
interface (``fitdp.data.sources.make_source``). A user may pass their own object that has it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fitdp.data.batch import DataBatch, DataDesc


@dataclass(frozen=True)
class SourcePlan:
    """What the executor manager needs before the first step, so that nothing is built (and
    no error is found) after a weight has changed.

    Attributes:
        bucket_keys: every bucket key the source yields (executor groups are built up front).
        default_bucket_key: the bucket the default executor group runs (MXNet's
            ``default_bucket_key``): the one with the largest input.
        inputs: descriptions of a full batch's inputs and labels, so input buffers are
            allocated once for the largest bucket.
        rows_per_step: rows of every full step when the source fixes it (in-memory tensors);
            None when the source brings its own batches.
        num_samples: samples per epoch when known.
        targets: every target of the data when it is in memory (the whole label tensor is
            checked against the model's outputs before the first step), else None.
        replayable: the source can be read from its start again (False for a generator):
            validation data is then checked before training from its first batch.

    Example:
        >>> SourcePlan(rows_per_step=32).bucket_keys
        ()
    """

    bucket_keys: Sequence[Hashable] = ()
    default_bucket_key: Hashable | None = None
    inputs: Sequence[DataDesc] = field(default_factory=tuple)
    rows_per_step: int | None = None
    num_samples: int | None = None
    targets: Any = None
    replayable: bool = True


@runtime_checkable
class DataSource(Protocol):
    """Epochs of ``DataBatch``, with a position that can be saved and restored.

    - ``set_epoch(e)``: the next iteration yields epoch ``e`` from its first batch.
    - iterating yields the remaining batches of the current epoch; a batch counts as consumed
      once it has been yielded.
    - ``state_dict()``/``load_state_dict()``: plain values (ints, floats, strings, tensors,
      lists, dicts) that put the source back at the same epoch and position, with the same
      order; ``fit(resume=...)`` continues from them.
    - ``num_batches``: batches per epoch, or None when unknown (an endless generator).
    - ``plan()``: see ``SourcePlan``.
    - optionally ``check_resume(state, *, continues) -> str | None``: why ``state`` cannot
      load (or None), asked before a resume changes anything; ``continues``: the next
      iteration goes on from the state's position (no ``set_epoch`` before it). It may
      raise a ``ValueError`` naming ``resume`` itself.
    """

    @property
    def num_batches(self) -> int | None: ...

    def plan(self) -> SourcePlan: ...

    def set_epoch(self, epoch: int) -> None: ...

    def __iter__(self) -> Iterator[DataBatch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def position_problem(state: Any, keys: Sequence[str], what: str) -> str | None:
    """Why ``state`` is not a position of ``what`` (a dict of the integers ``keys``), or None.

    Example:
        >>> position_problem([0, 1], ("epoch", "position"), "a DataLoader")
        'it is list, not a data position'
    """
    if not isinstance(state, Mapping):
        return f"it is {type(state).__name__}, not a data position"
    bad = [k for k in keys if not isinstance(state.get(k), int)]
    if bad:
        return (f"it lacks the integer entries {bad} of {what}'s position: it was saved by a "
                f"fit on other data; resume with the data it was saved with")
    return None


def past_end_problem(state: Mapping[str, Any], *, rows: Any, samples: int | None,
                     batches: int | None) -> str | None:
    """Why a checked mid-epoch position ``state`` cannot continue on this fit's data: it is
    past the data's end (the checkpoint came from longer data), or None.

    Compared in samples when the saved batch's ``rows`` and this data's ``samples`` are
    known (the saved ``samples``, when there, bound the rows of a partial last batch), else
    in batches.

    Example:
        >>> past_end_problem({"epoch": 0, "position": 2}, rows=8, samples=10, batches=2)[:38]
        'it is a position 2 batches (16 samples)'
    """
    position, epoch = state["position"], state["epoch"]
    saved = state.get("samples")
    if isinstance(rows, int) and samples is not None:
        seen = position * rows if not isinstance(saved, int) else min(position * rows, saved)
        if seen <= samples:
            return None
        where, size = f"{position} batches ({seen} samples)", f"{samples} samples"
    elif batches is not None and position > batches:
        where, size = f"{position} batches", f"{batches} batches"
    else:
        return None
    return (f"it is a position {where} into epoch {epoch}, past the end of this fit's data, "
            f"which has {size}: it was saved by a fit on longer data. Fix: resume with the "
            f"data it was saved with, or from a checkpoint saved at an epoch's end")
