"""``model.find_lr``: the learning-rate range test (Smith 2015; fastai's ``lr_find``,
Lightning's ``Tuner.lr_find``), and ``LRFinder``, the curve it returns.

The sweep trains on the call's data through the model's own step (so devices, replicas,
ranks, precision and gradient accumulation are fit's), with the learning rate of every
parameter group set before each optimizer step, then puts everything back: weights,
optimizer and scheduler state, run state (``global_step``), the data's position and the
random generators are exactly as before the call, also when it raises.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from fitdp.call.plan import CallPlan, plan_fit
from fitdp.call.ranks import DEFAULT_TIMEOUT
from fitdp.checks import FitdpWarning, check_int, check_number, fail
from fitdp.executor.devices import DevicesArg
from fitdp.saving.entries import restore, snapshot

if TYPE_CHECKING:
    from torch import nn

    from fitdp.call.run_state import RunState
    from fitdp.call.session import Session
    from fitdp.compiled.setup import Compiled
    from fitdp.saving.entries import Stateful

SKIP_BEGIN = 10  # Lightning's suggestion skips the first 10 points (warm-up noise) ...
SKIP_END = 1  # ... and the last (often the divergence itself)


class LRFinder:
    """The result of ``model.find_lr``: the rates tried and the losses they gave.

    Attributes:
        lrs: the learning rate of each optimizer step, geometric from ``min_lr``.
        raw_losses: each step's mean training loss (over its batches, devices and ranks).
        losses: the losses smoothed as fastai and Lightning do: an exponential moving
            average ``avg = beta * avg + (1 - beta) * loss`` with bias correction
            ``avg / (1 - beta ** (i + 1))`` (``beta=0.98``).
        diverged: the sweep stopped before ``num_steps`` because the smoothed loss went
            above ``early_stop_threshold`` times the best smoothed loss so far (or was not
            finite); the diverging point is recorded, as both libraries record it.

    Example:
        >>> f = LRFinder([1e-3, 1e-2, 1e-1], [1.0, 0.5, 2.0], beta=0.0)
        >>> f.losses, f.suggest(skip_begin=0, skip_end=0)
        ([1.0, 0.5, 2.0], 0.001)
    """

    def __init__(self, lrs: Sequence[float], raw_losses: Sequence[float], *,
                 beta: float = 0.98, diverged: bool = False) -> None:
        self.lrs = [float(v) for v in lrs]
        self.raw_losses = [float(v) for v in raw_losses]
        self.losses = smoothed(self.raw_losses, beta)
        self.diverged = diverged

    @property
    def suggestion(self) -> float | None:
        """``suggest()`` with Lightning's defaults (skip the first 10 points and the last)."""
        return self.suggest()

    def suggest(self, skip_begin: int = SKIP_BEGIN, skip_end: int = SKIP_END) -> float | None:
        """The rate where the smoothed loss falls fastest, as Lightning suggests it: the
        minimum of ``torch.gradient`` of the smoothed losses over the step index (the rates
        are geometric, so that is the slope against ``log(lr)``), after dropping
        ``skip_begin`` points at the start, ``skip_end`` at the end and non-finite losses.

        Returns:
            That rate, or None (with a warning) when fewer than 2 points are left: sweep
            more steps (``num_steps``) or lower ``skip_begin``.
        """
        check_int("suggest(skip_begin=...)", skip_begin, 0)
        check_int("suggest(skip_end=...)", skip_end, 0)
        kept = [(lr, loss) for lr, loss in
                zip(self.lrs[skip_begin:len(self.lrs) - skip_end],
                    self.losses[skip_begin:len(self.losses) - skip_end]) if math.isfinite(loss)]
        if len(kept) < 2:
            warnings.warn(f"LRFinder.suggestion: {len(kept)} finite point(s) left after "
                          f"skipping {skip_begin} at the start and {skip_end} at the end of "
                          f"{len(self.lrs)}; no suggestion. Fix: find_lr(num_steps=...) "
                          f"higher, or suggest(skip_begin=...) lower.", FitdpWarning,
                          stacklevel=2)
            return None
        slopes = torch.gradient(torch.tensor([loss for _, loss in kept], dtype=torch.float64))
        # (Indexing the kept points, not the whole curve: Lightning's index shifts when a
        # loss in the window is not finite.)
        return kept[int(torch.argmin(slopes[0]))][0]

    def plot(self, path: str | None = None, *, suggest: bool = True) -> Any:
        """Draw the smoothed loss against the rate (log axis), the suggestion marked.

        Args:
            path: when given, the figure is also saved there (format from the extension).
            suggest: mark ``suggestion`` with a red dot when there is one.

        Returns:
            The ``matplotlib.figure.Figure``.

        Raises:
            ImportError: matplotlib is not installed.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("LRFinder.plot needs matplotlib, which is not installed. "
                              "Install it with `pip install matplotlib`.") from e
        # Figure() without pyplot: no GUI backend, no global state, safe on headless machines.
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.subplots()
        ax.plot(self.lrs, self.losses)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss (smoothed)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitdpWarning)  # too short a curve: no dot
            best = self.suggestion if suggest else None
        if best is not None:
            i = self.lrs.index(best)
            ax.plot(best, self.losses[i], "o", color="red", label=f"suggestion {best:.2e}")
            ax.legend()
        if path is not None:
            fig.savefig(path)
        return fig


def smoothed(losses: Sequence[float], beta: float) -> list[float]:
    """fastai's ``AvgSmoothLoss`` (and Lightning's ``lr_find``): a bias-corrected EMA."""
    avg, out = 0.0, []
    for i, loss in enumerate(losses):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def geometric(min_lr: float, max_lr: float, num_steps: int) -> list[float]:
    """``num_steps`` rates from ``min_lr`` to ``max_lr`` (both included), equal ratios
    (Lightning's exponential mode)."""
    return [min_lr * (max_lr / min_lr) ** (i / (num_steps - 1)) for i in range(num_steps)]


class LRFinding:
    """``find_lr`` for ``fitdp.Model`` (mixed into it)."""

    module: nn.Module
    run: RunState

    if TYPE_CHECKING:
        def _call(self, plan: CallPlan, compiled: Compiled | None
                  ) -> AbstractContextManager[Session]: ...

        def _require_compiled(self, what: str) -> Compiled: ...

        def _checkpoint_objects(self, origin: str, *, strict: bool = True,
                                shards: bool = False) -> dict[str, Stateful]: ...

    def find_lr(self, x: Any = None, y: Any = None, *, min_lr: float = 1e-7,
                max_lr: float = 1.0, num_steps: int = 100, early_stop_threshold: float | None
                = 4.0, beta: float = 0.98, batch_size: int | None = None,
                shuffle: bool = True,
                sample_weight: Any = None, class_weight: dict[int, float] | None = None,
                devices: DevicesArg = "auto", work_load_list: Sequence[float] | str | None = None,
                seed: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                collate_fn: Callable[[list[Any]], Any] | None = None,
                group_by_length: bool | str | Sequence[int] = False) -> LRFinder:
        """The learning-rate range test: train ``num_steps`` optimizer steps with the rate
        growing geometrically from ``min_lr`` to ``max_lr`` (every parameter group gets the
        same rate; a compiled ``lr_scheduler`` is not stepped), record each step's loss,
        and put the model back as it was.

        Stops early when the smoothed loss exceeds ``early_stop_threshold`` times the best
        smoothed loss so far, or is not finite (fastai's and Lightning's rule, 4x by
        default). The data is read as ``fit`` reads it, going on into its next epochs
        when it has fewer than ``num_steps`` batches (times ``grad_accum_steps``).
        Callbacks do not run. Afterwards the weights, optimizer, scheduler and scaler
        state, ``global_step`` and the run's position, the data source's position and the
        random generators are exactly those before the call, also when it raises.

        Args:
            x, y, batch_size, shuffle, sample_weight, class_weight, devices,
                work_load_list, seed, timeout, collate_fn, group_by_length: as for ``fit``.
            min_lr, max_lr: the first and last rate (``0 < min_lr < max_lr``).
            num_steps: optimizer steps of the sweep (2 to 1,000,000).
            early_stop_threshold: the divergence factor (> 1), or None to run every step.
            beta: the smoothing of ``LRFinder.losses`` (0 <= beta < 1; 0 is none).

        Returns:
            An ``LRFinder``: ``lrs``, ``losses``, ``suggestion``, ``plot(path)``.

        Raises:
            TypeError, ValueError: a bad argument (nothing ran). RuntimeError: not
                compiled, or several optimizers (their ``train_step`` sets the rates).
        """
        low = check_number("find_lr(min_lr=...)", min_lr, low=0, low_open=True,
                           fix="pass a positive rate, e.g. min_lr=1e-7")
        high = check_number("find_lr(max_lr=...)", max_lr, low=0, low_open=True,
                            fix="pass a positive rate, e.g. max_lr=1.0")
        if high <= low:
            fail("find_lr(max_lr=...)", max_lr, f"a rate above min_lr={min_lr!r}",
                 "sweep upwards: min_lr < max_lr, e.g. min_lr=1e-7, max_lr=1.0")
        # (its rates are listed before the sweep: a count past memory would hang there)
        steps = check_int("find_lr(num_steps=...)", num_steps, 2, maximum=MAX_STEPS,
                          fix="pass num_steps=100 (about what a range test needs)")
        if early_stop_threshold is not None:
            check_number("find_lr(early_stop_threshold=...)", early_stop_threshold, low=1,
                         low_open=True, fix="pass a factor such as 4.0, or None to never stop")
        smoothing = check_number("find_lr(beta=...)", beta, low=0, high=1, high_open=True,
                                 fix="pass beta=0.98 (fastai's), or 0 for no smoothing")
        compiled = self._require_compiled("find_lr")
        groups = compiled.trainable(self.module).param_groups
        if compiled.manual:
            raise RuntimeError("find_lr: the model has several optimizers, stepped by its "
                               "train_step; find_lr sets one optimizer's rate. Fix: compile "
                               "with one optimizer for the sweep.")
        accum = compiled.config.grad_accum_steps
        objects = self._checkpoint_objects("find_lr")
        before = copy.deepcopy(snapshot(objects))  # (snapshot holds the live tensors)
        try:  # (planning draws the data order's seed from torch's generator: restored too)
            plan = plan_fit(
                self, x, y, sample_weight, batch_size=batch_size, epochs=1, verbose=0,
                callbacks=None, validation_split=0.0, validation_data=None, shuffle=shuffle,
                class_weight=class_weight, initial_epoch=0, steps_per_epoch=steps * accum,
                validation_steps=None, validation_batch_size=None, validation_freq=1,
                devices=devices, work_load_list=work_load_list, seed=seed, monitor=None,
                resume=None, log_every=1, timeout=timeout, collate_fn=collate_fn,
                group_by_length=group_by_length)
            position = plan.source.state_dict()
            try:
                with self._call(plan, compiled) as session:
                    self.run.begin_fit(0)
                    session.start_fit()
                    if seed is not None:
                        torch.manual_seed(seed)  # dropout masks, as fit seeds them
                    lrs = geometric(low, high, steps)
                    losses, diverged = _sweep(session, groups, lrs, early_stop_threshold,
                                              smoothing)
            finally:
                plan.source.load_state_dict(position)
        finally:
            restore(objects, before, "find_lr", required=())
        return LRFinder(lrs[:len(losses)], losses, beta=smoothing, diverged=diverged)


MAX_STEPS = 1_000_000  # a range test's steps at most (100 is the usual sweep)


def _sweep(session: Session, groups: list[dict[str, Any]], lrs: list[float],
           threshold: float | None, beta: float) -> tuple[list[float], bool]:
    """Each step's loss at its rate, until the last rate, the end of a one-shot source, or
    divergence; and whether it diverged."""
    losses: list[float] = []
    best = math.inf
    steps = session.step_losses()
    try:
        for lr in lrs:
            for group in groups:
                group["lr"] = lr
            loss = next(steps, None)
            if loss is None:  # a one-shot source ran out
                return losses, False
            losses.append(loss)
            if threshold is None:
                continue
            smooth = smoothed(losses, beta)[-1]
            if not math.isfinite(smooth) or (len(losses) > 1 and smooth > threshold * best):
                return losses, True
            best = min(best, smooth)
        return losses, False
    finally:
        steps.close()
