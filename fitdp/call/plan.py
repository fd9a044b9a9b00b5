"""Each call's arguments, checked and turned into what the call runs on, before anything
changes: the data sources, callbacks, placement and options of ``fit``/``evaluate``/
``predict``. A bad argument raises here, naming it."""

from __future__ import annotations

import dataclasses
import enum
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fitdp.call.first_batch import ForwardArguments
from fitdp.call.monitor import Monitor
from fitdp.call.ranks import DEFAULT_TIMEOUT, Ranks
from fitdp.call.replicas import Placement
from fitdp.callbacks import Callback, CallbackList, Profiler, WeightAveraging
from fitdp.checks import FitdpWarning, check_choice, check_int, check_number, fail
from fitdp.data.sources import DataSource
from fitdp.data.sources.make import Kind, UserData, batched_from_rows, read_data
from fitdp.executor.batchnorm_rows import check_batchnorm_rows
from fitdp.executor.devices import DevicesArg, pin_host_batches, resolve_devices
from fitdp.executor.slicing import check_work_load_arg
from fitdp.saving.entries import resume_path


@dataclasses.dataclass
class CallPlan:
    """What every call runs on."""

    source: DataSource
    callbacks: CallbackList
    placement: Placement
    steps: int | None = None
    user_source: bool = False  # the source is the user's object: give it back unmoved
    borrowed: tuple[DataSource, ...] = ()  # user sources a call only reads: put back after
    auto_loads: bool = False  # work_load_list="auto": the manager measures the loads
    timeout: float = DEFAULT_TIMEOUT  # seconds a collective may wait for the other ranks
    # (name, amounts of data) of each source, compared across ranks when the call joins
    amounts: tuple[tuple[str, dict[str, int | None]], ...] = ()
    # the module's forward, whose names the first dict batch's keys are checked against
    forward: ForwardArguments | None = None

    @property
    def ranks(self) -> Ranks:
        return self.placement.ranks

    def join(self) -> None:
        """Join torchrun's job and compare every rank's amounts of data: the checks that need
        the other ranks, run when the call attaches (checking arguments joins nothing).

        Raises:
            ValueError: ranks with different amounts of data, on every rank, naming each.
        """
        self.ranks.join(self.placement.devices, self.timeout)
        for name, counts in self.amounts:
            self.ranks.check_even(name, counts)


@dataclasses.dataclass
class FitPlan(CallPlan):
    """What ``fit`` runs on, beyond ``CallPlan``."""

    epochs: int = 1
    initial_epoch: int = 0
    val: DataSource | None = None
    val_steps: int | None = None
    val_freq: int | Sequence[int] = 1
    seed: int | None = None
    monitor: Monitor | None = None
    resume: str | None = None
    log_every: int = 50
    micro_batch_size: int | None = None  # fit(reproducible=True): its micro-batches' rows

    def validates(self, epoch: int) -> bool:
        """Keras's ``validation_freq``: every N epochs (1-based), or the listed epochs."""
        if self.val is None:
            return False
        if isinstance(self.val_freq, int):
            return (epoch + 1) % self.val_freq == 0
        return epoch + 1 in self.val_freq


class Whole(enum.Enum):
    """The batch of a call that takes its in-memory data in one step (Keras's
    ``train_on_batch``, ``test_on_batch``, ``predict_on_batch``)."""

    ROWS = "every row"


WHOLE = Whole.ROWS


DEFAULT_BATCH_SIZE = 32  # fit/evaluate/predict's batch_size=None, for data fitdp batches


