"""A fit whose step would hand a ``BatchNorm1d`` that trains a piece of one row, refused
before the first step.

In training, ``BatchNorm1d`` on ``(rows, features)`` normalises each piece of a batch with
that piece's own statistics, and torch raises "Expected more than 1 value per channel when
training" for a piece of one row. The pieces are a device's slice of a batch (the ordinary
step, by ``work_load_list``) or a micro-batch (``fit(reproducible=True)``), and on in-memory
tensors their sizes are known before any step: a data set whose last batch or micro-batch
leaves one row would otherwise fail there, after epochs of steps (and, in the ordinary step,
after the other replicas' forwards moved their running statistics).

A ``BatchNorm1d`` fed ``(rows, channels, length)`` has ``length`` values per channel even in
one row, but which input a layer gets is known only when it runs: any ``BatchNorm1d`` that
trains counts here. ``BatchNorm2d`` and ``BatchNorm3d`` take images and volumes (values per
channel in every row) and are left to torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fitdp.checks import fail
from fitdp.executor.slicing import device_slices

_ROW_NORMS = (nn.BatchNorm1d, nn.LazyBatchNorm1d)


def check_batchnorm_rows(module: nn.Module, *, samples: int | None, batch_size: int,
                         devices: Sequence[torch.device], loads: Sequence[float] | None,
                         micro_batch_size: int | None, world_size: int = 1) -> None:
    """Refuse pieces of one row for a ``BatchNorm1d`` that trains (module docstring).

    Args:
        module: the user's module (its layers' modes as the fit will run them).
        samples: rows of the in-memory training data that the epochs read to their end
            (None: its last batch is not foreseen: other data, or ``steps_per_epoch``).
        batch_size: rows of each batch on this process.
        devices: the replicas' devices.
        loads: the work loads (None: ``"auto"``, measured while training: not foreseen).
        micro_batch_size: the reproducible mode's micro-batch rows, or None.
        world_size: torchrun's processes (each rank's share of a last batch is its own).

    Raises:
        ValueError: naming ``micro_batch_size``, ``work_load_list`` or ``batch_size``.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        >>> check_batchnorm_rows(net, samples=64, batch_size=16, devices=[torch.device("cpu")],
        ...                      loads=[1.0], micro_batch_size=4)
    """
    n = -1 if samples is None else samples  # (-1: no last batch foreseen)
    # The sizes first, the module's layers only for a piece of one row: most fits cut
    # none, and they pay no walk of the module.
    if micro_batch_size is not None:
        # Micro-batches are cut from the start of each (global) batch, a multiple of their
        # size: only the data's last one can be shorter, of samples % size rows.
        tail = n % micro_batch_size if n > 0 else 0
        norm = _norm(module) if micro_batch_size == 1 or tail == 1 else None
        if norm is not None:
            good = [k for k in range(2, batch_size + 1) if batch_size % k == 0 and n % k != 1]
            fix = [f"micro_batch_size={good[0]} (or one of {good[1:6]})"] if good else []
            if tail == 1:
                fix.append(f"the first {n - 1} rows (the last one dropped)")
            why = (f"{n} rows in micro-batches of {micro_batch_size} end in one of 1 row"
                   if tail == 1 else "every micro-batch would be 1 row")
            fail("micro_batch_size", micro_batch_size, f"micro-batches of 2 rows or more for "
                 f"{norm}; {why}", " or ".join(fix)
                 or "reproducible=False")
        return
    if loads is None:
        return
    norm = _norm(module) if not _two_each(batch_size, loads) else None
    if norm is not None:
        uneven = len(set(loads)) > 1
        name, got = ("work_load_list", list(loads)) if uneven else ("batch_size", batch_size)
        fail(name, got, f"slices of 2 rows or more for {norm}; a batch of {batch_size} rows "
             f"over {len(devices)} devices by these loads gives a device 1 row",
             "loads that give every device 2 rows or more" if uneven else
             f"batch_size >= {2 * len(devices)}, or fewer devices")
    last = n % batch_size if n > 0 else 0
    one_row = world_size == 1 and last and not _two_each(last, loads)  # (ranks: their own)
    norm = _norm(module) if one_row else None
    if norm is not None:
        good = [k for k in range(batch_size - 1, 1, -1) if _two_each(n % k, loads)][:3]
        fail("batch_size", batch_size, f"slices of 2 rows or more for {norm}; the last batch "
             f"of {n} rows has {last}, which gives a device 1 row",
             (f"batch_size={good[0]} (or one of {good[1:]}), or " if good else "")
             + f"the first {n - last} rows (the last batch dropped)")


def _norm(module: nn.Module) -> str | None:
    """The first ``BatchNorm1d`` that trains in ``module`` (its layers' modes as the fit runs
    them), described for the error; None without one."""
    layer = next((name for name, m in module.named_modules() if isinstance(m, _ROW_NORMS)
                  and (m.training or not module.training)), None)
    return None if layer is None else \
        f"the BatchNorm1d {layer!r}, which cannot normalise one row in training"


def _two_each(rows: int, loads: Sequence[float]) -> bool:
    """Whether ``rows`` split by ``loads`` gives no device exactly one row (0 rows: no last
    batch; an idle device is fine)."""
    return all(sl.stop - sl.start != 1 for sl in device_slices(rows, loads))
