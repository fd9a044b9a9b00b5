"""A checkpoint is a dict of objects that save themselves: what each entry holds, the checks
made before anything loads, and which file ``fit(resume=...)`` continues from."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from fitdp._version import __version__
from fitdp.checks import FitdpWarning, fail
from fitdp.compiled.optimizers import optimizer_kind_problem
from fitdp.executor.engine import Engine
from fitdp.executor.fsdp import is_shard
from fitdp.saving.checkpoint import (
    CheckpointError,
    capture_rng_state,
    remove_stale_temp_files,
    restore_rng_state,
)
from fitdp.saving.sharded import existing_checkpoint

log = logging.getLogger("fitdp")


class Stateful(Protocol):
    """What a checkpoint entry is: an object that saves and loads its own state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


Check = Callable[[Any, Mapping[str, Any]], str | None]


class Entry:
    """A checkpoint entry made of two functions, for state that has no object of its own;
    ``check(state, checkpoint)`` (optional) says why ``state`` cannot load (see ``restore``).

    Example:
        >>> box = {"n": 1}
        >>> e = Entry(lambda: box["n"], lambda s: box.update(n=s)); e.load_state_dict(5); box
        {'n': 5}
    """

    def __init__(self, save: Callable[[], Any], load: Callable[[Any], None],
                 check: Check | None = None) -> None:
        self.save, self.load, self.check = save, load, check

    def state_dict(self) -> Any:
        return self.save()

    def load_state_dict(self, state: Any) -> None:
        self.load(state)

    def problem(self, state: Any, checkpoint: Mapping[str, Any]) -> str | None:
        return self.check(state, checkpoint) if self.check is not None else None


class OptimizerState:
    """An optimizer's state, tagged with its class so another kind is refused on load.

    Args:
        optimizer: the compiled optimizer.
        engine: the engine of the replicas it is bound to, which holds its state (FSDP2's
            shards, ZeRO-1's partition) and says what a checkpoint holds of it; None: no
            replicas, the optimizer holds its own.
        whole: whole tensors (every checkpoint but a sharded one, where each rank writes
            what it holds).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine | None = None, *,
                 whole: bool = True) -> None:
        self.optimizer, self.engine, self.whole = optimizer, engine, whole

    def state_dict(self) -> dict[str, Any]:
        engine, optimizer = self.engine, self.optimizer
        state = engine.optimizer_state(optimizer, self.whole) if engine is not None \
            else optimizer.state_dict()
        return {**state, "fitdp_class": type(optimizer).__name__}

    def problem(self, state: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> str | None:
        return optimizer_kind_problem(self.optimizer, state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        plain = {k: v for k, v in state.items() if k != "fitdp_class"}
        if self.engine is not None:
            self.engine.load_optimizer_state(self.optimizer, plain)
        else:
            self.optimizer.load_state_dict(plain)


def _rng_problem(state: Any, checkpoint: Mapping[str, Any]) -> str | None:
    if {"torch", "python", "numpy"} - set(state):
        return "it is not a random state saved by fitdp (torch, python and numpy entries)"
    return None


RNG = Entry(capture_rng_state, restore_rng_state, _rng_problem)


class RankStates:
    """A checkpoint entry whose state is each rank's own under torchrun: its generators
    (``RNG``: ranks that draw different amounts, as dropout over batches of other lengths,
    leave theirs in different states) and its data path's (the generator states a loader's
    epoch is replayed from).

    Rank 0 alone writes: ``share`` (run on every rank by the saving callbacks, through
    ``model.share_epoch_logs``, before their save) gathers every rank's state, and the entry
    saves rank 0's with every rank's under ``ranks``. Resumed on as many ranks, each rank
    takes its own back; on another number of ranks (or from a save that ran on rank 0
    alone, or one process), every rank takes rank 0's, and where the saved ranks' states
    differed, rank 0 warns that they are not restored.

    Example:
        >>> from fitdp.call.ranks import Ranks
        >>> box = {"n": 1}
        >>> e = RankStates(Entry(lambda: dict(box), box.update), Ranks(rank=1, world_size=2))
        >>> e.problem({"n": 0, "ranks": [{"n": 0}, {"n": 7}]}, {})  # (checks rank 1's part)
        >>> e.load_state_dict({"n": 0, "ranks": [{"n": 0}, {"n": 7}]}); box
        {'n': 7}
    """

    def __init__(self, entry: Any, ranks: Any, what: str = "", *,
                 rank0_elsewhere: bool = True) -> None:
        self.entry, self.ranks, self.what = entry, ranks, what
        # On another number of ranks every rank takes rank 0's state, or (False) loads
        # none and keeps what the checkpoint's other entries gave it (an average).
        self.rank0_elsewhere = rank0_elsewhere
        self.shared: list[Any] | None = None  # every rank's state at the last share

    def share(self) -> None:
        """Every rank, before rank 0's save: gather every rank's state (a collective)."""
        if self.ranks.enabled:
            self.shared = self.ranks.gather_rows([_on_cpu(self.entry.state_dict())])

    def state_dict(self) -> Any:
        own = _on_cpu(self.entry.state_dict())
        shared = self.shared
        if not isinstance(own, Mapping) or shared is None or not _same(shared[0], own):
            return own  # one process, or not shared as of now: rank 0's alone
        return {**own, "ranks": shared}

    def _part(self, state: Any) -> Any:
        """This rank's part of ``state``: its own on as many ranks, else rank 0's."""
        if not isinstance(state, Mapping):
            return state
        parts = state.get("ranks")
        if isinstance(parts, list) and len(parts) == self.ranks.world_size:
            return parts[self.ranks.rank]
        return {k: v for k, v in state.items() if k != "ranks"}

    def problem(self, state: Any, checkpoint: Mapping[str, Any]) -> str | None:
        check = getattr(self.entry, "problem", None)
        return check(self._part(state), checkpoint) if check is not None else None

    def load_state_dict(self, state: Any) -> None:
        parts = state.get("ranks") if isinstance(state, Mapping) else None
        saved = len(parts) if isinstance(parts, list) else 1
        if (saved != self.ranks.world_size and self.ranks.is_main and isinstance(parts, list)
                and any(not _same(p, parts[0]) for p in parts)):
            start = "rank 0's" if self.rank0_elsewhere else "their average"
            warnings.warn(
                f"resume: the checkpoint holds the {self.what} of {saved} ranks, which "
                f"differ, and this run has {self.ranks.world_size}: every rank starts from "
                f"{start}, so the run does not continue the saved one exactly. Fix: resume "
                f"on {saved} ranks to continue it exactly (docs/checkpoints.md).",
                FitdpWarning, stacklevel=2)
        if saved != self.ranks.world_size and not self.rank0_elsewhere:
            return
        self.entry.load_state_dict(self._part(state))


def _same(a: Any, b: Any) -> bool:
    """Equal trees of states (tensors by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(u, v) for u, v in zip(a, b)))
    return bool(a == b)