def _batch_size(batch_size: int | Whole | None, data: UserData) -> int | Whole:
    """The batch size of data fitdp batches (None: 32). Data that makes its own batches of a
    known size (a DataLoader's ``batch_size``, a BucketIterator's) would ignore another
    one, so that is refused: Keras's fit says not to pass it for such data, and refuses
    the other arguments such data holds itself (``y``, ``sample_weight``)."""
    if batch_size is None:
        return DEFAULT_BATCH_SIZE
    own = _own_batch_size(data, batch_size)
    if data.kind in (Kind.BATCHES, Kind.GENERATOR, Kind.SOURCE) and own is not None \
            and not isinstance(batch_size, Whole) and own != batch_size:
        fail("batch_size", batch_size, f"None or {own}: x is {data.kind.value}, which "
             f"makes its own batches of {own} rows", "drop batch_size=..., and set the "
             "batch size where the batches are made (DataLoader(..., batch_size=...))")
    return batch_size


def _own_batch_size(data: UserData, batch_size: int | Whole) -> int | None:
    """The batch size callbacks are told (``params["batch_size"]``): the call's, or the
    DataLoader's own for data that makes its own batches (None when unknown)."""
    if data.kind in (Kind.BATCHES, Kind.GENERATOR, Kind.SOURCE):
        own = getattr(data.x, "batch_size", None)
        return own if isinstance(own, int) and not isinstance(own, bool) else None
    return batch_size if isinstance(batch_size, int) else None


def plan_fit(model: Any, x: Any, y: Any, sample_weight: Any, *, batch_size: int | Whole | None,
             epochs: int, verbose: Any, callbacks: Any, validation_split: Any, validation_data: Any,
             shuffle: bool, class_weight: Any, initial_epoch: int, steps_per_epoch: Any,
             validation_steps: Any, validation_batch_size: Any, validation_freq: Any,
             devices: DevicesArg, work_load_list: Any, seed: Any, monitor: Any, resume: Any,
             log_every: int, timeout: Any, reproducible: Any = False,
             micro_batch_size: Any = None, collate_fn: Any = None,
             group_by_length: Any = False) -> FitPlan:
    """``fit``'s arguments checked and its data read once; ``batch_size=WHOLE``: one batch of
    every row of in-memory data (``train_on_batch``)."""
    for name, value, low in (("batch_size", batch_size, 1), ("epochs", epochs, 0),
                             ("initial_epoch", initial_epoch, 0), ("log_every", log_every, 1)):
        if not isinstance(value, Whole) and not (name == "batch_size" and value is None):
            check_int(name, value, low)
    steps = None if steps_per_epoch is None else _steps("steps_per_epoch", steps_per_epoch)
    val_steps = None if validation_steps is None else _steps("validation_steps",
                                                             validation_steps)
    val_freq = _validation_freq(validation_freq)
    if monitor is not None and not isinstance(monitor, Monitor):
        fail("monitor", monitor, "a fitdp.Monitor", error=TypeError)
    if not isinstance(shuffle, bool):
        check_choice("shuffle", shuffle, (True, False))
    check_number("timeout", timeout, low=0, low_open=True, fix="pass seconds, e.g. timeout=600")
    seed = _seed(seed)
    split = _splits(validation_split)
    if split and validation_data is not None:
        fail("validation_split", validation_split, "validation_split or validation_data, "
             "not both", "drop one of them")
    forward = ForwardArguments.of(model)
    keep = forward.columns if forward is not None else None
    data = read_data(x, y, sample_weight, labels_optional=model.labels_optional,
                     collate_fn=collate_fn, keep=keep, group_by_length=group_by_length)
    batch_size = _batch_size(batch_size, data)
    if isinstance(batch_size, Whole):
        batch_size = data.rows()
    val_batch = batch_size if validation_batch_size is None else check_int(
        "validation_batch_size", validation_batch_size, 1)
    micro = _micro_batch_size(model, reproducible, micro_batch_size, batch_size)
    val_data: UserData | None = None
    if split:  # cut from the tensors read once
        data, val_data = data.split(validation_split)
    placement, auto = _place(model, devices, work_load_list, batch_size)
    ranks = placement.ranks
    pin = pin_host_batches(placement.devices)
    train = data.source(batch_size=batch_size, shuffle=shuffle, seed=seed,
                        class_weight=class_weight, rank=ranks.rank, world_size=ranks.world_size,
                        pin_memory=pin, rank_unit=micro or 1)
    if train.plan().rows_per_step is not None:  # in-memory tensors: every batch's rows known
        check_batchnorm_rows(model.module, samples=None if steps else train.plan().num_samples,
                             batch_size=batch_size, devices=placement.devices,
                             loads=None if auto else placement.work_load_list,
                             micro_batch_size=micro, world_size=ranks.world_size)
    num = train.num_batches
    if (steps is None and epochs - initial_epoch > 1 and num is None
            and data.kind is Kind.GENERATOR):
        fail("x", f"a one-shot iterator ({type(x).__name__})", f"data that can be iterated "
             f"{epochs - initial_epoch} times, or steps_per_epoch", "pass steps_per_epoch= "
             "(an endless generator trains as long as asked), a list, a DataLoader or a "
             "re-iterable object", described=True)
    if validation_data is not None:
        val_data = _validation_data(validation_data, model.labels_optional, collate_fn, keep)
    val = None if val_data is None else val_data.source(
        batch_size=val_batch, shuffle=False, seed=seed, rank=ranks.rank,
        world_size=ranks.world_size, pin_memory=pin, rank_unit=micro or 1)
    amounts = [("x", _amounts(train))]
    if val is not None:
        amounts.append(("validation_data", _amounts(val)))
    cbs = _callbacks(model, callbacks, verbose, epochs=epochs,
                     batch_size=_own_batch_size(data, batch_size), steps=steps or num)
    for cb in cbs:  # what each callback can check before the first step (paths, fields)
        check_fit = getattr(cb, "check_fit", None)
        if check_fit is not None:
            check_fit({**cbs.params, "validates": val is not None,
                       "initial_epoch": initial_epoch})
    return FitPlan(
        source=train, callbacks=cbs, placement=_bucketed(placement, train),
        steps=steps, user_source=_users(data), epochs=epochs, initial_epoch=initial_epoch,
        borrowed=(val,) if val is not None and _users(val_data) else (),
        auto_loads=auto, timeout=timeout, amounts=tuple(amounts),
        val=val, val_steps=val_steps, val_freq=val_freq, seed=seed, monitor=monitor,
        resume=resume_path(resume, cbs.callbacks), log_every=log_every,
        micro_batch_size=micro, forward=forward,
    )


