"""The measurements of ``bench/gpu.py``: each part takes a ``Ctx`` and returns a ``Result``.

On the CPU (``--dry-run``) every part runs the same code with tiny sizes, so the script is
known to run end to end up to the CUDA-only calls (sync debug mode, 16-mixed, CUDA graphs).
Each variant inside a part is guarded on its own (``Result.attempt``): one that raises
becomes a FAILED row and the part goes on.
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from overhead import compare, fitdp_loop, hand_loop, mlp

import fitdp
from fitdp.callbacks import Callback

SPEED_TARGET = 0.97  # fit's speed as a share of the hand loop's (issue 12.5)
SYNC_MESSAGE = "synchronizing CUDA operation"  # what torch's sync debug mode warns


@dataclass(frozen=True)
class Ctx:
    """Where a part runs and until when."""

    device: str  # "cuda:0", or "cpu" for a dry run
    deadline: float  # time.perf_counter() by which the part should have finished

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class Result:
    """Table rows (measure, value, target, verdict) and the raw numbers of one part; with a
    ``sink``, written there as JSON after every variant (a part killed at its time limit
    keeps what it measured)."""

    rows: list[list[str]] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    sink: Path | None = None

    def save(self) -> None:
        if self.sink is not None:
            self.sink.write_text(json.dumps({"rows": self.rows, "numbers": self.numbers},
                                            indent=1, default=str))

    def row(self, measure: str, value: str, target: str = "", ok: bool | None = None) -> None:
        self.rows.append([measure, value, target, "" if ok is None else "met" if ok
                          else "MISSED"])

    def attempt(self, label: str, fn: Callable[[], None]) -> bool:
        """Run one variant; an exception becomes a FAILED row (the traceback is printed).
        Returns whether it ran through."""
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - reported as a row, the part goes on
            traceback.print_exc()
            self.rows.append([label, f"{type(err).__name__}: {err}"[:160], "", "FAILED"])
            self.numbers[label] = {"error": f"{type(err).__name__}: {err}"}
            return False
        finally:
            self.save()
        return True


def learnable(rows: int, width: int, classes: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the class a fixed random projection gives them (a loss that can fall)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    return x, (x @ torch.randn(width, classes, generator=g)).argmax(1)


def new_model(sizes: list[int], device: str = "cpu", **compile_args: Any) -> fitdp.Model:
    """A seeded MLP on ``device``, compiled with cross entropy and (unless ``compile_args``
    says otherwise) Adam."""
    torch.manual_seed(0)
    model = fitdp.Model(mlp(sizes).to(device))
    model.compile(**{"optimizer": "adam", "lr": 1e-3, "loss": "cross_entropy",
                     **compile_args})
    return model


# -- speed: Model.fit against a hand-written loop --------------------------------------------


def speed(ctx: Ctx, res: Result) -> None:
    """Model.fit against overhead.py's hand loop (same MLP, Adam, data on the device),
    interleaved, warmed up, median per step; each fit call trains one epoch of many steps.
    The module starts on the device, as the loop's does (one on the host adds an upload and
    a download of the weights per fit call, not per step)."""
    cases = [("MLP 784-512-512-10, batch 256", [784, 512, 512, 10], 256, 400),
             ("MLP 784-4096-4096-10, batch 1024", [784, 4096, 4096, 10], 1024, 100)]
    if not ctx.cuda:
        cases = [("MLP 32-64-10, batch 32 (dry run)", [32, 64, 10], 32, 8)]
    for name, sizes, bs, steps in cases:
        def one(name: str = name, sizes: list[int] = sizes, bs: int = bs,
                steps: int = steps) -> None:
            x, y = learnable(bs * steps, sizes[0], sizes[-1])
            torch.manual_seed(0)
            net = mlp(sizes)
            got = compare(name, fitdp_loop(copy.deepcopy(net).to(ctx.device), x, y, bs,
                                           [ctx.device]),
                          hand_loop(copy.deepcopy(net), x, y, bs, ctx.device), steps,
                          7 if ctx.cuda else 1, ctx.cuda, clock="wall")
            share = 1.0 / float(got["ratio"])
            res.numbers[name] = {**got, "speed_share": share}
            res.row(f"fit speed / hand loop, {name}", f"{share:.3f}", f">= {SPEED_TARGET}",
                    share >= SPEED_TARGET if ctx.cuda else None)

        res.attempt(f"speed, {name}", one)


# -- syncs: host syncs per step between log points -------------------------------------------


class SyncCounter(Callback):
    """Counts CUDA host syncs in the training batches that are not log points.

    Inside each such batch (from its begin hook to its end hook: load, forward, backward,
    optimizer step) torch's sync debug mode is "warn" and the warnings are recorded, so a
    sync in a worker thread counts too. Log points (batch 0 and every ``log_every``-th batch,
    where fitdp reads loss and metrics on the host) are left alone. On the CPU there is
    nothing to count: the windows are still counted.
    """

    def __init__(self, log_every: int) -> None:
        super().__init__()
        self.log_every = log_every
        self.windows = 0
        self.syncs: list[tuple[int, str]] = []  # (batch, "file:line" of the Python caller)
        self._recording: contextlib.ExitStack | None = None
        self._seen: list[warnings.WarningMessage] = []

    def is_log_point(self, batch: int) -> bool:
        return batch == 0 or (batch + 1) % self.log_every == 0

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self.is_log_point(batch):
            return
        self.windows += 1
        stack = contextlib.ExitStack()
        self._seen = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, "default")
        self._recording = stack

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self.close():
            self.syncs += [(batch, f"{w.filename}:{w.lineno}") for w in self._seen
                           if SYNC_MESSAGE in str(w.message)]

    def close(self) -> bool:
        """End a window left open (by a fit that raised); True if one was open."""
        stack, self._recording = self._recording, None
        if stack is None:
            return False
        stack.close()
        return True

    def where(self) -> dict[str, int]:
        """How many syncs each Python line caused, most first."""
        counts: dict[str, int] = {}
        for _, place in self.syncs:
            counts[place] = counts.get(place, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def plain_adam(params: Any) -> torch.optim.Optimizer:
    """A user's own Adam (not fused): GradScaler.step reads its found-inf flag on the host."""
    return torch.optim.Adam(params, lr=1e-3)


