"""The caller's ``torch.compile`` settings, carried into the replica threads.

Since torch 2.12 the overrides of ``torch._dynamo.config``, ``torch._inductor.config`` (and
``torch.compiler.config``, which some of their names alias) are thread-local: a setting made
on the main thread (``torch._inductor.config.max_autotune = True``, a ``config.patch(...)``
block) is not seen on another thread. Replicas 1.. compile on their device threads, so
without this they would compile with torch's defaults while replica 0 (on the caller's
thread) used the user's settings: different graphs per replica.

The manager takes a copy of the caller's settings when it is made and at the start of each
fit/evaluate/predict (about 0.5 ms: the config modules, about 800 keys); a replica thread
takes them over before it compiles a new shape (they stay set on that thread, so a recompile
on a guard failure sees them too). The recompile limits are left out: fitdp raises those per
thread itself.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

# torch.compiler.config holds the settings the other two alias (force_disable_caches, ...).
MODULES = ("torch.compiler.config", "torch._dynamo.config", "torch._inductor.config")
# Raised per thread by the executor (``_raise_recompile_limit``); never copied over.
MANAGED = frozenset({"recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"})


class CompileConfig:
    """A copy of one thread's dynamo and inductor settings, to set on other threads.

    Example:
        >>> import threading, torch._inductor.config as inductor
        >>> settings = CompileConfig()
        >>> with inductor.patch(max_autotune=True):
        ...     settings.capture()
        >>> seen = []
        >>> def worker():
        ...     settings.apply()
        ...     seen.append(inductor.max_autotune)
        >>> t = threading.Thread(target=worker); t.start(); t.join()
        >>> seen
        [True]
    """

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {}
        self.thread = 0
        self.capture()

    def capture(self) -> None:
        """Copy the calling thread's settings (the thread whose settings the replicas use)."""
        self.values = {name: importlib.import_module(name).get_config_copy()
                       for name in MODULES}
        self.thread = threading.get_ident()

    def apply(self) -> None:
        """Make the calling thread's settings the captured ones (those that differ; not the
        recompile limits). On the capturing thread itself nothing changes: what the user
        set there since is theirs."""
        if threading.get_ident() == self.thread:
            return
        for name, values in self.values.items():
            config = importlib.import_module(name)
            mine = config.get_config_copy()
            for key, value in values.items():
                if key not in MANAGED and key in mine and mine[key] != value:
                    setattr(config, key, value)


def check_compile(compile: bool | str, devices: Sequence[torch.device]) -> None:
    """Refuse what cannot work: before torch 2.13, inductor's CUDA-graph state lives on the
    thread that first used it (pytorch#123177), so ``"reduce-overhead"`` throws on the second
    replica's thread."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if compile == "reduce-overhead" and len(devices) > 1 and version < (2, 13):
        raise ValueError(
            f"compile: got 'reduce-overhead' (CUDA graphs) with {len(devices)} devices on "
            f"torch {torch.__version__}; expected torch 2.13 or later for CUDA graphs from "
            f"several replica threads (pytorch#123177). Fix: upgrade torch, compile=True "
            f"(the default mode), or one device per process under torchrun.")