class EpochLogs:
    """The training epoch's running loss sums, metric states and a custom step's other logs,
    as a checkpoint entry: a resume in the middle of an epoch goes on with them, so the
    epoch's logs (History, EarlyStopping, ``ModelCheckpoint(monitor=...)``) equal the
    uninterrupted run's.

    Saved only during the epoch's batches (``live``), as of the last optimizer step (the
    position a checkpoint resumes from): with gradient accumulation ``mark`` keeps that
    step's copy (a copy of the metric states per optimizer step; none without accumulation).

    Under torchrun every rank holds its own part of the sums, and rank 0 alone writes:
    ``share`` (run on every rank by the saving callbacks, before their save) gathers every
    rank's part, so the checkpoint holds them all by rank. Resumed on as many ranks, each
    rank takes its own part back (bit for bit); on another number of ranks, rank 0 takes
    them all (their sums are what the logs reduce over ranks).

    Args:
        manager: the executor manager (``loss_sums``, ``restore_loss``).
        metrics: the per-device metric clones (``state_dict``, ``load_state_dict``) or None.
        run: the run state (``micro_step``: batches since the last step; ``global_step``).
        step: a custom step (``logs_state``, ``load_logs_state``) or None.
        ranks: the call's ranks (``rank``, ``world_size``, ``gather_rows``).
    """

    def __init__(self, manager: Any, metrics: Any, run: Any, step: Any, ranks: Any) -> None:
        self.manager, self.metrics, self.run, self.step = manager, metrics, run, step
        self.ranks = ranks
        self.live = False
        self.marked: dict[str, Any] | None = None  # the last step's, with accumulation
        self.pending: dict[str, Any] | None = None  # loaded, for the resumed epoch
        self.shared: tuple[int, list[Any]] | None = None  # (global_step, every rank's part)

    def _now(self) -> dict[str, Any]:
        return {"loss": [[s.clone(), n.clone()] for s, n in self.manager.loss_sums()],
                "metrics": self.metrics.state_dict() if self.metrics else None,
                "steps": self.step.logs_state() if self.step is not None else None}

    def _own(self) -> dict[str, Any] | None:
        """This rank's part as of the last optimizer step (None: no step yet this epoch)."""
        return self._now() if self.run.micro_step == 0 else self.marked

    def mark(self) -> None:
        """An optimizer step ended: keep the logs as of it."""
        self.marked = self._now()

    def share(self) -> None:
        """Every rank, where a save is due: gather every rank's part (a collective; one
        process or outside the epoch's batches, where nothing is saved: nothing)."""
        if self.live and self.ranks.enabled:
            part = _on_cpu(self._own())  # (pickled: host tensors load on any rank)
            self.shared = (self.run.global_step, self.ranks.gather_rows([part]))

    def state_dict(self) -> dict[str, Any] | None:
        if not self.live:
            return None
        own = self._own()
        if own is None:
            return None
        if not self.ranks.enabled:
            return {"ranks": [own]}
        if self.shared is not None and self.shared[0] == self.run.global_step:
            return {"ranks": self.shared[1]}
        # A save that ran on rank 0 alone (not through share): the other parts are unknown.
        return {"ranks": [own] + [None] * (self.ranks.world_size - 1)}

    def problem(self, state: Any, checkpoint: Mapping[str, Any]) -> str | None:
        """Why ``state`` cannot go on in this call (its metrics are another model's)."""
        parts = state.get("ranks", [state])  # (a one-process save of an earlier version)
        if not isinstance(parts, list) or not parts:
            return "it is not an epoch's running logs"
        for part in parts:
            if part is None:  # a rank whose part a rank-0-only save could not know
                continue
            if not isinstance(part, dict) or not isinstance(part.get("loss"), list):
                return "it is not an epoch's running logs"
            if self.metrics and part.get("metrics") is not None:
                if (problem := self.metrics.state_problem(part["metrics"])) is not None:
                    return problem
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = state

    def begin(self) -> None:
        """A training epoch's batches begin (after its logs were reset): saved from now on,
        and in a fit resumed in the middle of this epoch, the loaded logs put back."""
        state, self.pending, self.marked, self.live = self.pending, None, None, True
        self.shared = None
        if state is None or not self.run.batch:
            return
        parts = state["ranks"] if "ranks" in state else [state]  # (a one-process save)
        if any(p is None for p in parts):
            if self.ranks.is_main:
                warnings.warn(
                    "resume: the checkpoint holds the running loss and metrics of rank 0 "
                    "only (model.save ran on rank 0 alone in the middle of an epoch), so the "
                    "resumed epoch's logs cover the batches after it. Fix: call "
                    "model.share_epoch_logs() on every rank before that save (ModelCheckpoint "
                    "and BackupAndRestore do), or save at an epoch's end.", FitdpWarning,
                    stacklevel=2)
            return
        if len(parts) == self.ranks.world_size:
            parts = [parts[self.ranks.rank]]
        elif not self.ranks.is_main:
            return  # another world size: rank 0 holds every saved rank's sums
        self.manager.restore_loss([pair for p in parts for pair in p["loss"]])
        if self.metrics and parts[0].get("metrics") is not None:
            self.metrics.load_state_dict([d for p in parts for d in p["metrics"]])
        if self.step is not None and parts[0].get("steps") is not None:
            self.step.load_logs_state([d for p in parts for d in p["steps"]])


