"""Sharded checkpoints (``strategy="fsdp"``): one folder in which every rank writes its own
shards of the weights and optimizer state through ``torch.distributed.checkpoint`` and rank 0
alone writes the rest (run position, callbacks, RNG, schedules) as an ordinary fitdp file.

Layout (``fitdp.executor.sharded_io``), ``<n>`` the global step::

    path/LATEST                 names the newest complete step-<n> (replaced atomically)
    path/step-<n>/state.ckpt    rank 0's part: the checkpoint dict, each tensor of the
                                weights and optimizer state replaced by a reference
    path/step-<n>/.metadata     DCP's index of the shards, written by rank 0
    path/step-<n>/__<r>_0.distcp  rank r's shards
    path/step-<n>/checksums.json  size and CRC-32 of each file above, written last

Loading checks every file against ``checksums.json`` first (a ``CheckpointError`` naming
the file, before anything is read into the model; a file it does not list is refused too),
then reads the reference file and the shards as whole tensors (DCP reshards them to any
layout), so the loaded dict is the one an unsharded checkpoint holds: it loads on any world
size and into one process, through the same checks. No byte of the folder is unpickled by
anything that can run code: the reference file by ``torch.load(weights_only=True)``, DCP's
``.metadata`` by an unpickler admitting only DCP's index types, the shards by DCP's
``torch.load(weights_only=True)`` (``sharded_io.read_metadata``).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from fitdp.checks import check_path, fail
from fitdp.executor import sharded_io
from fitdp.saving.checkpoint import check_state, load_checkpoint, write_checkpoint
from fitdp.saving.seal import CheckpointError

__all__ = ["existing_checkpoint", "is_checkpoint", "is_sharded", "load_sharded",
           "read_state", "remove_checkpoint", "save_sharded",
           "sharded_path", "verify_sharded"]

REST = "state.ckpt"
SHARD = "__fitdp_shard__"  # the key of a reference to a tensor written by DCP
SHARDED_ENTRIES = ("module", "optimizer")  # the entries whose tensors DCP writes


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder holding a sharded checkpoint: its ``LATEST`` file names
    the newest complete step (a damaged ``LATEST`` too: loading it says what is wrong)."""
    return os.path.isfile(os.path.join(path, sharded_io.LATEST))


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A checkpoint file, or a complete sharded checkpoint folder."""
    return os.path.isfile(path) or is_sharded(path)


def existing_checkpoint(name: str, path: Any) -> str:
    """``path`` as a string naming a checkpoint to read: a file, or a sharded folder.

    Raises:
        TypeError: not a path. FileNotFoundError: nothing there. ValueError: a folder of
            something else, or a special file. CheckpointError: a folder of step folders
            without ``LATEST`` (what a first save that did not finish leaves).
    """
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        steps = sorted(e for e in os.listdir(path) if e.startswith("step-"))
        if not is_sharded(path) and steps:
            raise CheckpointError(
                f"{os.fspath(path)}: no complete sharded checkpoint: no {sharded_io.LATEST} "
                f"file names one, so {steps[0]} is what a save that did not finish (killed, "
                f"or failed) left; resume from an earlier checkpoint")
        if not is_sharded(path):
            fail(name, os.fspath(path), "a checkpoint file, or a folder holding a complete "
                 f"sharded checkpoint (a {sharded_io.LATEST} file)", "pass the checkpoint "
                 "itself (a folder without LATEST holds no complete sharded save)")
        return os.fspath(path)
    return check_path(name, path, must_exist=True)


def sharded_path(name: str, path: Any) -> str:
    """``path`` as a string naming a sharded checkpoint folder to write: new, or one a
    sharded save made (it may hold the leftovers of a killed save).

    Raises:
        TypeError: not a path. ValueError: an existing file, or a folder of something else.
    """
    text = check_path(name, path) if not os.path.isdir(path) else os.fspath(path)
    if os.path.isfile(text):
        fail(name, text, "a folder for a sharded checkpoint (strategy='fsdp' saves one), not "
             "an existing file", "save to a new path, or pass sharded=False for one file")
    if os.path.isdir(text) and not all(e.startswith(("step-", sharded_io.LATEST, "."))
                                       for e in os.listdir(text)):
        fail(name, text, "a new folder or one a sharded save wrote (LATEST, step-<n>)",
             "save to a new path; fitdp never writes into a folder of other files")
    return text


def save_sharded(path: str, state: dict[str, Any], *, step: int, async_save: bool = False
                 ) -> Future[None] | None:
    """Write the checkpoint dict ``state`` as ``path/step-<step>`` (``step``: the global
    step), a sharded checkpoint (every rank calls it with its own shards; rank 0's non-tensor
    state is the one kept). With ``async_save`` the shards are copied to host memory before
    this returns and written by DCP's thread; the future completes once ``LATEST`` names
    them."""
    rest, shards = _split(state)
    check_state(rest)  # refused before any folder is made

    def write_rest(target: Path) -> None:
        write_checkpoint(str(target / REST), rest, sharded=True)

    return sharded_io.save(path, step, shards, async_save=async_save, before=write_rest)


def load_sharded(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint dict a sharded checkpoint holds, every tensor whole (on every rank that
    calls it, with no collective).

    Raises:
        CheckpointError: no complete checkpoint, or one of its files is missing, damaged,
            not listed in its checksums, or asks for more than tensors (the message names
            it; checked before any tensor is read).
    """
    step = _checked_step(path)
    rest = load_checkpoint(os.path.join(step, REST))
    shards: dict[str, torch.Tensor] = {}
    _collect(rest, shards)
    try:
        sharded_io.load(path, shards)
    except sharded_io.RefusedFile as exc:  # a LATEST replaced since _checked_step read it
        raise CheckpointError(str(exc)) from exc
    return _join(rest, shards)