def syncs(ctx: Ctx, res: Result) -> None:
    """Host syncs per step between log points, for the everyday variants; target 0. Measured
    too, with no target: what costs a sync by torch's or torchmetrics' design (a metric with
    its default arguments; 16-mixed with an unfused optimizer) and work_load_list="auto"."""
    d = ctx.device
    sizes, bs, steps, log_every = ([784, 512, 512, 10], 256, 60, 20) if ctx.cuda else \
        ([16, 32, 4], 8, 12, 4)
    from torchmetrics.classification import MulticlassAccuracy  # noqa: PLC0415

    classes = sizes[-1]
    micro = MulticlassAccuracy(classes, average="micro", validate_args=False)
    # label, devices, data on the device, compile and fit arguments, target syncs per step
    # (None: measured, no target)
    variants: list[tuple[str, list[str], bool, dict[str, Any], dict[str, Any], int | None]] = [
        ("1 device, data on the device", [d], True, {}, {}, 0),
        ("1 device, data on the host", [d], False, {}, {}, 0),
        ("2 replicas on one device", [d, d], True, {}, {}, 0),
        ("bf16-mixed", [d], True, {"precision": "bf16-mixed"}, {}, 0),
        ("a metric (micro accuracy, validate_args=False)", [d], True,
         {"metrics": [micro]}, {}, 0),
        # What users write: MulticlassAccuracy(n) checks its arguments on the host and
        # averages per class (macro).
        ("a metric with its defaults (MulticlassAccuracy(n))", [d], True,
         {"metrics": [MulticlassAccuracy(classes)]}, {}, None),
        ("work_load_list='auto', 2 replicas", [d, d], True, {}, {"work_load_list": "auto"},
         None),
    ]
    if ctx.cuda:
        variants += [
            ("16-mixed + fused Adam (optimizer='adam')", [d], True,
             {"precision": "16-mixed"}, {}, 0),
            ("16-mixed + a user's unfused Adam", [d], True,
             {"precision": "16-mixed", "optimizer": plain_adam}, {}, None),
        ]
    for label, devices, on_device, compile_args, fit_args, target in variants:
        def one(label: str = label, devices: list[str] = devices, on_device: bool = on_device,
                compile_args: dict[str, Any] = compile_args, fit_args: dict[str, Any] = fit_args,
                target: int | None = target) -> None:
            x, y = learnable(bs * steps, sizes[0], sizes[-1])
            if on_device:
                x, y = x.to(d), y.to(d)
            model = new_model(sizes, **compile_args)
            counter = SyncCounter(log_every)
            try:
                model.fit(x, y, batch_size=bs, devices=devices, log_every=log_every,
                          callbacks=[counter], verbose=0, **fit_args)
            finally:
                counter.close()
            per_step = len(counter.syncs) / max(counter.windows, 1)
            res.numbers[label] = {"syncs": len(counter.syncs), "steps": counter.windows,
                                  "per_step": per_step, "where": counter.where()}
            value = f"{per_step:.2f} ({len(counter.syncs)} in {counter.windows} steps)"
            if counter.syncs:  # the line that synced most, e.g. "group.py:161"
                value += " at " + Path(next(iter(counter.where()))).name
            if not ctx.cuda:
                value = f"n/a on the CPU ({counter.windows} steps watched)"
            res.row(f"host syncs / step, {label}", value,
                    "(measured)" if target is None else f"<= {target}",
                    per_step <= target if ctx.cuda and target is not None else None)

        res.attempt(f"syncs, {label}", one)