def _micro_batch_size(model: Any, reproducible: Any, micro_batch_size: Any,
                      batch_size: int) -> int | None:
    """``fit(reproducible=..., micro_batch_size=...)`` checked: the micro-batch rows of a
    reproducible fit, or None for the ordinary step."""
    if not isinstance(reproducible, bool):
        fail("reproducible", reproducible, "True or False", error=TypeError)
    if not reproducible:
        if micro_batch_size is not None:
            fail("micro_batch_size", micro_batch_size, "None without reproducible=True "
                 "(micro-batches are how the reproducible mode cuts each batch)",
                 f"pass reproducible=True, micro_batch_size={micro_batch_size!r}, or drop "
                 f"micro_batch_size")
        return None
    if micro_batch_size is None:
        fail("micro_batch_size", None, f"an int that divides batch_size={batch_size} with "
             f"reproducible=True", f"pass e.g. micro_batch_size="
             f"{next(k for k in (8, 4, 2, 1) if batch_size % k == 0)}")
    micro = check_int("micro_batch_size", micro_batch_size, 1,
                      fix="pass a positive int that divides batch_size")
    if batch_size % micro:
        divisors = [k for k in range(1, batch_size + 1) if batch_size % k == 0]
        fail("micro_batch_size", micro, f"an int that divides batch_size={batch_size} "
             f"(one of {divisors[:12]}{' ...' if len(divisors) > 12 else ''})",
             "pick a divisor of batch_size, or a batch_size that is a multiple of it")
    if getattr(model, "steps_overridden", False):
        fail("reproducible", True, "the built-in step (a Model that overrides train_step, "
             "test_step or compute_loss runs its own step, which fitdp cannot cut into "
             "micro-batches)", "reproducible=False for this model")
    return micro  # (FSDP2 is refused when the step is bound: ``ReproducibleStep``)


