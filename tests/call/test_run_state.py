"""One run state, reset per call: the five leaks of issue 9, each pinned by its reproducer."""

from __future__ import annotations

import gc
import pickle
import threading
import time

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import Callback, EarlyStopping


def make(devices_dropout: float = 0.0) -> fitdp.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(devices_dropout), nn.Linear(16, 3))
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy")
    return model


G = torch.Generator().manual_seed(3)
X, Y = torch.randn(300, 4, generator=G), torch.randint(0, 3, (300,), generator=G)


class StopAfterFirstBatch(Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = True


class FailAt(Callback):
    """Raises at a given batch of the first fit only."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError("boom")


def test_stopped_fit_does_not_truncate_later_predict_and_evaluate():
    """Regression: after a callback stopped fit, predict returned 32 of 300 rows and
    evaluate scored one batch (stop_training leaked into the next calls)."""
    model = make()
    model.fit(X, Y, epochs=3, callbacks=[StopAfterFirstBatch()], verbose=0)
    assert model.stop_training  # Keras leaves the flag set after the fit...
    assert model.predict(X).shape == (300, 3)  # ...but every call starts with its own
    full = model.evaluate(X, Y, verbose=0)["loss"]
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model.module(X), Y).item()
    assert full == pytest.approx(expected, rel=1e-5)


def test_early_stopping_then_evaluate_scores_every_batch():
    model = make()
    model.fit(X, Y, epochs=20, validation_data=(X[:30], Y[:30]), verbose=0,
              callbacks=[EarlyStopping(monitor="loss", patience=0, min_delta=10.0)])
    seen = []
    probe = fitdp.callbacks.LambdaCallback(on_test_batch_end=lambda b, logs: seen.append(b))
    model.evaluate(X, Y, batch_size=32, callbacks=[probe], verbose=0)
    assert seen == list(range(10))


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_failed_fit_during_accumulation_leaves_no_gradient_behind(devices):
    """Regression: a fit that raised during gradient accumulation left micro_step and the
    gradients behind, and the next fit's first step added them in."""
    model, fresh = make(), make()
    model.compile(optimizer="sgd", lr=0.1, grad_accum_steps=3)
    fresh.compile(optimizer="sgd", lr=0.1, grad_accum_steps=3)
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(X, Y, batch_size=10, shuffle=False, devices=devices, verbose=0,
                  callbacks=[FailAt(1)])
    assert model.run.micro_step == 0 and model.global_step == 0
    assert all(p.grad is None or not p.grad.any() for p in model.module.parameters())
    for m in (model, fresh):
        m.fit(X, Y, batch_size=10, shuffle=False, devices=devices, verbose=0)
    for a, b in zip(model.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)


def test_bucket_iterator_position_does_not_leak_between_calls():
    """Regression: a BucketIterator kept its position: a fit after an exception trained 6 of
    9 batches, and predict(it) after fit(it, steps_per_epoch=2) returned 22 rows of 30."""
    seqs = [torch.randint(1, 9, (n,)) for n in [3, 5, 7] * 10]
    labels = torch.tensor([0, 1, 2] * 10)

    torch.manual_seed(0)
    model = fitdp.Model(_BagOfWords())
    model.compile(optimizer="sgd", loss="cross_entropy")
    it = fitdp.BucketIterator(seqs, labels, batch_size=4, buckets=[3, 5, 7], seed=0)
    assert len(it) == 9
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(it, verbose=0, callbacks=[FailAt(2)])
    seen = []
    model.fit(it, verbose=0, callbacks=[fitdp.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: seen.append(b))])
    assert seen == list(range(9))
    model.fit(it, steps_per_epoch=2, verbose=0)
    state = it.state_dict()
    assert state["position"] == 2
    assert model.predict(it).shape == (30, 3)
    assert it.state_dict() == state  # predict and evaluate give the iterator back unmoved
    model.evaluate(it, verbose=0)
    assert it.state_dict() == state


def test_a_failed_fit_gives_the_users_iterator_back_at_its_last_step():
    seqs = [torch.randint(1, 9, (4,)) for _ in range(12)]
    it = fitdp.BucketIterator(seqs, torch.zeros(12, dtype=torch.long), batch_size=2,
                              buckets=[4], shuffle=False)
    model = fitdp.Model(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(16, 2)))
    model.compile(optimizer="sgd")
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(it, verbose=0, callbacks=[FailAt(3)])
    assert it.state_dict()["position"] == 4 and model.global_step == 4


