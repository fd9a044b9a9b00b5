"""The per-batch routine every call shares, and predict's reassembly of rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from fitdp.call.ranks import Ranks
from fitdp.callbacks import CallbackList
from fitdp.data.batch import Axes, DataBatch
from fitdp.data.sequence import PAD_VALUE, pad_cat, reorder, split_samples

# predict's pad for a ModelOutput's fields of several lengths: transformers Trainer's
# ``padding_index`` for predictions (a value no real logit takes in practice).
MODEL_OUTPUT_PAD = -100.0


class Hooks(NamedTuple):
    """The callback hooks around each batch of one kind of call, and the flag of the run
    (``RunState``) that a callback sets to end it (as Keras's ``model.stop_training``)."""

    begin: str
    end: str
    stop: str


TRAIN = Hooks("on_train_batch_begin", "on_train_batch_end", "stop_training")
TEST = Hooks("on_test_batch_begin", "on_test_batch_end", "stop_evaluating")
PREDICT = Hooks("on_predict_batch_begin", "on_predict_batch_end", "stop_predicting")


def run_batches(
    batches: Iterable[DataBatch],
    callbacks: CallbackList,
    hooks: Hooks,
    step: Callable[[DataBatch, int], dict[str, float]],
    run: Any,
    preempted: Callable[[], bool] | None = None,
) -> int:
    """For each batch: the begin hook, ``step(batch, index)``, the end hook with the logs
    ``step`` returns; stop early when ``preempted()`` says so (asked first, at every batch:
    under torchrun a vote every rank takes) or the run's flag ``hooks.stop`` is set.

    Returns:
        The number of batches run.
    """
    done = 0
    begin, end = callbacks.hook(hooks.begin), callbacks.hook(hooks.end)
    for i, batch in enumerate(batches):
        if begin:  # (no call per batch for a hook nobody overrides)
            callbacks.call(hooks.begin, i, {})
        logs = step(batch, i)
        if end:
            callbacks.call(hooks.end, i, logs)
        done += 1
        if (preempted is not None and preempted()) or getattr(run, hooks.stop):
            break
    return done


def assemble(rows: list[tuple[int, Any, Any]], ranks: Ranks, axis: Axes = 0,
             pad_value: float | None = None, ragged: bool = False,
             kind: type | None = None) -> Any:
    """Predict's rows in input order (from every rank under torch.distributed).

    ``rows`` holds ``(step, sample indices or None, outputs)``. A rank's step ``s`` holds
    global batch ``s * world_size + rank`` (round-robin sharding); batches that carry sample
    indices (tensors, BucketIterator) are put back by index, along the batch ``axis`` (1 for
    time-major data; or one per output, ``fitdp.data.batch.output_axes``). Outputs of
    several lengths (a tagger over buckets) are padded at the end with ``pad_value`` to the
    longest; ``ragged`` returns one output per sample instead (the batch axis removed, each
    at its batch's length). ``kind``: the class of the module's dict of outputs; a
    transformers ``ModelOutput`` is given back as such (``preds.logits``, as after
    ``model(**batch)``), its padding -100 unless ``pad_value`` says otherwise (Trainer pads
    predictions so: ``padding_index=-100``).
    """
    keyed = [(s * ranks.world_size + ranks.rank, i, r) for s, i, r in rows]
    if ranks.enabled:
        keyed = sorted(ranks.gather_rows(keyed), key=lambda k: k[0])
    keyed = [k for k in keyed if k[2] is not None]
    if not keyed:
        raise ValueError("x: got no samples to predict on; expected at least one")
    rebuilt = _rebuilder(kind)
    if pad_value is None:
        pad_value = PAD_VALUE if rebuilt is None else MODEL_OUTPUT_PAD
    indexed = all(i is not None for _, i, _ in keyed)
    order = torch.argsort(torch.cat([i for _, i, _ in keyed])) if indexed else None
    if ragged:
        samples = [s for _, _, r in keyed for s in split_samples(r, axis)]
        samples = samples if order is None else [samples[i] for i in order.tolist()]
        return samples if rebuilt is None else [rebuilt(s) for s in samples]
    result = pad_cat([r for _, _, r in keyed], axis, pad_value)
    result = result if order is None else reorder(result, order, axis)
    return result if rebuilt is None else rebuilt(result)


def _rebuilder(kind: type | None) -> Callable[[dict[str, Any]], Any] | None:
    """How to give a plain dict of fields back as ``kind``: a dataclass mapping (a
    transformers ``ModelOutput``, whose fields not given stay None) is built from them;
    None for any other kind (a plain dict stays one)."""
    if kind is None or not (dataclasses.is_dataclass(kind) and issubclass(kind, Mapping)):
        return None
    return lambda fields: kind(**fields)
