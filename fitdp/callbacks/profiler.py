"""`Profiler`: torch.profiler traces of fit's steps, fitdp's phases named in them."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from fitdp.callbacks.base import Callback
from fitdp.checks import check_bool, check_folder, check_int, check_path_arg


class Profiler(Callback):
    """Runs `torch.profiler` over fit's training steps on its `schedule` and writes each
    recorded window as a Chrome trace (`<dir>/rank<r>.<time>.pt.trace.json`), the file
    TensorBoard's profiler plugin (`tensorboard --logdir <dir>`) and Perfetto
    (ui.perfetto.dev) open. As Lightning's `PyTorchProfiler`.

    Each training batch is one profiler step (`ProfilerStep#N` in the trace): the first
    `wait` are skipped, the next `warmup` run the profiler without keeping what it sees,
    the next `active` are recorded and written; `repeat` such cycles (0: until fit ends).
    Inside each step fitdp's phases are named ranges, on every device thread (on a torch
    whose profiler cannot record other threads, `profile_all_threads`, the caller's only):
    `fitdp.load`, `fitdp.forward`, `fitdp.backward`, `fitdp.metrics`, `fitdp.reduce`
    (gradients summed over replicas and ranks) and `fitdp.step` (the optimizer). A fit
    with this callback binds its step with those ranges; a fit without one runs no range
    code at all. CPU activity is recorded, and CUDA's when a GPU is present. Every process
    writes its own trace (its rank in the name). A window cut short by the end of fit is
    written then. A fit takes one `Profiler` (torch runs one profiler session at a time:
    `fit` refuses a second before anything changes).

    Args:
        dir: the folder the traces go to (made when the first is written).
        wait: steps skipped at the start of each cycle (`torch.profiler.schedule`'s).
        warmup: steps then profiled without keeping the events.
        active: steps then recorded and written as one trace.
        repeat: cycles; 0 repeats them until fit ends.
        record_shapes: record the inputs' shapes (`torch.profiler.profile`'s option).
        profile_memory: record tensor allocations and frees.
        with_stack: record the Python stack of each op.

    Attributes:
        traces: the files written so far, in order.

    Raises:
        TypeError: `dir` is not a path; a count is not an int; a flag is not a bool.
        ValueError: a negative `wait`, `warmup` or `repeat`, or `active` below 1; `dir` is
            (or is under) a file.

    Example:
        >>> prof = Profiler("runs/profile", wait=1, warmup=1, active=3)
        >>> prof.traces
        []
    """

    names_phases = True

    def __init__(self, dir: str | os.PathLike[str] = "profile", wait: int = 1,  # noqa: A002
                 warmup: int = 1, active: int = 3, repeat: int = 1, *,
                 record_shapes: bool = False, profile_memory: bool = False,
                 with_stack: bool = False) -> None:
        super().__init__()
        self.dir = check_path_arg("Profiler(dir=...)", dir, "'runs/profile'")
        # (steps torch.profiler counts in C integers: sys.maxsize at most)
        self.wait = check_int("Profiler(wait=...)", wait, 0, maximum=sys.maxsize)
        self.warmup = check_int("Profiler(warmup=...)", warmup, 0, maximum=sys.maxsize)
        self.active = check_int("Profiler(active=...)", active, 1, maximum=sys.maxsize)
        self.repeat = check_int("Profiler(repeat=...)", repeat, 0, maximum=sys.maxsize)
        check_folder("Profiler(dir=...)", self.dir)
        self.record_shapes = check_bool("Profiler(record_shapes=...)", record_shapes)
        self.profile_memory = check_bool("Profiler(profile_memory=...)", profile_memory)
        self.with_stack = check_bool("Profiler(with_stack=...)", with_stack)
        self.traces: list[str] = []
        self._profile: Any = None

    state_field = "dir"

    def check_fit(self, params: dict[str, Any]) -> None:
        """The trace folder can still be made (a file put there since is found now)."""
        check_folder("Profiler(dir=...)", self.dir)

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self.stop()  # one left running by a fit that raised
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(
            activities=activities, on_trace_ready=self._write,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup,
                                             active=self.active, repeat=self.repeat),
            experimental_config=_all_threads(),
            record_shapes=self.record_shapes, profile_memory=self.profile_memory,
            with_stack=self.with_stack)
        self._profile.start()

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self._profile is not None:
            self._profile.step()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop profiling now, writing a window in progress (fit's end does this; call it
        after a fit that raised to stop at once rather than at the next fit's start)."""
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()

    def _write(self, profile: Any) -> None:
        """One recorded window to a Chrome trace file (`on_trace_ready`)."""
        os.makedirs(self.dir, exist_ok=True)
        rank = os.environ.get("RANK", "0")  # torchrun's; every process writes its own
        path = os.path.join(self.dir, f"rank{rank}.{time.time_ns()}.pt.trace.json")
        profile.export_chrome_trace(path)
        self.traces.append(path)


def _all_threads() -> Any:
    """Kineto's option to record every thread, the replicas' worker threads too (started
    before the profiler); None on a torch without it (the calling thread's events only)."""
    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None