# -- replicas: two replicas on one GPU --------------------------------------------------------


def replicas(ctx: Ctx, res: Result) -> None:
    """devices=[d, d] (flat-bucket reduce; both replicas on the device's current stream)
    against [d]: the same weights after an epoch (allclose), time per step, and host time
    per step against step time (whether per-replica streams could pay)."""
    d = ctx.device
    sizes, bs, steps = ([784, 1024, 1024, 10], 512, 50) if ctx.cuda else ([16, 32, 4], 8, 6)
    x, y = learnable(bs * steps, sizes[0], sizes[-1])

    def agree() -> None:
        weights = []
        for devices in ([d], [d, d]):
            torch.manual_seed(0)
            model = fitdp.Model(mlp(sizes))
            model.compile(optimizer="sgd", lr=0.05, loss="cross_entropy")
            model.fit(x, y, batch_size=bs, devices=devices, shuffle=False, verbose=0)
            weights.append(model.get_weights())
        diff = max(float((a - weights[1][k]).abs().max()) for k, a in weights[0].items())
        close = all(torch.allclose(a, weights[1][k], rtol=1e-4, atol=1e-5)
                    for k, a in weights[0].items())
        res.numbers["max_abs_weight_difference"] = diff
        res.row("2 replicas vs 1: weights after an epoch (allclose 1e-4/1e-5)",
                f"max |diff| {diff:.2e}", "allclose", close)

    def timing() -> None:
        torch.manual_seed(0)
        net = mlp(sizes)
        got = compare("1 replica / 2 replicas on one device",
                      fitdp_loop(copy.deepcopy(net).to(d), x, y, bs, [d]),
                      fitdp_loop(copy.deepcopy(net).to(d), x, y, bs, [d, d]), steps,
                      5 if ctx.cuda else 1, ctx.cuda, clock="wall")
        res.numbers["timing"] = got
        res.row("2 replicas on one device: speed / 1 replica", f"{float(got['ratio']):.3f}",
                "(informative)")

    def host_share() -> None:
        for devices in ([d], [d, d]):
            host, step = host_and_step_ms(ctx, [128, 256, 256, 10], 64, 60 if ctx.cuda else 6,
                                          devices)
            label = f"{len(devices)} replica{'s' * (len(devices) > 1)} on one device"
            res.numbers[f"host time, {label}"] = {"host_ms": host, "step_ms": step}
            res.row(f"host / step time, {label} (small MLP)",
                    f"{host:.3f} / {step:.3f} ms = {host / step:.2f}", "(informative)")

    res.attempt("replicas agree", agree)
    res.attempt("replicas timing", timing)
    res.attempt("replicas host time", host_share)


