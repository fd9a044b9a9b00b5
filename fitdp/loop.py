"""The batch loop, written once for train / test / predict, and predict's reassembly."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from fitdp.batch import tree_cat, tree_map
from fitdp.distributed import gather_rows

if TYPE_CHECKING:
    from fitdp.callbacks import CallbackList
    from fitdp.engine import Engine
    from fitdp.model import Model
    from fitdp.monitor import Monitor


def run_batches(
    model: Model, engine: Engine, mode: str, source: Any, cbs: CallbackList,
    steps: int | None = None, log_every: int = 50, monitor: Monitor | None = None,
) -> Any:
    """One pass over ``source``: the logs (train/test) or ``[(key, index, rows)]`` (predict).

    Loss and metrics are read on the host only every ``log_every`` batches and at the end
    (``engine.read_logs`` is the one sync); between those points batch logs are stale.
    """
    begin, end = f"on_{mode}_batch_begin", f"on_{mode}_batch_end"
    sync_each = cbs.sync_every_batch
    logs: dict[str, float] = {}
    rows: list[tuple[int, Any, Any]] = []
    batches = source if steps is None else itertools.islice(source, steps)
    for step, batch in enumerate(batches):
        if step == 0:
            engine.check_batch(batch)
        cbs.call(begin, step, {})
        if monitor is not None:
            monitor.tic()
        if mode == "train":
            model.global_step += engine.train_step(batch)
        else:
            engine.eval_step(batch, with_metrics=mode == "test")
        if monitor is not None:
            monitor.toc_print()
        if mode == "predict":
            outs = [tree_map(_to_host, o) for o in engine.manager.outputs()]
            rows.append((step, batch.index, tree_cat(outs) if outs else None))
        elif sync_each or (step + 1) % log_every == 0:
            logs = engine.read_logs()  # a host sync: only at log points
        cbs.call(end, step, logs)
        if model.stop_training:
            break
    if mode == "predict":
        return rows
    if mode == "train":
        model.global_step += engine.flush()
    return engine.read_logs()


def assemble(rows: list[tuple[int, Any, Any]], rank: int, world_size: int) -> Any:
    """Predict's rows in input order (from every rank under torch.distributed).

    A rank's step ``s`` holds global batch ``s * world_size + rank`` (round-robin sharding);
    batches that carry sample indices (tensors, BucketIterator) are put back by index.
    """
    keyed = [(s * world_size + rank, i, r) for s, i, r in rows]
    if world_size > 1:
        keyed = sorted(gather_rows(keyed), key=lambda k: k[0])
    keyed = [k for k in keyed if k[2] is not None]
    if not keyed:
        raise ValueError("data: no samples to predict on; expected at least one")
    result = tree_cat([r for _, _, r in keyed])
    if all(i is not None for _, i, _ in keyed):
        order = torch.argsort(torch.cat([i for _, i, _ in keyed]))
        result = tree_map(lambda t: t[order], result)
    return result


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)
