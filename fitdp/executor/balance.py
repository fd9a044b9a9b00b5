"""What the manager measures of its devices: work loads that balance themselves
(``work_load_list="auto"``), and whether CPU replica threads are slower than one thread.

Both take the times the executor group records anyway (``perf_counter`` at the start and end
of each device's share: well under a microsecond per step) and decide in plain Python, so a
test can feed them any timings.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from fitdp.executor.slicing import split_input_slice


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


class SlowReplicaCheck:
    """Over a manager's first training batches: do its CPU replicas, run at once, take longer
    than one thread running every device's share one after another (what one replica
    would do)? Small models do: their threads queue for Python's GIL.

    Skips ``warmup`` batches (a run's first batches are slower), then measures ``probes``
    pairs of batches, one batch of each pair one share after another (``serial_next``) and
    one at once, next to each other in time, so a change of the machine's load hits both
    sides of a pair alike. The order alternates pair by pair (serial first, then at once
    first): after a batch at once the other threads' OpenMP workers spin for a while and
    slow whatever runs next, so neither side always pays it. It warns when at once is
    slower by ``margin`` in the median pair *and* in at least ``agree`` of the pairs: a few
    batches disturbed by another process cannot decide alone. Then it is done and costs
    nothing; until then ``probes`` training batches run on one thread.

    Example:
        >>> check = SlowReplicaCheck(warmup=0, probes=1)
        >>> check.serial_next(), check.record(True, 0.001)
        (True, None)
        >>> check.serial_next(), check.record(False, 0.002)
        (False, (0.002, 0.001))
    """

    def __init__(self, *, warmup: int = 5, probes: int = 6, margin: float = 1.1,
                 agree: float = 0.75) -> None:
        self.warmup, self.probes, self.margin, self.agree = warmup, probes, margin, agree
        self.batches = 0
        self.serial: list[float] = []
        self.together: list[float] = []
        self.done = False

    def serial_next(self) -> bool:
        """Whether the next training batch should run its shares one after another."""
        k = self.batches - self.warmup
        if k < 0 or k >= 2 * self.probes:
            return False
        pair, second = divmod(k, 2)
        return (pair % 2 == 0) != bool(second)  # pairs alternate: S T, T S, S T, ...

    def record(self, serial: bool, seconds: float) -> tuple[float, float] | None:
        """One training batch's time on its shares. Once decided: (median time at once,
        median time one after another) when at once is the slower (see the class), else
        None; ``done`` is then set."""
        self.batches += 1
        if self.batches <= self.warmup or self.done:
            return None
        (self.serial if serial else self.together).append(seconds)
        if len(self.together) < self.probes or len(self.serial) < self.probes:
            return None
        self.done = True
        ratios = [t / max(s, 1e-12) for s, t in zip(self.serial, self.together)]
        slower = sum(r > self.margin for r in ratios)
        if statistics.median(ratios) > self.margin and slower >= self.agree * len(ratios):
            return statistics.median(self.together), statistics.median(self.serial)
        return None


    def state_dict(self) -> dict[str, Any]:
        """Where the check is (plain numbers: a checkpoint's): a resumed run runs its
        remaining batches one after another where the uninterrupted one does."""
        return {"batches": self.batches, "serial": list(self.serial),
                "together": list(self.together), "done": self.done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batches, self.done = int(state["batches"]), bool(state["done"])
        self.serial = [float(v) for v in state["serial"]]
        self.together = [float(v) for v in state["together"]]

def slow_replicas_message(devices: int, together: float, alone: float) -> str:
    """The warning ``SlowReplicaCheck`` leads to: both numbers and the fix."""
    return (f"devices: the {devices} CPU replicas' forward and backward took "
            f"{together * 1e3:.3f} ms per batch running at once, but {alone * 1e3:.3f} ms one "
            f"after another on one thread (measured over the first training batches): one "
            f"replica would train faster here (a small model spends its time in Python, and "
            f"threads queue for Python's GIL). Fix: train on fewer devices, e.g. "
            f"devices=['cpu'].")
