"""What one drawn run is (a JSON-able description) and the hypothesis strategy that draws it.

A `Run` names everything that varies: where the batches come from, the devices and work
loads, the ranks, where the run is interrupted and how it resumes, what draws random numbers,
the loss and the callbacks. `harness_runner` builds and runs it; `harness_promises` says what
it must equal.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from hypothesis import strategies as st

# Data kinds. "loader_*" are torch DataLoaders, "stateful_*" torchdata's StatefulDataLoader,
# "grouped" a Dataset with fit(group_by_length=...).
RESUMABLE_KINDS = ("tensors", "dict", "dataset", "loader", "loader_generator",
                   "loader_sampler", "loader_workers", "stateful", "stateful_generator",
                   "buckets", "grouped")
KINDS = (*RESUMABLE_KINDS, "generator")
# Kinds whose batches may have another length per batch (padded to each batch's longest):
# the model then draws another amount of random numbers per batch (and per rank).
VARLEN_KINDS = ("loader", "loader_generator", "stateful", "buckets", "grouped")
# Kinds whose resume onto shorter data the harness draws (a StatefulDataLoader's is issue 37
# item 11, a separate refusal).
SHORTENABLE = ("tensors", "dict", "dataset", "loader")
RANDOMNESS = ("none", "dropout", "functional", "batchnorm")
CALLBACKS = ("none", "ema", "swa")

ROWS, VAL_ROWS, BATCH = 22, 8, 6  # 4 batches an epoch (6, 6, 6, 4)


@dataclass(frozen=True)
class Stop:
    """Where the first fit stops and how the run goes on.

    ``step``: the optimizer step after which it stops; ``at``: "batch" (right after that
    step's batch, before any validation) or "epoch_end" (after the epoch's validation; the
    step is then an epoch's last). ``how``: "checkpoint" (``ModelCheckpoint(save_freq=1)``,
    then ``fit(resume=<that step's file>)`` in a fresh Model) or "backup"
    (``BackupAndRestore(save_freq=every)`` and the same call run again).
    ``devices``/``ranks``: the resumed run's placement. ``short``: the resumed fit gets data
    too short for the checkpoint's position and must refuse it.
    """

    step: int
    at: str = "batch"
    how: str = "checkpoint"
    every: int = 1
    devices: int = 1
    loads: tuple[int, ...] | None = None
    ranks: int = 1
    short: bool = False


@dataclass(frozen=True)
class Run:
    """One drawn run (see the module docstring)."""

    kind: str = "tensors"
    varlen: bool = False
    shuffle: bool = True
    devices: int = 1
    loads: tuple[int, ...] | None = None
    ranks: int = 1
    randomness: str = "none"
    checkpointing: bool = False
    own_loss: bool = False
    loss_items: bool = False
    callback: str = "none"
    accum: int = 1
    reproducible: bool = False
    epochs: int = 2
    validation: bool = False
    stop: Stop | None = None
    width: int = 8  # the model's width (wider: longer kernels, more overlap between threads)

    @property
    def batch(self) -> int:
        """This process's batch size (under torchrun the global batch is split)."""
        return BATCH // self.ranks

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch (the same on any world size)."""
        if self.kind == "grouped":  # a short batch per bucket: the sampler says how many
            from harness_runner import grouped_batches

            return -(-grouped_batches(self.batch) // self.ranks)
        return -(-ROWS // BATCH)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: the global batches by ``accum`` (an epoch's last
        batches, fewer than ``accum``, step too)."""
        return -(-self.batches_per_epoch // self.accum)

    @property
    def last_step_after_a_batch(self) -> bool:
        """An epoch's last step follows its last batch's end; else (fewer than ``accum``
        batches left) it is taken as the epoch ends, after every batch's callbacks."""
        return self.batches_per_epoch % self.accum == 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Run:
        raw = json.loads(text)
        stop = raw.pop("stop")
        for d in (raw, stop or {}):
            if d.get("loads") is not None:
                d["loads"] = tuple(d["loads"])
        return Run(**raw, stop=Stop(**stop) if stop else None)


def _loads(devices: int) -> st.SearchStrategy[tuple[int, ...] | None]:
    if devices == 1:
        return st.none()
    return st.none() | st.tuples(*[st.integers(1, 3)] * devices)


@st.composite
def stops(draw: st.DrawFn, run: Run) -> Stop | None:
    """An interruption of ``run`` (or none), at any optimizer step of any epoch."""
    steps_per_epoch = run.steps_per_epoch
    total = steps_per_epoch * run.epochs
    if not draw(st.booleans()):
        return None
    # a one-shot generator continues only from an epoch's end (data.md, Streams)
    at = "epoch_end" if run.kind == "generator" else draw(st.sampled_from(["batch", "epoch_end"]))
    if at == "epoch_end":
        step = steps_per_epoch * draw(st.integers(1, run.epochs))
    else:
        step = draw(st.integers(1, total))
        if step % steps_per_epoch == 0 and not run.last_step_after_a_batch:
            at = "epoch_end"  # no batch ends after that step
    how = draw(st.sampled_from(["checkpoint", "backup"]))
    if run.kind == "generator":
        how = "checkpoint"  # a backup of every N steps may be mid-epoch
    every = draw(st.integers(1, 3)) if how == "backup" else 1
    devices, loads, ranks = run.devices, run.loads, run.ranks
    if draw(st.booleans()):  # resume on another placement
        if run.ranks > 1:
            ranks = 1
        else:
            devices = draw(st.integers(1, 3))
            loads = draw(_loads(devices))
    # too short: the resume gets one batch, the checkpoint is 2 batches or more into its epoch
    short = (at == "batch" and how == "checkpoint" and run.kind in SHORTENABLE
             and (step % steps_per_epoch) * run.accum >= 2 and draw(st.booleans()))
    return Stop(step=step, at=at, how=how, every=every, devices=devices, loads=loads,
                ranks=ranks, short=short)



@st.composite
def runs(draw: st.DrawFn, ranks: int = 1) -> Run:
    """A whole run: data, placement, randomness, loss, callbacks, interruption."""
    kind = draw(st.sampled_from(KINDS if ranks == 1 else
                                [k for k in RESUMABLE_KINDS if k != "loader_workers"]))
    if kind == "loader_workers" and draw(st.integers(0, 3)):  # workers are slow: rarely
        kind = "loader"
    own_loss = kind in ("dict", "dataset", "loader", "stateful", "generator", "grouped") and draw(
        st.booleans())
    devices = draw(st.integers(1, 3)) if ranks == 1 else draw(st.integers(1, 2))
    randomness = draw(st.sampled_from(RANDOMNESS))
    reproducible = draw(st.booleans()) and kind in ("tensors", "dict") and not own_loss
    varlen = kind in VARLEN_KINDS and draw(st.booleans())
    run = Run(
        kind=kind,
        varlen=varlen,
        shuffle=draw(st.booleans()),
        devices=devices,
        loads=draw(_loads(devices)),
        ranks=ranks,
        randomness=randomness,
        checkpointing=randomness != "batchnorm" and not reproducible and draw(st.booleans()),
        own_loss=own_loss,
        loss_items=own_loss and draw(st.booleans()),
        callback=draw(st.sampled_from(CALLBACKS)),
        accum=draw(st.sampled_from([1, 1, 2])),
        reproducible=reproducible,
        epochs=draw(st.integers(1, 3)),
        validation=draw(st.booleans()),
    )
    return replace(run, stop=draw(stops(run)))
