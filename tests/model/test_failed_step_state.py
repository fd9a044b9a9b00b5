"""A fit that fails after it completed optimizer steps leaves the model as after the last of
them (docs/design.md, "What a call does"): BatchNorm statistics on every replica and on the
host, weights, optimizer state and the run position. A fit whose data runs out as an epoch
begins counts no such epoch: its History and run position hold only epochs that trained."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn

import fitdp
from fitdp.callbacks import Callback

G = torch.Generator().manual_seed(5)
X, Y = torch.randn(48, 4, generator=G), torch.randint(0, 3, (48,), generator=G)
VX, VY = X[:8], Y[:8]
FAIL_AT = 2  # the failing batch: two optimizer steps completed before it


class Switch:
    """Whether the batch running now is the one that fails (set by ``FailAt``)."""

    on = False

    @classmethod
    def check(cls, what: str) -> None:
        if cls.on:
            raise RuntimeError(f"the user's {what} failed")


class FailingLoss:
    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        Switch.check("loss")
        return nn.functional.cross_entropy(out, y)


class FailingMetric(torchmetrics.MeanMetric):
    """Fails in its update: after the forward and backward of the batch."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:  # type: ignore[override]
        Switch.check("metric")
        super().update(preds.sum())


class FailAt(Callback):
    """Turns ``Switch`` on as the fit's batch ``at`` (counted over its epochs) begins, and
    keeps each replica's buffers as every batch ends (the test reads those of the last
    completed step)."""

    def __init__(self, at: int | None) -> None:
        super().__init__()
        self.at, self.begun = at, 0
        self.buffers: list[list[list[torch.Tensor]]] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        Switch.on = self.begun == self.at
        self.begun += 1

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.buffers.append([[t.clone() for t in block]
                             for block in self.model._replicas.manager.aux_arrays])


def fit_failing(model: fitdp.Model, data: Any, *, match: str = "loss failed", **kw: Any
                ) -> None:
    """``model.fit(data, **kw)``, which must raise; ``Switch`` off again after it."""
    try:
        with pytest.raises((RuntimeError, IndexError), match=match):
            model.fit(data, verbose=0, **kw)
    finally:
        Switch.on = False


def bn_model(**compile_kw: Any) -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                      nn.Linear(8, 3)))
    model.compile(optimizer="adam", loss=FailingLoss(), lr=0.01, **compile_kw)
    return model


def assert_same_model(model: fitdp.Model, ref: fitdp.Model) -> None:
    got, want = model.module.state_dict(), ref.module.state_dict()
    changed = [k for k in want if not torch.equal(got[k], want[k])]
    assert not changed, changed
    assert model.optimizer is not None and ref.optimizer is not None
    assert repr(model.optimizer.state_dict()) == repr(ref.optimizer.state_dict())


def batches(bad_target_at: int | None = None) -> torch.utils.data.DataLoader:
    """X, Y in batches of 8 as a DataLoader; the batch ``bad_target_at`` has targets that
    cross_entropy rejects, out of range (fitdp checks the first batch's, not every one)."""
    items = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, len(X), 8)]
    if bad_target_at is not None:
        x, y = items[bad_target_at]
        items[bad_target_at] = (x, y + 3)
    return torch.utils.data.DataLoader(items, batch_size=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["1cpu", "2cpu"])
@pytest.mark.parametrize("fails", ["loss", "target", "metric"])
def test_a_step_failing_after_two_steps_leaves_the_second_steps_state(fails, devices):
    """Regression: the failed batch's forward had moved BatchNorm's running statistics (and
    num_batches_tracked) on the replicas it reached, and fit kept them: the saved model's
    statistics were those of a step that never happened."""
    metrics = [FailingMetric()] if fails == "metric" else None
    model, hook = bn_model(metrics=metrics), FailAt(None if fails == "target" else FAIL_AT)
    data = batches(FAIL_AT) if fails == "target" else batches()
    fit_failing(model, data, match="failed|out of bounds", devices=devices,
                callbacks=[hook])
    run = model.run
    assert (run.global_step, run.epoch, run.batch, run.micro_step, run.epoch_done) == \
        (2, 0, 2, 0, False)
    replicas = model._replicas.manager.aux_arrays
    after_two = hook.buffers[FAIL_AT - 1]
    for block, kept in zip(replicas, after_two, strict=True):
        assert all(torch.equal(t, k) for t, k in zip(block, kept, strict=True))
    ref = bn_model()  # the same two steps, and nothing else
    ref.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0, devices=devices)
    assert_same_model(model, ref)