def test_dropped_models_release_their_worker_threads():
    """Regression: every dropped Model that ran on several devices leaked a worker thread
    (100 Models -> +90 threads)."""
    gc.collect()
    before = threading.active_count()
    for _ in range(20):
        model = make()
        model.fit(X[:40], Y[:40], devices=["cpu", "cpu", "cpu"], verbose=0)
        del model
    gc.collect()
    deadline = time.monotonic() + 10  # a collected model's threads stop without a join
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before


def test_close_and_context_manager_release_threads_and_keep_weights():
    before = threading.active_count()
    with make() as model:
        model.fit(X[:40], Y[:40], devices=["cpu", "cpu"], verbose=0)
        assert threading.active_count() == before + 1
        weights = model.get_weights()
    assert threading.active_count() == before
    assert all(torch.equal(v, model.module.state_dict()[k]) for k, v in weights.items())
    model.fit(X[:40], Y[:40], devices=["cpu", "cpu"], verbose=0)  # usable after close
    model.close()


def test_failing_lr_scheduler_changes_nothing():
    """Regression: a failing lr_scheduler left the engine half built; the next fit trained
    without it."""
    model = make()
    old = model.optimizer

    def bad(opt):
        raise ValueError("no scheduler today")

    with pytest.raises(ValueError, match="no scheduler today"):
        model.compile(optimizer="adam", lr_scheduler=bad)
    assert model.optimizer is old and model.lr_scheduler is None  # the previous compile
    model.compile(optimizer="sgd", lr=1.0,
                  lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    h = model.fit(X, Y, epochs=3, verbose=0)
    assert h.history["lr"] == [1.0, 0.5, 0.25]


def test_trained_model_pickles_and_keeps_training():
    model = make()
    model.fit(X, Y, devices=["cpu", "cpu"], verbose=0)
    copy = pickle.loads(pickle.dumps(model))
    for a, b in zip(copy.module.parameters(), model.module.parameters()):
        assert torch.equal(a, b)
    assert copy.optimizer.param_groups[0]["params"][0] is next(copy.module.parameters())
    assert copy.global_step == model.global_step
    for m in (copy, model):
        m.fit(X, Y, shuffle=False, verbose=0)
    for a, b in zip(copy.module.parameters(), model.module.parameters()):
        assert torch.equal(a, b)


def test_unpicklable_model_says_which_part_and_why():
    model = make()
    model.compile(optimizer="sgd", lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(
        opt, 1))
    with pytest.raises(TypeError, match=r"compile\(lr_scheduler=...\).*lambda"):
        pickle.dumps(model)


def test_every_call_clears_only_its_own_stop_flag():
    model = make()

    class StopEvaluating(Callback):
        def on_test_batch_end(self, batch, logs=None):
            self.model.stop_evaluating = True

    seen = []
    probe = fitdp.callbacks.LambdaCallback(on_test_batch_end=lambda b, logs: seen.append(b))
    model.evaluate(X, Y, callbacks=[StopEvaluating(), probe], verbose=0)
    assert seen == [0] and model.stop_evaluating
    seen.clear()
    model.evaluate(X, Y, callbacks=[probe], verbose=0)
    assert len(seen) == 10


def test_fit_resumes_a_bucket_iterator_mid_epoch_exactly(tmp_path):
    """A resumed epoch continues the iterator where the checkpoint left it (set_epoch is not
    called for the restored epoch), and the weights end bitwise as an uninterrupted run's."""
    seqs = [torch.randint(1, 9, (n,)) for n in [3, 5, 7] * 8]
    labels = torch.tensor([0, 1, 2] * 8)

    def model() -> fitdp.Model:
        torch.manual_seed(0)
        m = fitdp.Model(_BagOfWords())
        m.compile(optimizer="adam", lr=0.05)
        return m

    def it() -> fitdp.BucketIterator:
        return fitdp.BucketIterator(seqs, labels, batch_size=4, buckets=[3, 5, 7], seed=4)

    ref = model()
    ref.fit(it(), epochs=2, verbose=0)
    path = str(tmp_path / "c.ckpt")
    first = model()
    with pytest.raises(RuntimeError, match="boom"):
        first.fit(it(), epochs=2, verbose=0, callbacks=[
            fitdp.callbacks.ModelCheckpoint(path, monitor="loss", save_freq=1), FailAt(3)])
    resumed = model()
    resumed.fit(it(), epochs=2, verbose=0, resume=path)
    assert resumed.global_step == ref.global_step == 12
    for a, b in zip(resumed.module.parameters(), ref.module.parameters()):
        assert torch.equal(a, b)


class _BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x).mean(1))
