"""What the CUDA tier shares: its devices, a host-sync counter, and helpers other test folders
already define (imported from there, not copied: the tier checks on CUDA what they check on
the CPU)."""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import torch

from fitdp.callbacks import Callback

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS / "model", TESTS / "compiled", TESTS / "executor", TESTS / "callbacks"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))

from test_device_metrics import KINDS, PoolNet, _bce, _sequences  # noqa: E402
from test_equivalence import data, hand_loop, mlp  # noqa: E402
from test_resume import BATCH, EPOCHS, Crash, X, Y, assert_bitwise  # noqa: E402

CUDA = "cuda:0"
SYNC_MESSAGE = "synchronizing CUDA operation"  # what torch's sync debug mode warns
# One GPU, and two replicas on it: the multi-device path (flat-bucket reduce, replica threads)
# on a machine with one GPU. Both replicas run on the device's current stream (the caller's),
# and autograd runs their backwards on its one thread for that device: one after the other.
DEVICE_LISTS = {"1gpu": [CUDA], "2replicas": [CUDA, CUDA]}

__all__ = [
    "BATCH", "CUDA", "DEVICE_LISTS", "EPOCHS", "KINDS", "X", "Y", "Crash", "PoolNet",
    "SyncCounter", "_bce", "_sequences", "assert_bitwise", "data", "hand_loop", "learnable",
    "mlp", "to_cpu",
]


def to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in tensors.items()}


def learnable(rows: int, width: int, classes: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the class a fixed random projection gives them (a loss that can fall)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    return x, (x @ torch.randn(width, classes, generator=g)).argmax(1)


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
