"""What a training checkpoint holds, and how ``fit(resume=...)`` puts it back."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fitdp.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    remove_stale_temp_files,
)

if TYPE_CHECKING:
    from fitdp.callbacks import CallbackList
    from fitdp.model import Model

log = logging.getLogger("fitdp")


def training_state(model: Model) -> dict[str, Any]:
    """Everything needed to continue ``model``'s run exactly: weights (averaged over devices),
    optimizer/scheduler/scaler state, position in the run, data order and RNG states."""
    from fitdp import __version__

    engine = model._engine
    progress = model._progress
    if engine is not None:
        engine.detach()  # average the replicas into the host module, in place
    state: dict[str, Any] = {
        "fitdp_version": __version__,
        # The host tensors themselves, no copy: torch.save writes them before returning.
        "module": model.module.state_dict(),
        "global_step": model.global_step,
        "epoch": progress.resume_epoch,
        "data": progress.source.state_dict() if progress.source is not None else None,
        "callbacks": _callback_states(progress.callbacks),
        "rng": capture_rng_state(),
        "devices": [],
    }
    if engine is not None:
        state["devices"] = [str(d) for d in engine.mgr.devices] if engine.mgr else []
        state["optimizer"] = engine.optimizer.state_dict() if engine.optimizer else None
        state["scheduler"] = engine.scheduler.state_dict() if engine.scheduler else None
        state["scaler"] = engine.scaler.state_dict() if engine.scaler else None
    return state


def restore_weights(model: Model, state: dict[str, Any]) -> None:
    """Weights into the host module and every replica; optimizer, scheduler and scaler state
    into the engine when it has them (Caffe2's ``FinalizeAfterCheckpoint``)."""
    model.set_weights(state["module"])
    if model._engine is not None:
        model._engine.load_training_state(state)


def resume_path(resume: str | os.PathLike[str] | None, callbacks: Sequence[Any]) -> str | None:
    """The checkpoint ``fit`` should resume from.

    ``None``: a ``BackupAndRestore`` backup when one exists (Keras behaviour), else nothing.
    ``"latest"``: the newest complete checkpoint written by this fit's checkpoint callbacks
    (nothing when there is none yet: the run starts fresh). A path: that file.
    Stale temporary files left by a killed save are removed from those folders first.

    Raises:
        FileNotFoundError: an explicit path that does not exist.
        ValueError: ``"latest"`` with no checkpointing callback to look in.
    """
    savers = [cb for cb in callbacks if hasattr(cb, "latest_checkpoint")]
    for cb in savers:
        folder = getattr(cb, "backup_dir", None) or os.path.dirname(
            os.path.abspath(getattr(cb, "filepath", "."))
        )
        if os.path.isdir(folder):
            remove_stale_temp_files(folder)
    if resume is None:
        found = [cb.resume_path() for cb in savers if hasattr(cb, "resume_path")]
        return next((p for p in found if p), None)
    if resume == "latest":
        if not savers:
            raise ValueError(
                "resume: 'latest' looks for checkpoints written by this fit's ModelCheckpoint or "
                "BackupAndRestore callbacks, but there are none. Fix: pass those callbacks, or "
                "resume='path/to/file.ckpt'."
            )
        paths = [p for p in (cb.latest_checkpoint() for cb in savers) if p]
        if not paths:
            log.info("fitdp: resume='latest' found no checkpoint yet; starting from scratch")
            return None
        return max(paths, key=os.path.getmtime)
    path = os.fspath(resume)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"resume: no checkpoint at {path!r}")
    return path


def load_for_resume(
    path: str, model: Model, source: Any, callbacks: CallbackList
) -> tuple[int, dict[str, Any]]:
    """Restore a run from ``path``; returns the epoch to continue at and the RNG state to put
    back right before the first batch."""
    state = load_checkpoint(path)
    restore_weights(model, state)
    model.global_step = int(state["global_step"])
    if state.get("data") is not None:
        source.load_state_dict(state["data"])
    saved = state.get("callbacks") or {}
    for key, cb in _keyed(callbacks.callbacks):
        if key in saved and hasattr(cb, "load_state_dict"):
            cb.load_state_dict(saved[key])
    log.info("fitdp: resumed from %s (epoch %d, step %d)", path, state["epoch"], model.global_step)
    return int(state["epoch"]), state["rng"]


def _keyed(callbacks: Sequence[Any]) -> list[tuple[str, Any]]:
    """Stable keys for callbacks: class name and its index among callbacks of that class."""
    counts: dict[str, int] = {}
    out = []
    for cb in callbacks:
        name = type(cb).__name__
        out.append((f"{name}:{counts.get(name, 0)}", cb))
        counts[name] = counts.get(name, 0) + 1
    return out


def _callback_states(callbacks: CallbackList | None) -> dict[str, Any]:
    if callbacks is None:
        return {}
    states = {k: cb.state_dict() for k, cb in _keyed(callbacks.callbacks)
              if callable(getattr(cb, "state_dict", None))}
    return {k: v for k, v in states.items() if isinstance(v, dict) and v}