class Skipped(NamedTuple):
    """What a ``strict=False`` load left out: names the model lacks in the file, names the
    file has that the model lacks, and names whose shape or dtype differ."""

    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]


def check_weights(ours: Mapping[str, torch.Tensor], given: Mapping[str, Any], *, origin: str,
                  strict: bool, error: type[Exception]) -> tuple[dict[str, torch.Tensor], Skipped]:
    """Match ``given`` weights against the model's, by name, shape and dtype, before any is
    written.

    Returns:
        The weights to load, and what was skipped (empty when ``strict``).

    Raises:
        ``error``: with ``strict``, at the first difference, naming ``origin`` and the tensor
            with both shapes and dtypes; a non-tensor entry always.
    """
    if not isinstance(given, Mapping):
        raise error(f"{origin}: got {type(given).__name__}; expected a dict of tensors by name")
    load: dict[str, torch.Tensor] = {}
    missing = [n for n in ours if n not in given]
    unexpected = [n for n in given if n not in ours]
    mismatched = []
    for name, mine in ours.items():
        if name not in given:
            continue
        theirs = given[name]
        if not isinstance(theirs, torch.Tensor):
            raise error(f"{origin}: entry {name!r} is {type(theirs).__name__}, not a tensor")
        if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            mismatched.append(name)
            if strict:
                raise error(
                    f"{origin}: tensor {name!r} has shape {tuple(theirs.shape)} "
                    f"({str(theirs.dtype).removeprefix('torch.')}) but the model's has "
                    f"{tuple(mine.shape)} ({str(mine.dtype).removeprefix('torch.')}); nothing "
                    f"was loaded. Fix: load weights of this architecture, or pass strict=False "
                    f"to load the tensors that match."
                )
            continue
        load[name] = theirs
    if strict and (missing or unexpected):
        which = (f"lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else
                 f"has {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}, which the model "
                 f"does not")
        raise error(f"{origin}: the weights {which}; nothing was loaded. Fix: load weights of "
                    f"this architecture, or pass strict=False to load the tensors that match.")
    return load, Skipped(missing, unexpected, mismatched)


