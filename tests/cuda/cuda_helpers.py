"""What the CUDA tier shares: its devices, and helpers other test folders and the GPU bench
already define (imported from there, not copied: the tier checks on CUDA what they check on
the CPU, and counts host syncs the way ``python -m bench --gpu`` does)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
# Appended, never prepended: bench/ holds scripts named like common modules (run, report).
for folder in (TESTS / "model", TESTS / "executor", TESTS / "callbacks", TESTS.parent / "bench"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))

from gpu_parts import SyncCounter, learnable  # noqa: E402
from test_device_metrics import KINDS, PoolNet, _bce, _sequences  # noqa: E402
from test_equivalence import data, hand_loop, mlp  # noqa: E402
from test_resume import BATCH, EPOCHS, Crash, X, Y, assert_bitwise  # noqa: E402

CUDA = "cuda:0"
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
