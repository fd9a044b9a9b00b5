"""The part of ``fitdp.Model`` that moves weights in and out: checkpoints, weights, export."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from fitdp.call.plan import FitPlan
from fitdp.checks import check_choice, check_path, fail
from fitdp.compiled.setup import PRECISIONS
from fitdp.data.sources import SourcePlan
from fitdp.executor.sharded_io import nonfinite_names
from fitdp.saving.async_writer import AsyncCheckpointWriter
from fitdp.saving.checkpoint import CheckpointError, save_checkpoint
from fitdp.saving.entries import (
    RNG,
    Entry,
    OptimizerState,
    Skipped,
    Stateful,
    check_weights,
    restore,
    snapshot,
    warn_skipped,
)
from fitdp.saving.export import export_module
from fitdp.saving.fence import fence_steps, hold, wait_for_snapshots
from fitdp.saving.sharded import (
    existing_checkpoint,
    read_state,
    save_sharded,
    sharded_path,
)
from fitdp.saving.weights_file import load_weights_file, save_weights_file

if TYPE_CHECKING:
    from torch import nn

    from fitdp.call.replicas import Replicas
    from fitdp.call.run_state import RunState
    from fitdp.call.session import Session
    from fitdp.callbacks.weight_averaging import WeightAveraging
    from fitdp.compiled.setup import Compiled


class ModuleState:
    """The model's weights as a checkpoint entry: saved averaged over the replicas, loaded
    into the host module and every replica after every name, shape and dtype is checked.

    ``sync_host`` averages the replicas into ``module``; ``load_replicas`` copies ``module``
    into every replica (both the model's, handed over so no private field is read here)."""

    def __init__(self, module: nn.Module, sync_host: Callable[[], None],
                 load_replicas: Callable[[], None], origin: str, *, strict: bool = True,
                 error: type[Exception] = CheckpointError) -> None:
        self.module, self.sync_host, self.load_replicas = module, sync_host, load_replicas
        self.origin, self.strict, self.error = origin, strict, error
        self.skipped = Skipped([], [], [])

    def state_dict(self) -> dict[str, torch.Tensor]:
        self.sync_host()
        # The host tensors themselves, no copy: a save serialises them before returning.
        return self.module.state_dict()

    def problem(self, state: Any, checkpoint: Any) -> None:
        """Raises ``error`` (naming the first mismatching tensor) when ``state`` does not fit."""
        check_weights(self.module.state_dict(), state, origin=self.origin,
                      strict=self.strict, error=self.error)

    def load_state_dict(self, state: Any) -> None:
        load, self.skipped = check_weights(self.module.state_dict(), state, origin=self.origin,
                                           strict=self.strict, error=self.error)
        self.sync_host()
        wait_for_snapshots()  # with one device the module is the replica an async save copies
        self.module.load_state_dict(load, strict=False)
        self.load_replicas()


class ModelIO:
    """Checkpoints, weights and export for ``fitdp.Model`` (mixed into it)."""

    module: nn.Module
    run: RunState
    is_main_process: bool
    _compiled: Compiled | None
    _replicas: Replicas | None
    _session: Session | None
    _writer: AsyncCheckpointWriter | None
    _sharded_save: Future[None] | None = None  # an async sharded save in flight
    _averaging: WeightAveraging | None = None  # the latest fit's EMA or SWA
    # What the last fit trained on (its source's plan: layout, buckets), for export's axes.
    _trained_on: SourcePlan | None = None

    def _sync_host(self) -> None:
        """Average the replicas into the host module (a no-op with the module as replica)."""
        if self._replicas is not None:
            self._replicas.store_host(self.module)

    def _load_replicas(self) -> None:
        """Copy the host module into every replica (a no-op without replicas)."""
        if self._replicas is not None:
            self._replicas.load_host(self.module)

    def _shards(self) -> bool:
        """FSDP2: this rank's replica holds shards of the weights."""
        return self._replicas is not None and self._replicas.shards_weights

    def _module_state(self, origin: str, *, strict: bool = True,
                      error: type[Exception] = CheckpointError) -> ModuleState:
        return ModuleState(self.module, self._sync_host, self._load_replicas, origin,
                           strict=strict, error=error)

    # -- checkpoints --------------------------------------------------------------------------

    def _checkpoint_objects(self, origin: str, *, strict: bool = True,
                            shards: bool = False) -> dict[str, Stateful]:
        """The objects a checkpoint is made of, in load order; each saves itself. With
        ``shards`` (FSDP2, saving only) the weights and optimizer state are this rank's
        shards, not gathered."""
        replicas = self._replicas
        whole = self._module_state(origin, strict=strict)
        objects: dict[str, Stateful] = {"module": whole}
        if shards and replicas is not None:
            module = self.module
            objects["module"] = Entry(lambda: replicas.sharded_weights(module),
                                      whole.load_state_dict)
        session = self._session
        if replicas is not None:  # after "module": it loads the replicas with the average
            objects["replica_buffers"] = session.buffers if session is not None else Entry(
                replicas.own_buffers, replicas.load_own_buffers)  # (each rank's, in a fit)
            # The measured loads and the slow-replicas check: a resume splits each batch so.
            manager = replicas.manager
            objects["measures"] = Entry(manager.measures, manager.load_measures)
        compiled = self._compiled
        if compiled is not None and compiled.optimizer is not None:
            # (the replicas' engine holds its state while they exist: FSDP2's shards)
            engine = replicas.engine if replicas is not None else None
            objects["optimizer"] = OptimizerState(compiled.optimizer, engine, whole=not shards)
            for key in ("scheduler", "scaler"):
                if getattr(compiled, key) is not None:
                    objects[key] = getattr(compiled, key)
        objects["run"] = self.run
        if session is not None and isinstance(session.plan, FitPlan):
            objects["data"] = session.position
            objects["logs"] = session.epoch_logs
            objects["callbacks"] = session.plan.callbacks
        objects["rng"] = session.rng if session is not None else RNG
        return objects

    def share_epoch_logs(self) -> None:
        """Under torchrun, gather every rank's running loss sums and metric states of the
        epoch, its random generators and data position, so that a ``save`` right after (rank
        0's) holds them all and a resume on as many ranks logs and draws as the
        uninterrupted run; and the optimizer state where each rank holds a part of it
        (``strategy="zero1"``). A collective: call it on every
        rank (``ModelCheckpoint`` and ``BackupAndRestore`` do before each save). One
        process, or outside a fit's epoch: nothing to do for the logs."""
        if self._replicas is not None:
            self._replicas.share_optimizer()
        session = self._session
        if session is not None and isinstance(session.plan, FitPlan):
            session.epoch_logs.share()
            session.rng.share()  # and every rank's generators, data position and buffers
            session.position.share()
            session.buffers.share()

    def save(self, path: str | os.PathLike[str], *, async_save: bool = False,
             sharded: bool | None = None) -> None:
        """Write a checkpoint to ``path`` atomically (only the main process writes).

        It holds the device-averaged weights, optimizer, scheduler and scaler state, the
        position in the run (epoch, step, position in the epoch), data order, callback and
        RNG states: ``fit(resume=path)`` continues exactly. Loads with
        ``torch.load(weights_only=True)``. Taken between optimizer steps: batches of an
        unfinished gradient accumulation are trained again on resume.

        With ``async_save``, the call returns at once: a background thread copies the weights
        and optimizer state to host memory while the next forward and backward run (the next
        optimizer step, ``set_weights`` or ``load`` waits for that copy), then writes, fsyncs
        and renames the file (still atomic). At most one save is
        in flight (the next waits for it); a background save's error is raised by the next
        ``save``, by ``wait_for_saves()`` and at the end of ``fit``, which returns only once
        the last save is on disk.

        With ``strategy="fsdp"`` (after the first fit), call it on **every** rank: by default
        (``sharded=None``) ``path`` is then a folder in which each rank writes its own shards
        of the weights and optimizer state through ``torch.distributed.checkpoint`` (none
        gathers the whole state), rank 0 the rest; ``async_save`` uses ``dcp.async_save``.
        ``sharded=False`` gathers the shards instead and rank 0 writes one file of whole
        tensors (the format of every other strategy; ``sharded=True`` there writes the
        folder form, and must then be called on every rank too). Both load anywhere: any
        world size, one process (``load``, ``fit(resume=...)``). See docs/distributed.md.

        Raises:
            ValueError: ``path`` is a folder or a special file (sharded: an existing file,
                or a folder of other files). TypeError: ``async_save`` or ``sharded`` is not
                a bool. OSError: the write failed (the previous checkpoint is untouched).
        """
        for name, flag in (("async_save", async_save), ("sharded", sharded)):
            if not isinstance(flag, bool) and not (name == "sharded" and flag is None):
                fail(name, flag, "True or False" + (" (or None: sharded under "
                     "strategy='fsdp')" if name == "sharded" else ""), error=TypeError)
        if self._shards() if sharded is None else sharded:
            self._save_sharded(sharded_path("path", path), async_save)
            return
        path = check_path("path", path)
        state = snapshot(self._checkpoint_objects(path))
        if not self.is_main_process:
            return
        if async_save:
            if self._writer is None:
                self._writer = AsyncCheckpointWriter()
            self._writer.submit(path, state, defer=self._stepped_tensors())
            hold(self._writer.copied)
            if self._replicas is not None:  # its next optimizer step waits for the copy
                fence_steps(self._replicas.manager.before_step)
        else:
            self.wait_for_saves()  # files land in the order they were asked for
            save_checkpoint(path, state)

    def _save_sharded(self, path: str, async_save: bool) -> None:
        """Every rank: its shards through DCP, rank 0 the rest; one save in flight."""
        self.wait_for_saves()  # checkpoints land in the order they were asked for
        if self._replicas is not None:  # (every rank is here: a collective may run)
            self._replicas.share_optimizer()
        state = snapshot(self._checkpoint_objects(path, shards=self._shards()))
        self._sharded_save = save_sharded(path, state, step=self.run.global_step,
                                          async_save=async_save)

    def _stepped_tensors(self) -> list[torch.Tensor]:
        """The parameters and optimizer state: only an optimizer step or a load (each behind
        the snapshot fence) changes them, so an async save may copy them late. Buffers are
        not here: a forward in training mode changes BatchNorm statistics."""
        tensors: list[torch.Tensor] = list(self.module.parameters())
        compiled = self._compiled
        if compiled is not None and compiled.optimizer is not None:
            tensors += [v for state in compiled.optimizer.state.values()
                        for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    def wait_for_saves(self) -> None:
        """Block until every checkpoint this model wrote is on disk.

        Raises:
            OSError (or what the write raised): a background save failed.
        """
        if self._writer is not None:
            self._writer.wait()
        pending, self._sharded_save = self._sharded_save, None
        if pending is not None:
            pending.result()

    def load(self, path: str | os.PathLike[str], *, strict: bool = True) -> Skipped:
        """Restore weights (into every replica) and, when compiled, optimizer, scheduler and
        scaler state.

        Every tensor's name, shape and dtype (and the optimizer's kind) is checked before
        anything is written: a checkpoint of another model changes nothing.

        Args:
            path: a checkpoint written by ``save`` (or a checkpoint callback): a file, or
                the folder of a sharded one.
            strict: with False, load the tensors that match and skip the rest (listed in the
                returned ``Skipped`` and a warning).

        Raises:
            fitdp.CheckpointError: not a sound fitdp checkpoint, or one that does not fit.
        """
        path = existing_checkpoint("path", path)
        wait_for_snapshots()  # the optimizer state an async save may still be copying
        objects = self._checkpoint_objects(path, strict=strict)
        parts = ("module", "optimizer", "scheduler", "scaler")
        keep: dict[str, Stateful] = {k: objects[k] for k in parts if k in objects}
        restore(keep, read_state(path), path)
        skipped = keep["module"].skipped  # type: ignore[attr-defined]
        warn_skipped(skipped, path)
        return skipped

    def _resume(self, path: str) -> dict[str, Any]:
        """Continue a run from ``path``: everything but the callbacks and the RNG, which
        ``fit`` restores later (after ``on_train_begin``; right before the first batch)."""
        state = read_state(path)
        wait_for_snapshots()
        objects = self._checkpoint_objects(path)
        restore(objects, state, path, required=("module", "run"), later=("callbacks", "rng"))
        session = self._session
        if session is not None:
            cbs = session.plan.callbacks
            resumed = {"path": path, "epoch": self.run.next_epoch,
                       "step": self.run.global_step}
            cbs.set_params({**cbs.params, "resumed": resumed})
        return state

    # -- weights ------------------------------------------------------------------------------

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Host copies of every parameter and buffer, averaged over devices."""
        self._sync_host()
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def set_weights(self, weights: dict[str, torch.Tensor], *, strict: bool = True) -> Skipped:
        """Load ``weights`` (by name) into the host module and every replica.

        Raises:
            ValueError: a name, shape or dtype that does not match (nothing is written).
        """
        entry = self._module_state("set_weights(weights)", strict=strict, error=ValueError)
        entry.load_state_dict(weights)
        warn_skipped(entry.skipped, "set_weights")
        return entry.skipped

    def ema_weights(self) -> dict[str, torch.Tensor]:
        """Host copies of the averaged weights of the latest fit's ``EMA`` or ``SWA``
        callback: its averaged parameters (up to the last optimizer step) with the model's
        buffers. After that fit they are the model's weights too (fit ends by loading them;
        the training weights are the callback's ``training_weights``); before its first
        update, the model's weights.

        Raises:
            RuntimeError: the latest fit had no ``EMA`` or ``SWA`` callback.
        """
        averaging = self._averaging
        if averaging is None:
            raise RuntimeError("ema_weights: the latest fit of this model had no EMA or SWA "
                               "callback to average its weights. Fix: fit(..., callbacks=["
                               "fitdp.callbacks.EMA(decay=0.999)]) first.")
        weights = self.get_weights()
        weights.update(averaging.averaged_parameters())
        return weights

    def device_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters the optimizer steps, by name: the tensors themselves, not copies
        (read them; write through ``set_weights``). During a call, device 0's replica's, on
        its device (every replica equals it after an optimizer step); else the host
        module's. ``EMA`` and ``SWA`` average these where they are."""
        if self._replicas is None:
            return dict(self.module.named_parameters())
        return dict(self._replicas.manager.named_master_parameters())

    def save_weights(self, path: str | os.PathLike[str]) -> None:
        """Write the device-averaged weights alone (Keras's ``save_weights``): a
        ``.safetensors`` file (no pickle; any safetensors reader loads it; needs
        ``pip install "fitdp[safetensors]"``) or, for any other name, a sealed fitdp weights
        file. A checkpoint (``save``) stays the format for resuming. Only the main process
        writes."""
        path = check_path("path", path)
        self._sync_host()
        if self.is_main_process:
            self.wait_for_saves()
            save_weights_file(path, self.module.state_dict())

    def load_weights(self, path: str | os.PathLike[str], *, strict: bool = True) -> Skipped:
        """Load weights written by ``save_weights`` (or any safetensors file) into the host
        module and every replica, after checking every name, shape and dtype.

        Raises:
            fitdp.CheckpointError: a damaged or foreign file, or weights that do not fit
                (nothing is written); ``strict=False`` loads what fits instead.
        """
        path = check_path("path", path, must_exist=True)
        entry = self._module_state(path, strict=strict)
        entry.load_state_dict(load_weights_file(path))
        warn_skipped(entry.skipped, path)
        return entry.skipped

    def nonfinite_weights(self) -> list[str]:
        """Names of floating-point weights holding NaN or inf (no copy; one host sync).
        FSDP2: each rank checks its shards (a collective, no gather)."""
        if self._shards():
            return nonfinite_names(self._replicas.sharded_weights(self.module))  # type: ignore[union-attr]
        self._sync_host()
        return nonfinite_names(self.module.state_dict())

    def export(self, path: str | os.PathLike[str], example_inputs: Any, *,
               precision: str = "32", dynamic_shapes: Any = None) -> None:
        """Write a single-device predictor (``torch.export``, dynamic batch) of the averaged
        weights in eval mode; load it with ``fitdp.load_predictor(path)``. ``precision``:
        ``"32"`` (fp32, the default, whatever the training precision) or the mixed precision
        the model trained with (``"bf16-mixed"``, ``"16-mixed"``: forward under autocast, as
        ``predict`` runs it).

        ``dynamic_shapes`` (torch.export's) is used as given. Without it the batch axis is
        dynamic, on the ``N`` of the layout the model was last fit on (time-major data:
        axis 1), and for a model fit on buckets (a ``BucketIterator``) the sequence axis too
        (see ``fitdp.saving.export.export_module``)."""
        check_choice("precision", precision, tuple(PRECISIONS),
                     "pass the precision given to compile, e.g. precision='bf16-mixed'")
        self._sync_host()
        trained = self._trained_on
        descs = list(trained.inputs) if trained is not None else []
        layout = descs[0].layout if descs else None
        export_module(self.module, path, example_inputs, autocast_dtype=PRECISIONS[precision],
                      dynamic_shapes=dynamic_shapes, layout=layout,
                      sequence=bool(trained and trained.bucket_keys))