def plan_call(model: Any, x: Any, y: Any, sample_weight: Any, *,
              batch_size: int | Whole | None, verbose: Any, callbacks: Any, steps: Any,
              devices: DevicesArg, has_labels: bool, work_load_list: Any = None,
              collate_fn: Any = None) -> CallPlan:
    """``evaluate`` (``has_labels``) or ``predict``; ``batch_size=WHOLE``: one batch of every
    row of in-memory data (``test_on_batch``, ``predict_on_batch``)."""
    if not isinstance(batch_size, Whole) and batch_size is not None:
        check_int("batch_size", batch_size, 1)
    steps = None if steps is None else _steps("steps", steps)
    placement, auto = _place(model, devices, work_load_list, None)
    ranks = placement.ranks
    forward = ForwardArguments.of(model)
    data = read_data(x, y, sample_weight, has_labels=has_labels,
                     labels_optional=model.labels_optional, collate_fn=collate_fn,
                     keep=forward.columns if forward is not None else None)
    batch_size = _batch_size(batch_size, data)
    if isinstance(batch_size, Whole):
        batch_size = data.rows()
    source = data.source(batch_size=batch_size, shuffle=False, seed=0, rank=ranks.rank,
                         world_size=ranks.world_size,
                         pin_memory=pin_host_batches(placement.devices))
    cbs = _callbacks(model, callbacks, verbose, steps=steps or source.num_batches,
                     batch_size=_own_batch_size(data, batch_size))
    return CallPlan(source=source, callbacks=cbs, placement=_bucketed(placement, source),
                    steps=steps, user_source=_users(data),
                    borrowed=(source,) if _users(data) else (), auto_loads=auto,
                    amounts=(("x", _amounts(source)),), forward=forward)


def _place(model: Any, devices: DevicesArg, work_load_list: Any, batch_size: int | None
           ) -> tuple[Placement, bool]:
    """Devices, work loads and this process's rank, resolved once for the call (nothing is
    joined yet). With ``work_load_list="auto"`` the placement has equal loads and the call
    measures them."""
    devs = resolve_devices(devices)
    checked = check_work_load_arg(work_load_list, len(devs))
    auto = isinstance(checked, str)
    loads = [1.0] * len(devs) if isinstance(checked, str) else checked
    if batch_size is not None and batch_size < len(devs):
        fail("batch_size", batch_size, f"at least one sample per device for {len(devs)} "
             f"devices {[str(d) for d in devs]}", f"batch_size >= {len(devs)}, or fewer devices")
    ranks = Ranks.from_env()
    model.is_main_process = ranks.is_main  # before callbacks ask the model
    return Placement(tuple(devs), tuple(loads), ranks), auto


def _amounts(source: DataSource) -> dict[str, int | None]:
    return {"samples": source.plan().num_samples, "batches": source.num_batches}


def _bucketed(placement: Placement, source: DataSource) -> Placement:
    return dataclasses.replace(placement, default_bucket_key=source.plan().default_bucket_key)