def test_a_failed_micro_batch_leaves_the_last_optimizer_steps_buffers():
    """Regression: with grad_accum_steps=2 the micro-batches after the last optimizer step
    kept their BatchNorm updates although their gradients were dropped."""
    model, hook = bn_model(grad_accum_steps=2), FailAt(3)  # step 2's second micro-batch
    fit_failing(model, batches(), devices=["cpu", "cpu"], callbacks=[hook])
    assert (model.run.global_step, model.run.batch) == (1, 2)
    for block, kept in zip(model._replicas.manager.aux_arrays, hook.buffers[1], strict=True):
        assert all(torch.equal(t, k) for t, k in zip(block, kept, strict=True))
    ref = bn_model(grad_accum_steps=2)
    ref.fit(X[:16], Y[:16], batch_size=8, shuffle=False, verbose=0, devices=["cpu", "cpu"])
    assert_same_model(model, ref)


def test_a_resumed_fit_failing_at_its_first_batch_leaves_the_checkpoints_buffers(tmp_path):
    """Regression: the resume had moved the step count, so the rollback took the call for
    one that had stepped and kept the failed forward's BatchNorm statistics."""
    model = bn_model()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    model.save(tmp_path / "m.ckpt")
    other = bn_model()  # a fresh model (step 0) resumes the checkpoint's step 6
    fit_failing(other, X, y=Y, batch_size=8, epochs=2, shuffle=False,
                resume=str(tmp_path / "m.ckpt"), callbacks=[FailAt(0)])
    assert other.global_step == 6
    assert_same_model(other, model)


def assert_even(history: fitdp.callbacks.History, epochs: list[int]) -> None:
    assert history.epoch == epochs
    lengths = {k: len(v) for k, v in history.history.items()}
    assert set(lengths.values()) == {len(epochs)} and "loss" in lengths, lengths


def test_a_fit_failing_in_its_third_epoch_leaves_its_first_two_in_model_history():
    """Regression: model.history was set only when fit returned, so after the failure it was
    still None. Keras's History sets model.history as each epoch ends
    (keras/src/callbacks/history.py): the epochs that completed are there."""
    model = bn_model()
    fit_failing(model, X, y=Y, batch_size=8, epochs=3, shuffle=False,
                validation_data=(VX, VY), callbacks=[FailAt(13)])  # epoch 2's second batch
    assert model.history is not None
    assert_even(model.history, [0, 1])
    assert set(model.history.history) == {"loss", "val_loss", "lr"}
    run = model.run
    assert (run.epoch, run.epoch_done, run.batch, run.global_step) == (2, False, 1, 13)


# -- data that runs out as an epoch begins ------------------------------------------------------


class Epochs(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.ended: list[int] = []

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.ended.append(epoch)


def test_a_generator_ending_at_an_epochs_end_gives_an_even_history():
    """Regression: a generator of 4 batches with steps_per_epoch=2 and epochs=3 ran out as
    epoch 2 began, and that epoch was still validated and recorded: `val_loss` and `lr` had
    3 values, `loss` 2, and the run counted epoch 2 as done. Keras warns "Your input ran out
    of data; interrupting training" (keras/src/trainers/epoch_iterator.py) and ends the run:
    fitdp stops there too, with the epochs that trained."""
    model, seen = bn_model(), Epochs()
    gen = ((X[i:i + 8], Y[i:i + 8]) for i in range(0, 32, 8))  # 4 batches
    with pytest.warns(UserWarning, match="ran out before steps_per_epoch"):
        history = model.fit(gen, epochs=3, steps_per_epoch=2, validation_data=(VX, VY),
                            verbose=0, callbacks=[seen])
    assert_even(history, [0, 1])
    assert seen.ended == [0, 1]
    run = model.run
    assert (run.epoch, run.epoch_done, run.global_step, run.batch, run.data_epoch) == \
        (1, True, 4, 2, 0)


class OnePass(torch.utils.data.IterableDataset):
    """Rows on its first pass only (a stream read once)."""

    def __init__(self) -> None:
        self.passes = 0

    def __iter__(self) -> Any:
        self.passes += 1
        if self.passes == 1:
            yield from zip(X[:16], Y[:16])


def test_a_loader_with_no_batch_on_its_second_pass_stops_with_a_warning():
    """Regression: epoch 1 trained nothing and was recorded without a loss (`val_loss` had
    one value more than `loss`), and so was epoch 2."""
    model = bn_model()
    loader = torch.utils.data.DataLoader(OnePass(), batch_size=8)
    with pytest.warns(UserWarning, match="ran out before epoch 1's first batch"):
        history = model.fit(loader, epochs=3, validation_data=(VX, VY), verbose=0)
    assert_even(history, [0])
    assert (model.run.epoch, model.run.epoch_done, model.global_step) == (0, True, 2)
