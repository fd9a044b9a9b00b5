"""compile=True on several replicas: the caller's dynamo/inductor settings reach the replica
threads, which compile with them (issue 21 item 9: the config is thread-local since torch
2.12, so worker threads compiled with torch's defaults)."""

from __future__ import annotations

import functools
import threading

import torch
import torch._dynamo.config as dynamo
import torch._inductor.config as inductor
from torch import nn

import fitdp
from fitdp.executor import replica


def test_replica_threads_compile_with_the_callers_settings(monkeypatch):
    """Regression: a worker thread saw torch's default config, not the caller's."""
    seen: list[tuple[str, bool, bool, bool]] = []
    call_module = replica.call_module

    def spy(fn, inputs, kwargs=None):
        if isinstance(fn, functools.partial):  # a compiled replica: run it eagerly
            seen.append((threading.current_thread().name, dynamo.verbose,
                         inductor.max_autotune, inductor.force_disable_caches))
            return call_module(fn.args[0], inputs, kwargs)
        return call_module(fn, inputs, kwargs)

    monkeypatch.setattr(replica, "call_module", spy)
    model = fitdp.Model(nn.Linear(4, 3))
    model.compile(optimizer="sgd", loss="cross_entropy", compile=True)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    # force_disable_caches: inductor's name for a torch.compiler.config setting (an alias)
    with dynamo.patch(verbose=True), inductor.patch(max_autotune=True,
                                                    force_disable_caches=True):
        model.fit(x, y, batch_size=8, devices=["cpu", "cpu"], verbose=0)
    assert {name for name, *_ in seen} == {"MainThread", "fitdp-device-1"}
    assert all(all(flags) for _, *flags in seen), seen
    seen.clear()
    model.fit(x, y, batch_size=6, devices=["cpu", "cpu"], verbose=0)  # new shapes, defaults
    assert seen and not any(any(flags) for _, *flags in seen), seen
    model.close()
