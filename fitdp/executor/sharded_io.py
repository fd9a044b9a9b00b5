"""Checkpoints of sharded models through ``torch.distributed.checkpoint`` (DCP): every rank
writes its own shards, none gathers the whole model.

A checkpoint is a folder: ``step-<n>/`` subfolders, each one DCP checkpoint, and a ``LATEST``
file naming the newest complete one. ``LATEST`` is replaced (``os.replace``, atomic) only
after DCP's metadata is written, which DCP does on the coordinator rank after every rank's
shards are on disk, so a crash at any moment (SIGKILL included) leaves ``LATEST`` naming a
whole checkpoint. Loading reshards: the same folder loads on another world size, and into
one process (plain tensors).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

LATEST = "LATEST"


def sharded_state(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"module": ..., "optimizer": ...}`` keyed by parameter name, each rank's shards
    (DTensors under FSDP2; whole tensors elsewhere); ``optimizer`` may be None."""
    if optimizer is None:
        model_sd, _ = get_state_dict(module, [])
        return {"module": model_sd}
    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"module": model_sd, "optimizer": optim_sd}


def load_sharded_state(module: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """Put ``state`` (as ``sharded_state`` gives it, filled by ``load``) back in place."""
    set_state_dict(module, optimizer if optimizer is not None else [],
                   model_state_dict=state["module"],
                   optim_state_dict=state.get("optimizer", {}))


def full_state(module: nn.Module) -> dict[str, Any]:
    """The whole module's state on every rank's CPU (gathered from the shards): for
    ``get_weights`` and ``export``."""
    model_sd, _ = get_state_dict(module, [], options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    return model_sd


def save(folder: str | os.PathLike[str], step: int, state: dict[str, Any], *,
         async_save: bool = False, before: Callable[[Path], None] | None = None
         ) -> Future[None] | None:
    """Write ``state`` as ``folder/step-<step>`` (every rank its shards), then point
    ``LATEST`` at it. With ``async_save`` the shards are staged to CPU (before this returns)
    and written by a thread (``dcp.async_save``); the returned future completes after
    ``LATEST`` moved. ``before(target)`` runs on the coordinator once the target folder is
    made, before any shard is written (what only rank 0 writes into the same checkpoint).
    """
    root = Path(folder)
    target = root / f"step-{step}"
    if _coordinator():
        root.mkdir(parents=True, exist_ok=True)
        if target.exists():  # a crashed attempt at the same step: never named by LATEST
            shutil.rmtree(target)
        target.mkdir()
        if before is not None:
            before(target)
    group = checkpoint_group()
    _barrier()
    if not async_save:
        with warnings.catch_warnings():  # as in load
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(target), no_dist=not _grouped(),
                     process_group=group)
        _publish(root, target.name)
        _barrier()  # no rank returns before LATEST names the new checkpoint
        return None
    # Its own process group: the writer thread's collectives (gathering the shards' write
    # results) run while training's run on the default group.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        pending = dcp.async_save(state, checkpoint_id=str(target), no_dist=not _grouped(),
                                 process_group=group)
    done: Future[None] = Future()

    def finish(fut: Any) -> None:
        try:
            fut.result()
            _publish(root, target.name)
            _barrier()  # (on DCP's thread, still the group's only user)
            done.set_result(None)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(err)

    pending.add_done_callback(finish)  # type: ignore[union-attr]
    return done


def next_step(folder: str | os.PathLike[str]) -> int:
    """One past the step ``LATEST`` names in ``folder`` (1 for a new folder), as the
    coordinator reads it: the same number on every rank (a broadcast)."""
    found = latest(folder) if _coordinator() else None
    number = [0 if found is None else int(found.removeprefix("step-")) + 1]
    if _grouped():
        dist.broadcast_object_list(number, src=0, group=checkpoint_group())
    return max(number[0], 1)


def latest(folder: str | os.PathLike[str]) -> str | None:
    """The name of the newest complete checkpoint in ``folder`` (``step-<n>``), or None."""
    try:
        return (Path(folder) / LATEST).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def load(folder: str | os.PathLike[str], state: dict[str, Any], *,
         each_rank: bool = False) -> int:
    """Fill ``state`` in place (its tensors' shapes and shardings say what each rank reads)
    from the checkpoint ``LATEST`` names; returns its step. ``each_rank``: every rank reads
    the plain tensors of ``state`` whole on its own (no collective).

    Raises:
        FileNotFoundError: no complete checkpoint in ``folder``.
    """
    root = Path(folder)
    name = latest(root)
    if name is None:
        raise FileNotFoundError(f"path: no complete sharded checkpoint in {str(root)!r} (no "
                                f"{LATEST} file); expected a folder written by fitdp "
                                f"with strategy='fsdp'")
    with warnings.catch_warnings():  # one process is the intent, not a mistake to warn of
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(root / name), no_dist=each_rank or not _grouped(),
                 process_group=checkpoint_group() if not each_rank else None)
    return int(name.removeprefix("step-"))


def _publish(root: Path, name: str) -> None:
    """Name ``name`` as the newest complete checkpoint, then drop the older ones."""
    if not _coordinator():
        return
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name)
    os.replace(tmp, root / LATEST)  # atomic: LATEST is the old name or the new one
    for old in root.glob("step-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def _coordinator() -> bool:
    return not _grouped() or dist.get_rank() == 0


def _barrier() -> None:
    if _grouped():
        dist.barrier(group=checkpoint_group())


_groups: dict[int, Any] = {}  # the default group's id -> the checkpoints' gloo group


def checkpoint_group() -> Any:
    """A gloo group of every rank for checkpoint collectives (made once per default group,
    on every rank at the same save), or None outside a process group. An async save's
    thread uses it until its future completes: the caller's thread must not use it before
    (collectives of two threads on one group may pair up wrongly)."""
    if not _grouped():
        return None
    key = id(dist.group.WORLD)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo")
    return _groups[key]


def nonfinite_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The floating-point entries of ``state`` holding NaN or inf, with one host sync. FSDP2
    shards are checked where they are and the verdicts combined over the ranks (a collective
    every rank joins, of one flag per entry: no gather); plain tensors need no collective."""
    names = [k for k, t in state.items() if t.is_floating_point()]
    if not names:
        return []
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (state[k] for k in names)]
    shards = [t.device for t, k in zip(local, names) if isinstance(state[k], DTensor)]
    # On the shards' device (NCCL takes no CPU tensor), else the first entry's.
    device = shards[0] if shards else local[0].device
    flags = torch.stack([(~torch.isfinite(t).all()).to(device) for t in local]).to(torch.uint8)
    if shards:  # the default group: the checkpoints' own may be busy in an async save
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [k for k, bad in zip(names, flags.tolist()) if bad]


def is_shard(value: object) -> bool:
    """Whether ``value`` is an FSDP2 shard (a DTensor): DCP copies it from its device."""
    return isinstance(value, DTensor)