def _callbacks(model: Any, callbacks: Any, verbose: Any, **params: Any) -> CallbackList:
    level = 1 if verbose == "auto" else verbose
    if isinstance(level, bool) or level not in (0, 1, 2):
        fail("verbose", verbose, "'auto', 0 (silent), 1 (progress bar) or 2 (one line per "
             "epoch)")
    if callbacks is None:
        callbacks = []
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Sequence):
        fail("callbacks", callbacks, "a list of fitdp.callbacks.Callback instances",
             "wrap it in a list: callbacks=[...]", error=TypeError)
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            what = "the class itself" if isinstance(cb, type) else type(cb).__name__
            fail(f"callbacks[{i}]", what, "a fitdp.callbacks.Callback instance",
                 "pass an instance, e.g. EarlyStopping(), or wrap a function in "
                 "LambdaCallback", error=TypeError, described=True)
    averaging = [type(cb).__name__ for cb in callbacks if isinstance(cb, WeightAveraging)]
    if len(averaging) > 1:
        fail("callbacks", f"{len(averaging)} weight-averaging callbacks ({', '.join(averaging)})",
             "at most one EMA or SWA (each loads its average into the model when fit ends)",
             "keep one of them", described=True)
    profilers = sum(isinstance(cb, Profiler) for cb in callbacks)
    if profilers > 1:  # torch runs one profiler session at a time: two crashed (SIGSEGV)
        fail("callbacks", f"{profilers} Profiler callbacks", "at most one Profiler (torch "
             "runs one profiler at a time)", "keep one; its wait/warmup/active/repeat schedule "
             "can record several windows", described=True)
    params.setdefault("resumed", None)
    return CallbackList(list(callbacks), model=model, add_history=True,
                        add_progbar=bool(level) and model.is_main_process, verbose=level,
                        params={"verbose": level, **params})


def _steps(name: str, steps: Any) -> int:
    """A batch count: at least 1, and one ``itertools.islice`` can count to."""
    return check_int(name, steps, 1, maximum=sys.maxsize)


def _seed(seed: Any) -> int:
    """The data-order seed: ``seed``, or one drawn from torch's global RNG so that
    ``torch.manual_seed`` makes the order reproducible."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    # torch.manual_seed's range (it takes a 64-bit seed, signed or not)
    return check_int("seed", seed, -(2**63), maximum=2**64 - 1)


def _splits(fraction: Any) -> bool:
    """Whether ``validation_split`` asks for a split: 0 (and None) do not; anything else must
    be a fraction in (0, 1) (an empty list is falsy but no fraction: refused, not ignored)."""
    if fraction is None or (isinstance(fraction, (int, float)) and not isinstance(
            fraction, bool) and fraction == 0):
        return False
    check_number("validation_split", fraction, low=0, high=1, low_open=True, high_open=True,
                 fix="pass a fraction such as 0.2, or 0 for no split")
    return True


def _validation_freq(freq: Any) -> int | Sequence[int]:
    if isinstance(freq, (list, tuple, range, set)):
        return [check_int("validation_freq", f, 1) for f in freq]
    return check_int("validation_freq", freq, 1, fix="pass an int N (every N epochs) or a "
                     "list of epochs (1-based)")


def _validation_data(data: Any, optional: bool, collate_fn: Any,
                     keep: frozenset[str] | None) -> UserData:
    """``validation_data``: ``(x, y[, sample_weight])`` or data that yields its own targets
    (rows batched by ``fit``'s ``collate_fn``, as Trainer's ``data_collator`` batches both;
    in-memory tensors or a DataLoader are used as they are)."""
    x, y, w = data, None, None
    if isinstance(data, tuple) and len(data) in (2, 3):
        x, y, w = (*data, None) if len(data) == 2 else data
    return read_data(x, y, w, name="validation_data", labels_optional=optional,
                     collate_fn=collate_fn if batched_from_rows(x) else None, keep=keep)


def _users(data: UserData | None) -> bool:
    """The data is the user's own source: the call gives it back as it found it."""
    return data is not None and data.kind is Kind.SOURCE


def legacy_data(x: Any, kwargs: Mapping[str, Any], method: str) -> Any:
    """``data=`` (before the parity round) as a deprecated spelling of ``x=``."""
    unknown = sorted(set(kwargs) - {"data"})
    if unknown:
        raise TypeError(f"Model.{method}() got an unexpected keyword argument {unknown[0]!r}")
    if "data" not in kwargs:
        return x
    if x is not None:
        fail("data", "both x= and data=", "one of them (data= is the old name of x=)",
             "pass x= only", error=TypeError, described=True)
    warnings.warn(f"Model.{method}(data=...) is deprecated; pass x=... (Keras's name)",
                  FitdpWarning, stacklevel=3)
    return kwargs["data"]