class HostClock(Callback):
    """Host seconds from each batch's begin hook to its end hook, log points left out: what
    the host spends queueing a step (nothing waits for the GPU between log points)."""

    def __init__(self, log_every: int) -> None:
        super().__init__()
        self.log_every, self._start = log_every, 0.0
        self.seconds: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if batch and (batch + 1) % self.log_every:
            self.seconds.append(time.perf_counter() - self._start)


def host_and_step_ms(ctx: Ctx, sizes: list[int], bs: int, steps: int, devices: list[str]
                     ) -> tuple[float, float]:
    """(host ms per step, wall ms per step) of one epoch after a warm-up epoch. Host time
    near step time: the GPU waits for the host, and streams of their own per replica could
    not make two replicas on one GPU faster; far below it: the GPU is the limit, and they
    could only where each replica's kernels leave the GPU partly idle."""
    x, y = learnable(bs * steps, sizes[0], sizes[-1])
    x, y = x.to(ctx.device), y.to(ctx.device)
    model = new_model(sizes, ctx.device)
    model.fit(x, y, batch_size=bs, devices=devices, verbose=0)  # warm-up: allocations
    clock = HostClock(log_every=50)
    ctx.sync()
    start = time.perf_counter()
    model.fit(x, y, batch_size=bs, devices=devices, log_every=50, callbacks=[clock], verbose=0)
    ctx.sync()
    wall = (time.perf_counter() - start) / steps
    return statistics.median(clock.seconds) * 1e3, wall * 1e3


# -- precision: bf16-mixed and 16-mixed ------------------------------------------------------


def timed_epochs(model: fitdp.Model, ctx: Ctx, x: torch.Tensor, y: torch.Tensor, bs: int,
                 epochs: int, devices: list[str]) -> tuple[list[float], list[float]]:
    """Seconds and mean loss of each epoch, one fit call per epoch."""
    seconds, losses = [], []
    for _ in range(epochs):
        ctx.sync()
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=bs, devices=devices, verbose=0)
        ctx.sync()
        seconds.append(time.perf_counter() - start)
        losses.append(history.history["loss"][0])
    return seconds, losses


def precision(ctx: Ctx, res: Result) -> None:
    """Each precision trains the same MLP: time per step (epochs after the first) against
    "32", and whether its loss falls. 16-mixed on the CPU must be refused (it is CUDA only)."""
    d = ctx.device
    sizes, bs, steps, epochs = ([784, 4096, 4096, 10], 1024, 40, 5) if ctx.cuda else \
        ([16, 32, 4], 8, 6, 3)
    x, y = learnable(bs * steps, sizes[0], sizes[-1])
    x, y = x.to(d), y.to(d)
    per_step: dict[str, float] = {}
    for name in ("32", "bf16-mixed", "16-mixed"):
        def one(name: str = name) -> None:
            model = new_model(sizes, d, precision=name)
            if name == "16-mixed" and not ctx.cuda:
                try:
                    model.fit(x, y, batch_size=bs, devices=[d], verbose=0)
                except ValueError as err:
                    res.row("16-mixed on the CPU", "refused", "a ValueError",
                            "16-mixed" in str(err))
                    return
                res.row("16-mixed on the CPU", "accepted", "a ValueError", False)
                return
            seconds, losses = timed_epochs(model, ctx, x, y, bs, epochs, [d])
            per_step[name] = statistics.median(seconds[1:]) / steps
            fell = losses[-1] < losses[0]
            res.numbers[name] = {"ms_per_step": per_step[name] * 1e3, "losses": losses}
            base = per_step.get("32", per_step[name])
            res.row(f"{name}: ms / step (speed vs 32)",
                    f"{per_step[name] * 1e3:.3f} ({base / per_step[name]:.2f}x)")
            res.row(f"{name}: loss first -> last epoch", f"{losses[0]:.3f} -> {losses[-1]:.3f}",
                    "falls", fell)

        res.attempt(f"precision {name}", one)


PARTS: dict[str, Callable[[Ctx, Result], None]] = {
    "speed": speed, "syncs": syncs, "replicas": replicas, "precision": precision,
}
