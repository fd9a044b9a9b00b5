"""Work loads that balance themselves (``work_load_list="auto"``): a plug-in of the step.

``LoadBalancer`` decides in plain Python from each device's times, so a test can feed it any
timings. ``Balancing`` is what a step binds only when the loads are ``"auto"``: it times each
device's share of a batch (``ShareClock``: the host clock on the CPU, CUDA events read later
elsewhere) and hands the times to the balancer; a step with a list of loads runs none of it.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import Any

import torch

from fitdp.executor.share_clock import ShareClock
from fitdp.executor.slicing import split_input_slice
from fitdp.executor.step import Job, device_share


class LoadBalancer:
    """Work loads from measured device speeds, so every device finishes its share together.

    Over a window of batches, each device's speed is its rows per second of its own share
    (load, forward, backward, metrics); the loads become those speeds. Then it keeps
    watching: when the devices' times drift apart by more than ``drift`` (median over a
    window), it measures again. Batches right after a change of loads are not counted (the
    first batch of a new shape allocates).

    Args:
        devices: how many devices.
        window: batches per measurement.
        warmup: batches skipped after each change of loads.
        drift: re-balance when the slowest device's median time exceeds the fastest's by
            this factor.

    Example:
        >>> lb = LoadBalancer(2, window=2, warmup=0)
        >>> lb.record([50, 50], [0.01, 0.02])  # device 1 at half speed
        >>> lb.record([50, 50], [0.01, 0.02])
        [1.333, 0.667]
    """

    def __init__(self, devices: int, *, window: int = 5, warmup: int = 2,
                 drift: float = 1.15) -> None:
        self.devices, self.window, self.warmup, self.drift = devices, window, warmup, drift
        self.loads = [1.0] * devices
        self.balanced = False  # loads come from a measurement
        self._skip = warmup
        self._speeds: list[list[float]] = []  # per batch: each device's share of the speed
        self._spread: list[float] = []  # per batch: slowest device's time / fastest's

    def record(self, rows: Sequence[int], seconds: Sequence[float]) -> list[float] | None:
        """One batch: each device's rows and seconds. Returns the new loads when they change.

        A batch where some device had nothing to do (a short last batch) tells nothing."""
        if self._skip:
            self._skip -= 1
            return None
        if min(rows) <= 0 or min(seconds) <= 0:
            return None
        speeds = [r / t for r, t in zip(rows, seconds)]
        total = sum(speeds)
        self._speeds.append([s / total for s in speeds])
        self._spread.append(max(seconds) / min(seconds))
        if len(self._speeds) < self.window:
            return None
        spread = statistics.median(self._spread)
        shares = [statistics.median(col) for col in zip(*self._speeds)]
        self._speeds, self._spread = [], []
        if self.balanced and spread <= self.drift:
            return None
        loads = self._loads(shares, sum(rows))
        self.balanced = True
        if split_input_slice(sum(rows), loads) == split_input_slice(sum(rows), self.loads):
            return None  # the same rows per device: nothing to change
        self.loads = loads
        self._skip = self.warmup
        return loads

    def _loads(self, shares: Sequence[float], rows: int) -> list[float]:
        """Loads proportional to ``shares`` (summing to the number of devices, 3 decimals),
        none so small that a batch of ``rows`` leaves its device empty: a device given no
        rows could never be measured again."""
        n = self.devices
        total = sum(shares)
        least = min(1.0, 1.5 * n / rows) if rows else 1.0
        loads = [max(n * s / total, least) for s in shares]
        scale = n / sum(loads)
        return [round(w * scale, 3) for w in loads]

    def reset(self) -> None:
        """Forget the measurements of the current window (e.g. another kind of batch)."""
        self._speeds, self._spread = [], []
        self._skip = self.warmup

    def state_dict(self) -> dict[str, Any]:
        """The loads in use and the window measured so far (plain numbers: a checkpoint's),
        so a resumed run splits its batches as the uninterrupted one."""
        return {"loads": list(self.loads), "balanced": self.balanced, "skip": self._skip,
                "speeds": [list(r) for r in self._speeds], "spread": list(self._spread)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loads = [float(w) for w in state["loads"]]
        self.balanced, self._skip = bool(state["balanced"]), int(state["skip"])
        self._speeds = [[float(v) for v in r] for r in state["speeds"]]
        self._spread = [float(v) for v in state["spread"]]


class Balancing:
    """``work_load_list="auto"`` bound into a step: each device's share of a batch timed,
    and the times handed to ``balancer``.

    Args:
        balancer: the manager's ``LoadBalancer``.
        devices: the devices, in order.

    Example:
        >>> b = Balancing(LoadBalancer(2), [torch.device("cpu")] * 2)
        >>> b.times
        [0.0, 0.0]
    """

    def __init__(self, balancer: LoadBalancer, devices: Sequence[torch.device]) -> None:
        self.balancer = balancer
        self.clock = ShareClock(devices)
        self.times = [0.0] * len(devices)  # each device's seconds on its last share
        self._tasks: dict[int, list[Callable[[], None]]] = {}  # per group's job, made once

    def tasks(self, job: Job) -> list[Callable[[], None]]:
        """The batch's shares, each timed (made once per group's job)."""
        tasks = self._tasks.get(id(job))
        if tasks is None:
            tasks = self._tasks[id(job)] = [functools.partial(self._timed, job, d)
                                             for d in range(len(job.executors))]
        return tasks

    def decide(self, job: Job) -> tuple[list[float], list[float]] | None:
        """After the batch's hand-off, the balancer's decision: new loads and the times
        they come from, or None. On the CPU this batch's times; on CUDA those of the
        batches whose events have run by now (no host sync)."""
        rows = [s.stop - s.start for s in job.slices]
        for done_rows, seconds in self.clock.finished(rows, self.times):
            new = self.balancer.record(done_rows, seconds)
            if new is not None:
                self.clock.forget()  # the batches still pending ran the old loads
                return new, seconds
        return None

    def _timed(self, job: Job, d: int) -> None:
        start = perf_counter()
        self.clock.begin(d)
        device_share(job, d)
        self.clock.end(d)  # a CUDA share's device time: read later, no host sync
        self.times[d] = perf_counter() - start
