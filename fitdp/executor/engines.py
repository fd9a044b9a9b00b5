"""The choice of a call's engine (``fitdp.executor.engine``) from ``compile(strategy=...)``,
the call's devices and its world size.

``compile(strategy=...)`` takes ``"auto"``, ``"ddp"``, ``"fsdp"`` or an options object
(``fitdp.DDP(...)``, ``fitdp.FSDP(...)``); ``engine_for`` turns it into the engine the
executor manager runs its replicas with, once per call's replicas: DDP or FSDP2 for one
device per rank, else fitdp's own flat-bucket reduction (``LocalReduce``: one process, or
several local devices per rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fitdp.executor.ddp import DDP
from fitdp.executor.engine import Engine, EngineOptions
from fitdp.executor.fsdp import FSDP
from fitdp.executor.local_reduce import LocalReduce

STRATEGIES = ("auto", "ddp", "fsdp")

Strategy = str | EngineOptions


def check_strategy(value: Any) -> Strategy:
    """``compile(strategy=...)``'s value, checked (combinations are checked per call).

    Raises:
        ValueError, TypeError: naming what was received and what is expected.
    """
    if isinstance(value, EngineOptions):
        value.check()
        return value
    if not isinstance(value, str) or value not in STRATEGIES:
        raise ValueError(f"strategy: got {value!r}; expected one of {list(STRATEGIES)} or "
                         f"fitdp.DDP(...)/fitdp.FSDP(...). Fix: strategy='auto' (DDP when each "
                         f"rank drives one device)")
    return value


def engine_for(strategy: Strategy, devices: Sequence[torch.device], world_size: int,
               bucketed: bool = False, compiled: bool = False, custom_step: bool = False
               ) -> Engine:
    """The engine for a call's replicas: DDP or FSDP2 for one device per rank, fitdp's own
    reduction otherwise (one process, several local devices per rank, or under ``"auto"`` a
    ``bucket_module``, each bucket running its own module, which one wrapper cannot cover,
    ``compile``, or a custom step).

    Raises:
        ValueError: ``"ddp"``/``"fsdp"`` that cannot work here, naming why and the fix.
    """
    name = strategy.name if isinstance(strategy, EngineOptions) else strategy
    if name == "auto":
        if world_size > 1 and len(devices) == 1 and not (bucketed or compiled or custom_step):
            return DDP().engine()
        return LocalReduce(distributed=world_size > 1)
    if world_size < 2:
        raise ValueError(
            f"compile(strategy={name!r}): got one process (WORLD_SIZE={world_size}); expected "
            f"a torchrun job of several ranks. Fix: launch with torchrun --nproc-per-node N, "
            f"or strategy='auto' (replicas in this process)")
    if len(devices) > 1:
        raise ValueError(
            f"compile(strategy={name!r}): got {len(devices)} local devices in one process "
            f"({[str(d) for d in devices]}); expected one device per rank ({name} wraps one "
            f"device's module). Fix: one process per device (torchrun --nproc-per-node "
            f"{len(devices)}) with devices='auto', or strategy='auto' for local replicas")
    if compiled:
        raise ValueError(
            f"compile(strategy={name!r}, compile=...): got torch.compile with {name}; "
            f"expected one of them in this version. Fix: compile=False, or strategy='auto' "
            f"(compiled replicas with fitdp's own reduction)")
    if custom_step:
        raise ValueError(
            f"compile(strategy={name!r}): got a Model that overrides train_step/compute_loss; "
            f"expected the default step in this version (a custom step may call the module "
            f"around {name}'s wrapper). Fix: strategy='auto' (fitdp's own reduction runs "
            f"custom steps)")
    if bucketed:
        raise ValueError(
            f"compile(strategy={name!r}): got a Model with bucket_module; expected one module "
            f"({name} wraps one module, each bucket runs its own). Fix: strategy='auto' "
            f"(fitdp's own reduction covers every bucket)")
    options = strategy if isinstance(strategy, EngineOptions) else (
        DDP() if name == "ddp" else FSDP())
    return options.engine()