def warn_skipped(skipped: Skipped, origin: str) -> None:
    parts = [f"{len(v)} {k} ({', '.join(v[:3])}{' ...' if len(v) > 3 else ''})"
             for k, v in skipped._asdict().items() if v]
    if parts:
        warnings.warn(f"{origin}: strict=False skipped " + "; ".join(parts), FitdpWarning,
                      stacklevel=3)


def snapshot(objects: Mapping[str, Stateful]) -> dict[str, Any]:
    """The checkpoint dict: every object's state (tensors on the CPU, so that a plain
    ``torch.load(weights_only=True)`` reads it on a machine without a GPU), and the fitdp
    version that wrote it. On the CPU nothing is copied."""
    state = {k: o.state_dict() for k, o in objects.items()}
    return {"fitdp_version": __version__, **_on_cpu(state)}


def _on_cpu(value: Any) -> Any:
    if is_shard(value):
        return value  # an FSDP2 shard: DCP copies it from its device (async: before return)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        return type(value)((k, _on_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def restore(objects: Mapping[str, Stateful], state: Mapping[str, Any], origin: str,
            *, required: Sequence[str] = ("module",), later: Sequence[str] = ()) -> None:
    """Load ``state`` into ``objects`` (those it has an entry for), after checking every
    entry first: a checkpoint that does not fit changes nothing.

    An object checks its entry with ``problem(state, checkpoint) -> str | None`` (the
    reason it cannot load, or None; the whole checkpoint for an entry that depends on
    another, like the data position on the run's); the module's weights raise their own
    error, naming the tensor.

    Args:
        objects: the checkpoint's objects by key, in load order.
        state: the loaded checkpoint.
        origin: the file, for messages.
        required: keys the checkpoint must have.
        later: keys that are checked now but loaded by the caller later (``fit`` loads the
            callbacks and the RNG after ``on_train_begin``).

    Raises:
        CheckpointError: an entry of ``required`` is missing, or an entry that does not fit
            this model or this call (another kind of optimizer, other optimizer names, a
            stream that cannot continue mid-epoch, ...).
    """
    for key in required:
        if key not in state:
            raise CheckpointError(f"{origin}: not a training checkpoint (no {key!r} entry)")
    for key, obj in objects.items():
        if state.get(key) is None:
            continue
        check = getattr(obj, "problem", None)
        # Every object's state_dict is a dict (torch's scheduler and GradScaler too).
        problem = (f"it is {type(state[key]).__name__}, not a state dict"
                   if not isinstance(state[key], Mapping) else
                   check(state[key], state) if check is not None else None)
        if problem:
            raise CheckpointError(f"{origin}: {key} state does not fit this model: "
                                  f"{problem}; nothing was loaded")
    for key, obj in objects.items():
        if state.get(key) is not None and key not in later:
            obj.load_state_dict(state[key])


def resume_path(resume: str | os.PathLike[str] | None, callbacks: Sequence[Any]) -> str | None:
    """The checkpoint ``fit`` should resume from.

    ``None``: a ``BackupAndRestore`` backup when one exists (Keras behaviour), else nothing.
    ``"latest"``: the newest complete checkpoint written by this fit's checkpoint callbacks
    (nothing when there is none yet: the run starts fresh). A path: that file.
    Stale temporary files left by a killed save are removed from those folders first.

    Raises:
        FileNotFoundError: an explicit path that does not exist.
        ValueError: ``"latest"`` with no checkpointing callback to look in, or a path that is
            a folder or a special file.
        TypeError: ``resume`` is not a path.
    """
    savers = [cb for cb in callbacks if callable(getattr(cb, "latest_checkpoint", None))]
    for cb in savers:
        folder = getattr(cb, "backup_dir", None) or os.path.dirname(
            os.path.abspath(getattr(cb, "filepath", ".")))
        if os.path.isdir(folder):
            remove_stale_temp_files(folder)
    if resume is None:
        found = [cb.resume_path() for cb in savers if callable(getattr(cb, "resume_path", None))]
        return next((p for p in found if p), None)
    if resume == "latest":
        if not savers:
            fail("resume", "latest", "ModelCheckpoint or BackupAndRestore callbacks in this fit "
                 "to look for checkpoints in", "pass those callbacks, or "
                 "resume='path/to/file.ckpt'")
        paths = [p for p in (cb.latest_checkpoint() for cb in savers) if p]
        if not paths:
            log.info("fitdp: resume='latest' found no checkpoint yet; starting from scratch")
            return None
        return max(paths, key=os.path.getmtime)
    return existing_checkpoint("resume", resume)
