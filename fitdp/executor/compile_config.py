"""How a replica compiles: the caller's ``torch.compile`` settings, carried into the replica
threads, and a code object, recompile limit and first-compile lock per replica (see below).

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

import functools
import importlib
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# torch.compiler.config holds the settings the other two alias (force_disable_caches, ...).
MODULES = ("torch.compiler.config", "torch._dynamo.config", "torch._inductor.config")
# Raised per thread by the executor (``raise_recompile_limit``); never copied over.
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


# Dynamo (torch.compile) keeps its graphs in a cache per code object, and that cache is not
# safe to share between threads: replicas running at once on their device threads through one
# cache recompile shapes they had already compiled (measured: 10 cached shapes, 2 threads ->
# 3-8 spurious recompilations). So each executor compiles a code object of its own (a copy of
# ``_run_module``): its cache holds only its own input shapes, and only its thread touches it.
_THREAD = threading.local()  # the recompile limit this thread has already raised dynamo's to
LIMIT_MARGIN = 8  # room for dynamo's own guard failures (the default limit)
# A new shape compiles under this lock, one replica thread at a time: dynamo and inductor
# keep process-wide state (caches, config, CUDA-graph trees) that concurrent first calls
# from several device threads would race on; cached shapes run without it.
COMPILE_LOCK = threading.Lock()


def _run_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What an executor compiles (as a private copy, see above)."""
    return module(*args, **kwargs)


def compile_replica(module: nn.Module, name: str, mode: str | None = None) -> Callable[..., Any]:
    """``torch.compile`` ``module`` (with ``mode``, e.g. ``"reduce-overhead"`` for CUDA
    graphs) through a code object of its own, with static shapes (one
    graph per bucket shape: bucket shapes are few and known)."""
    template = _run_module.__code__
    fn = types.FunctionType(template.replace(co_name=name), _run_module.__globals__, name)
    return functools.partial(torch.compile(fn, dynamic=False, mode=mode), module)


def raise_recompile_limit(entries: int) -> None:
    """Let dynamo keep ``entries`` graphs per code object, in this thread: dynamo's config
    overrides are thread-local, and each device thread may compile. Never lowers a limit."""
    if getattr(_THREAD, "limit", 0) >= entries:
        return
    import torch._dynamo  # noqa: PLC0415 - only needed with compile=True

    config = torch._dynamo.config
    for names in (("recompile_limit", "cache_size_limit"),  # the second: before torch 2.7
                  ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        name = next(n for n in names if hasattr(config, n))
        setattr(config, name, max(getattr(config, name), entries))
    _THREAD.limit = entries
