"""Per-layer statistics every ``interval`` batches (MXNet's ``Monitor``)."""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fitdp.data.batch import tree_leaves

StatFunc = Callable[[torch.Tensor], torch.Tensor]


class MonitorRow(NamedTuple):
    """One statistic of one reported batch in ``fit``: epoch (from 1), batch (the monitor's
    count, from 1), tensor name, value."""

    epoch: int
    batch: int
    name: str
    value: float


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square, ``norm(x) / sqrt(numel)`` (the seed's default statistic)."""
    return torch.linalg.vector_norm(x.float()) / math.sqrt(max(x.numel(), 1))


class Monitor:
    """Collect a statistic of layer outputs, weights and gradients every ``interval`` batches.

    Outputs come from forward hooks on every submodule whose qualified name matches
    ``pattern`` (in every bucket and on every device: names are prefixed ``b<key>/`` and
    ``d<index>/`` when there are several); weights and gradients come from the first
    device's replica. Statistics stay on the device until ``toc`` (one host sync there).

    Args:
        interval: collect on every ``interval``-th batch.
        stat_func: tensor -> scalar tensor; default RMS.
        pattern: regular expression matched (``re.match``) against names.
        sort: sort ``toc``'s result by name.
        verbose: in ``fit``, print each row (``epoch 1 batch 11 3.weight 0.0996``) through
            ``tqdm.write``, the progress bar's writer (lines go above the bar). False:
            silent; the rows are still in ``last`` and passed to ``on_rows``.
        on_rows: in ``fit``, called with each reported batch's ``MonitorRow`` list (before
            ``on_train_batch_end``), e.g. to send them to TensorBoard.

    Example:
        >>> mon = Monitor(1, pattern="0")
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> mon.install(net)
        >>> mon.tic(); _ = net(torch.ones(1, 2)); [n for _, n, _ in mon.toc()]
        ['0_output', '0.weight', '0.bias']
    """

    def __init__(
        self,
        interval: int,
        stat_func: StatFunc | None = None,
        pattern: str = ".*",
        sort: bool = False,
        *,
        verbose: bool = True,
        on_rows: Callable[[list[MonitorRow]], None] | None = None,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval: got {interval!r}; expected a positive int (batches)")
        self.interval = interval
        self.stat_func = stat_func or rms
        self.pattern = pattern
        self.regex = re.compile(pattern)
        self.sort = sort
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose: got {verbose!r}; expected True (print the rows) or False")
        if on_rows is not None and not callable(on_rows):
            raise TypeError(f"on_rows: got {type(on_rows).__name__}; expected a callable("
                            f"rows) -> None, or None")
        self.verbose, self.on_rows = verbose, on_rows
        self.last: list[MonitorRow] = []  # the rows of the last reported batch (fit)
        self.step = 0
        self.activated = False
        self._queue: list[tuple[int, str, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._params: list[tuple[str, nn.Parameter]] = []
        self._handles: list[RemovableHandle] = []

    def install(self, module: nn.Module, prefix: str = "", params: bool = True) -> None:
        """Hook the outputs of ``module``'s matching submodules; with ``params``, also watch
        its weights and gradients."""
        for qualname, sub in module.named_modules():
            name = f"{prefix}{qualname or 'module'}_output"
            if self.regex.match(qualname):
                self._handles.append(sub.register_forward_hook(self._hook(name)))
        if params:
            self._params += [(n, p) for n, p in module.named_parameters() if self.regex.match(n)]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if not self.activated:
                return
            leaves = tree_leaves(output)
            for i, t in enumerate(leaves):
                label = name if len(leaves) == 1 else f"{name}{i}"
                self._record(label, t)

        return hook

    def _record(self, name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            value = self.stat_func(tensor.detach())
        with self._lock:
            self._queue.append((self.step, name, value))

    def tic(self) -> None:
        """Start collecting for this batch if it is an ``interval``-th one."""
        if self.step % self.interval == 0:
            self.activated = True
            self._queue = []
        self.step += 1

    def toc(self) -> list[tuple[int, str, float]]:
        """End this batch's collection; return ``(step, name, value)`` rows (a host sync)."""
        if not self.activated:
            return []
        for name, p in self._params:
            self._record(name, p)
            if p.grad is not None:
                self._record(f"{name}_grad", p.grad)
        self.activated = False
        rows = [(step, name, float(v)) for step, name, v in self._queue]
        self._queue = []
        return sorted(rows, key=lambda r: r[1]) if self.sort else rows

    def toc_print(self, logger: logging.Logger | None = None) -> list[tuple[int, str, float]]:
        """``toc`` and log each row as ``Batch: <step> <name> <value>``."""
        rows = self.toc()
        log = logger or logging.getLogger("fitdp")
        for step, name, value in rows:
            log.info("Batch: %7d %30s %s", step, name, value)
        return rows

    def report(self, epoch: int, logger: logging.Logger | None = None) -> list[MonitorRow]:
        """``toc`` in ``fit``: this batch's rows (with the epoch, counted from 1) printed
        through the progress bar's writer (``verbose``), logged at DEBUG on ``fitdp``, kept
        in ``last`` and passed to ``on_rows``. Weights and gradients are read after the
        optimizer step of the batch (gradients: the reduced ones it stepped with)."""
        rows = [MonitorRow(epoch + 1, step, name, value) for step, name, value in self.toc()]
        if not rows:
            return rows
        self.last = rows
        from tqdm import tqdm  # noqa: PLC0415 - the progress bar's class, imported as it does

        log = logger or logging.getLogger("fitdp")
        width = max(len(r.name) for r in rows)
        for row in rows:
            line = f"epoch {row.epoch} batch {row.batch:>6}  {row.name:<{width}}  {row.value:.4g}"
            if self.verbose:
                tqdm.write(line, file=sys.stdout)  # above the bar (ProgressBar's stdout)
            log.debug(line)
        if self.on_rows is not None:
            self.on_rows(rows)
        return rows

    def remove(self) -> None:
        """Detach every hook this monitor installed."""
        for h in self._handles:
            h.remove()
        self._handles, self._params = [], []
