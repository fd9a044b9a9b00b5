"""The choice of a call's engine (``fitdp.executor.engine``) from ``compile(strategy=...)``,
the call's devices and its world size.

``compile(strategy=...)`` takes ``"auto"``, a name of the registry ``ENGINES`` or an
options object (``fitdp.DDP(...)``, ``fitdp.FSDP(...)``); ``engine_for`` turns it into the
engine the executor manager runs its replicas with, once per call's replicas: the named
strategy's engine for one device per rank, else (``"auto"``) DDP there and fitdp's own
flat-bucket reduction (``LocalReduce``: one process, or several local devices per rank).

A strategy is registered here by its options class (``EngineOptions``: its ``name``, its
``engine()``, and what it needs beyond one device per rank, ``scaled``); adding an engine is
its own file and one entry below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fitdp.executor.ddp import DDP
from fitdp.executor.engine import Engine, EngineOptions
from fitdp.executor.fsdp import FSDP
from fitdp.executor.local_reduce import LocalReduce
from fitdp.executor.zero1 import ZeRO1

# The registry: strategy name -> its options class (called without arguments: the defaults).
ENGINES: dict[str, type[EngineOptions]] = {options.name: options for options in (DDP, FSDP, ZeRO1)}
STRATEGIES = ("auto", *ENGINES)  # what compile(strategy=...) takes by name

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
        raise ValueError(f"strategy: got {value!r}; expected one of {list(STRATEGIES)} or a "
                         f"strategy's options (fitdp.DDP(...), fitdp.FSDP(...)). Fix: "
                         f"strategy='auto' (DDP when each rank drives one device)")
    return value


def engine_for(strategy: Strategy, devices: Sequence[torch.device], world_size: int,
               bucketed: bool = False, compiled: bool = False, custom_step: bool = False,
               scaled: bool = False) -> Engine:
    """The engine for a call's replicas: the named strategy's for one device per rank;
    under ``"auto"`` DDP there, fitdp's own reduction otherwise (one process, several local
    devices per rank, or a ``bucket_module``, each bucket running its own module, which one
    wrapper cannot cover, ``compile``, or a custom step). ``scaled``: a ``GradScaler``
    steps (16-mixed).

    Raises:
        ValueError: a named strategy that cannot work here, naming why and the fix.
    """
    name = strategy.name if isinstance(strategy, EngineOptions) else strategy
    if name == "auto":
        if world_size > 1 and len(devices) == 1 and not (bucketed or compiled or custom_step):
            return DDP().engine()
        return LocalReduce(distributed=world_size > 1)
    options = strategy if isinstance(strategy, EngineOptions) else ENGINES[name]()
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
    if scaled and not options.scaled:
        raise ValueError(
            f"compile(strategy={name!r}, precision='16-mixed'): got a GradScaler with {name}; "
            f"expected precision '32' or 'bf16-mixed' ({name} steps the optimizer itself, "
            f"which a GradScaler cannot skip). Fix: precision='bf16-mixed', or strategy='ddp'")
    return options.engine()
