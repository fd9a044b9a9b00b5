"""A Model's life: copies (``copy.deepcopy``) and release of its worker threads on ``del``."""

from __future__ import annotations

import copy
import gc
import threading
import time

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import EarlyStopping

X, Y = torch.randn(40, 4), torch.randint(0, 3, (40,))
TWO = ["cpu", "cpu"]


def make(**kw) -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), **kw)
    model.compile(optimizer="adam", lr=0.01,
                  lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    return model


def use(model: fitdp.Model) -> None:
    """Every kind of call, with callbacks the model keeps (its History)."""
    model.fit(X, Y, epochs=2, devices=TWO, validation_data=(X, Y), verbose=0,
              callbacks=[EarlyStopping(monitor="val_loss", patience=5)])
    model.evaluate(X, Y, devices=TWO, verbose=0)
    model.predict(X, devices=TWO)


def test_del_model_releases_its_worker_threads_without_the_garbage_collector():
    """Regression (issue 17 item 19): ``del model`` left the Model's worker threads running
    until the cyclic collector ran (27 Python threads after a loop of new Models): the
    History in ``model.history`` held the model, a reference cycle. Callbacks now hold the
    model weakly; dropping the last reference stops the threads at once."""
    use(make())  # first use: torch's lazy imports leave cycles of their own behind
    gc.collect()
    assert settled() == []  # earlier tests' models, collected
    gc.disable()
    try:
        for _ in range(5):
            model = make()
            use(model)
            assert len(workers()) == 1  # one worker thread, for device 1
            history = model.history
            del model
            assert settled() == []  # stopped by del, with the collector off
            assert history.model is None and len(history.history["loss"]) == 2
    finally:
        gc.enable()


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fitdp-device-")]


def settled(seconds: float = 10.0) -> list[threading.Thread]:
    """The worker threads still alive after up to ``seconds``: a dropped model's workers
    are told to stop, not joined, so they end a moment later."""
    deadline = time.monotonic() + seconds
    while workers() and time.monotonic() < deadline:
        time.sleep(0.01)
    return workers()


def test_deepcopy_of_a_model_with_a_lambda_bucket_module():
    """Regression (issue 17 item 18): ``copy.deepcopy(Model(net, bucket_module=lambda k:
    ...))`` raised "cannot be pickled": deepcopy went through ``__getstate__``. The copy has
    its own module, optimizer (on the copy's parameters), scheduler, run state and history,
    shares the bucket_module function (as deepcopy shares functions), and trains exactly
    like the original from there."""
    model = make(bucket_module=lambda key: nn.Linear(4, 3))
    model.fit(X, Y, epochs=2, devices=TWO, verbose=0, seed=1)
    twin = copy.deepcopy(model)
    assert twin.bucket_module is model.bucket_module and twin.module is not model.module
    assert twin.optimizer is not model.optimizer
    assert {id(p) for g in twin.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in twin.module.parameters()}
    assert twin.lr_scheduler.optimizer is twin.optimizer and twin.global_step == 4
    assert twin.history.model is twin and twin.history.history == model.history.history
    logs = [m.fit(X, Y, devices=TWO, verbose=0, seed=2).history for m in (model, twin)]
    assert logs[0] == logs[1]
    for a, b in zip(model.module.state_dict().values(), twin.module.state_dict().values()):
        assert torch.equal(a, b)


def test_deepcopy_during_a_call_is_refused():
    model = make()
    copies = fitdp.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: copy.deepcopy(model))
    with pytest.raises(RuntimeError, match="during fit"):
        model.fit(X, Y, verbose=0, callbacks=[copies])
