"""A fit that fails before its first optimizer step leaves the model as it found it (issue 37
item 6): run position, counters, weights, BatchNorm statistics, optimizer state and the
user's data source; and arguments that can be checked before the first step are (a path or
file-name template that cannot work raises at the door, not after an epoch of training),
while arguments that work together are not refused there (a collate_fn for rows of x with
in-memory validation data)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore, Callback, CSVLogger, ModelCheckpoint

G = torch.Generator().manual_seed(3)
X, Y = torch.randn(32, 4, generator=G), torch.randint(0, 3, (32,), generator=G)


class FailingLoss:
    """cross_entropy that fails on its first call: after the forward moved BatchNorm."""

    def __init__(self) -> None:
        self.fail = False

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the user's loss failed")
        return nn.functional.cross_entropy(out, y)


def trained(loss: FailingLoss, devices: list[str]) -> fitdp.Model:
    """A BatchNorm MLP trained one epoch of 4 steps."""
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
    model.compile(optimizer="adam", loss=loss, lr=0.01)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, devices=devices)
    return model


def state(model: fitdp.Model) -> tuple:
    return ({k: v.clone() for k, v in model.module.state_dict().items()},
            repr(model.optimizer.state_dict()), repr(model.run))


def same(a: tuple, b: tuple) -> bool:
    return (a[0].keys() == b[0].keys() and all(torch.equal(v, b[0][k]) for k, v in a[0].items())
            and a[1:] == b[1:])


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_a_fit_failing_at_its_first_batch_leaves_position_and_batchnorm(devices, tmp_path):
    """Regression: the failed fit left epoch_done=False, batch=0 (and the BatchNorm statistics
    of the failed forward); a save then recorded it and the resume retrained epoch 0
    (global_step 12 instead of 8)."""
    loss = FailingLoss()
    model = trained(loss, devices)
    before = state(model)
    loss.fail = True
    with pytest.raises(RuntimeError, match="loss failed"):
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, devices=devices)
    assert same(state(model), before), (repr(model.run), before[2])
    loss.fail = False
    model.save(tmp_path / "m.ckpt")
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0, devices=devices,
              resume=str(tmp_path / "m.ckpt"))
    assert model.global_step == 8


def test_a_rate_set_by_a_callback_before_the_failed_first_batch_is_put_back():
    """Regression: LearningRateScheduler's on_epoch_begin set the rate, the first batch
    failed, and the optimizer kept the new rate."""
    loss = FailingLoss()
    model = trained(loss, ["cpu"])
    before = state(model)
    loss.fail = True
    schedule = fitdp.callbacks.LearningRateScheduler(lambda epoch, lr: 0.5)
    with pytest.raises(RuntimeError, match="loss failed"):
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[schedule])
    assert same(state(model), before)


def test_a_fit_failing_after_a_step_keeps_the_steps_position():
    """The other side of the rule: after an optimizer step the model is as after that step
    (the new fit's epoch 0, batch 1), not put back to before the call."""
    loss = FailingLoss()
    model = trained(loss, ["cpu"])

    class FailSecond(Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("second batch")

    with pytest.raises(RuntimeError, match="second batch"):
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[FailSecond()])
    run = model.run
    assert (run.global_step, run.epoch, run.batch, run.epoch_done) == (5, 0, 1, False)


@pytest.mark.parametrize("make", [
    lambda d: ModelCheckpoint(str(d / "{val_loss:.3f}.ckpt")),  # no validation data
    lambda d: ModelCheckpoint(str(d / "{epoch}-{batch}.ckpt")),  # batch: int save_freq only
    lambda d: ModelCheckpoint(str(d / "{loss:d}.ckpt")),  # a float formatted as an int
    lambda d: ModelCheckpoint(str(d / "file" / "{epoch}.ckpt")),  # a file as its folder
    lambda d: BackupAndRestore(str(d / "file" / "backup")),
    lambda d: CSVLogger(str(d / "file" / "log.csv")),
], ids=["val-key", "batch-key", "spec", "ckpt-folder", "backup-folder", "csv-folder"])
def test_paths_and_templates_are_checked_before_the_first_step(make, tmp_path):
    """Regression: these raised at the first save, after an epoch of training (or a raw
    FileExistsError/NotADirectoryError): now a ValueError naming the argument, when the
    callback is made or when fit checks its arguments; nothing trained, no file written."""
    (tmp_path / "file").write_text("a file, not a folder")
    model = trained(FailingLoss(), ["cpu"])
    before = state(model)
    files = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=r"filepath|backup_dir|filename") as err:
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[make(tmp_path)])
    assert "got" in str(err.value) and "Fix:" in str(err.value), str(err.value)
    assert same(state(model), before)
    assert sorted(p.name for p in tmp_path.rglob("*")) == files


ROWS = [{"x": x, "y": y} for x, y in zip(X, Y.tolist())]  # a list of rows: fitdp batches it


def collate(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([r["x"] for r in rows]), torch.tensor([r["y"] for r in rows])


@pytest.mark.parametrize("validation", ["tuple", "loader"])
def test_collate_fn_for_rows_with_validation_data_that_comes_batched(validation):
    """Regression: fit(rows, collate_fn=f, validation_data=(vx, vy)) was a TypeError ("a
    collate function together with validation_data of type Tensor"), though f batches rows
    only: validation data fitdp does not batch is used as it is (HF Trainer's
    data_collator also applies only where Trainer builds the DataLoader)."""
    vx, vy = X[:12], Y[:12]
    val = (vx, vy) if validation == "tuple" else torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(vx, vy), batch_size=4)
    model = trained(FailingLoss(), ["cpu"])
    history = model.fit(ROWS, batch_size=8, verbose=0, collate_fn=collate,
                        validation_data=val, validation_batch_size=4)
    assert history.history["val_loss"][0] == pytest.approx(
        model.evaluate(vx, vy, batch_size=4, verbose=0)["loss"], rel=1e-6)
    with pytest.raises(TypeError, match=r"^collate_fn: got a collate function together with x"):
        model.fit(X, Y, verbose=0, collate_fn=collate)  # training data it cannot apply to