def read_state(path: str) -> dict[str, Any]:
    """A checkpoint's dict, from a file or a sharded folder."""
    return load_sharded(path) if os.path.isdir(path) else load_checkpoint(path)


def verify_sharded(path: str | os.PathLike[str]) -> None:
    """Check every file of the sharded checkpoint at ``path`` (one read of each: its size
    and CRC-32 against ``checksums.json``, then rank 0's sealed file) without loading it.

    Raises:
        FileNotFoundError: no sharded checkpoint there. CheckpointError: a damaged one (the
            message names the file).
    """
    if not is_sharded(path):
        raise FileNotFoundError(f"{os.fspath(path)}: no sharded checkpoint")
    load_checkpoint(os.path.join(_checked_step(path), REST))


def _checked_step(path: str | os.PathLike[str]) -> str:
    """The step folder ``LATEST`` names, once its files match their checksums (exactly
    those files) and DCP's index reads as one (``sharded_io.read_metadata``).

    Raises:
        CheckpointError: naming the first file that does not.
    """
    try:
        name = sharded_io.latest(path)
        if name is None:
            raise CheckpointError(f"{os.fspath(path)}: not a sharded checkpoint (no "
                                  f"{sharded_io.LATEST} file)")
        step = os.path.join(path, name)
        problem = sharded_io.damaged_file(step)
        if problem is not None:
            raise CheckpointError(problem)
        sharded_io.read_metadata(step)
    except sharded_io.RefusedFile as exc:
        raise CheckpointError(str(exc)) from exc
    return step


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint file or sharded folder (nothing when it is gone already)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``state`` with every tensor of ``SHARDED_ENTRIES`` replaced by a reference (its DCP
    key, global shape and dtype), and those tensors by key."""
    shards: dict[str, torch.Tensor] = {}

    def to_ref(value: Any, key: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return _DESCEND
        shards[key] = value
        return {SHARD: key, "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch.")}

    rest = {k: _map(v, to_ref, k) if k in SHARDED_ENTRIES else v for k, v in state.items()}
    return rest, shards


def _collect(rest: dict[str, Any], out: dict[str, torch.Tensor]) -> None:
    """An empty whole tensor for every reference in ``rest`` (what DCP fills)."""
    def empty(value: Any, key: str) -> Any:
        if not _is_ref(value):
            return _DESCEND
        out[value[SHARD]] = torch.empty(value["shape"], dtype=getattr(torch, value["dtype"]))
        return value

    _map(rest, empty, "")


def _join(rest: dict[str, Any], shards: dict[str, torch.Tensor]) -> dict[str, Any]:
    return _map(rest, lambda v, k: shards[v[SHARD]] if _is_ref(v) else _DESCEND, "")


def _is_ref(value: Any) -> bool:
    return isinstance(value, dict) and SHARD in value


_DESCEND = object()  # a leaf function's answer: not mine, look inside


def _map(value: Any, leaf: Any, key: str) -> Any:
    """``value`` rebuilt with ``leaf(v, key)`` for each part it answers (keys are the path of
    dict keys and list indices, joined by "/")."""
    done = leaf(value, key)
    if done is not _DESCEND:
        return done
    if isinstance(value, dict):
        return {k: _map(v, leaf, f"{key}/{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, leaf, f"{key}/{i}") for i, v in enumerate(value))
    return value
