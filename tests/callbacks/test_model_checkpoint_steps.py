"""ModelCheckpoint with `save_freq=N`: batch counting, batch logs in names and best-only,
resume of the cadence, and asynchronous saves with `keep`."""

from __future__ import annotations

import os

import pytest
import torch
from callback_helpers import FakeModel, attach, run_batches

from fitdp.callbacks import ModelCheckpoint
from fitdp.saving.checkpoint import load_checkpoint


def files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if not f.startswith("."))


def test_save_freq_counts_batches_like_keras(tmp_path):
    """Keras 3 (model_checkpoint_test, case 8a): save_freq=15 with 5 batches per epoch for 10
    epochs writes at the ends of epochs 3, 6 and 9 (counted over batches, across epochs)."""
    ckpt = ModelCheckpoint(str(tmp_path / "checkpoint.epoch{epoch:02d}.ckpt"), save_freq=15)
    model = attach(ckpt)
    run_batches(ckpt, model, epochs=10, steps=5, logs=lambda e, b: {"loss": 1.0})
    assert files(tmp_path) == [f"checkpoint.epoch{e:02d}.ckpt" for e in (3, 6, 9)]


def test_save_freq_ignores_the_models_step_count(tmp_path):
    """save_freq=N counts the batches this callback has seen, not `model.global_step`: a
    second fit (global step far from 0) or gradient accumulation (two batches per step)
    saves every N batches all the same."""
    ckpt = ModelCheckpoint(str(tmp_path / "b{batch}-s{step}.ckpt"), save_freq=3)
    model = attach(ckpt)
    model.global_step = 1000
    ckpt.on_train_begin({})
    ckpt.on_epoch_begin(0, {})
    for batch in range(7):
        model.global_step += batch % 2  # one optimizer step per two batches
        ckpt.on_train_batch_end(batch, {"loss": 1.0})
    assert files(tmp_path) == ["b3-s1001.ckpt", "b6-s1003.ckpt"]


def test_step_saves_see_that_batchs_loss_and_metrics(tmp_path):
    """Regression: `c-{epoch}-{batch}-{loss:.3f}` raised `KeyError: loss` with a step
    frequency, and best-only on `loss` never saved: names and decisions use the logs of the
    batch being saved."""
    ckpt = ModelCheckpoint(str(tmp_path / "c-{epoch}-{batch}-{loss:.3f}-{acc:.2f}.ckpt"),
                           monitor="loss", save_best_only=True, save_freq=2)
    model = attach(ckpt)
    losses = {(0, 1): 0.9, (0, 3): 0.7, (1, 1): 0.8, (1, 3): 0.5}
    run_batches(ckpt, model, epochs=2, steps=4,
                logs=lambda e, b: {"loss": losses.get((e, b), 5.0), "acc": 0.25 * b})
    assert files(tmp_path) == ["c-1-2-0.900-0.25.ckpt", "c-1-4-0.700-0.75.ckpt",
                               "c-2-4-0.500-0.75.ckpt"]
    assert ckpt.best == 0.5 and ckpt.needs_batch_logs
    assert [load_checkpoint(p)["step"] for p in model.saved] == [2, 4, 8]


def test_keras_batch_field_in_file_names(tmp_path):
    """Keras 3 (model_checkpoint_test, case 10a): `epoch{epoch:02d}batch{batch:02d}` with
    save_freq=1 writes one file per batch, both numbers 1-based."""
    ckpt = ModelCheckpoint(str(tmp_path / "checkpoint.epoch{epoch:02d}batch{batch:02d}.ckpt"),
                           save_freq=1, monitor="loss")
    model = attach(ckpt)
    run_batches(ckpt, model, epochs=2, steps=2, logs=lambda e, b: {"loss": 1.0})
    assert files(tmp_path) == [f"checkpoint.epoch{e:02d}batch{b:02d}.ckpt"
                               for e in (1, 2) for b in (1, 2)]


def test_step_frequency_state_survives_resume(tmp_path):
    """A run resumed mid-epoch keeps the batch count, the best value and the files to prune:
    it saves at the same batches an uninterrupted run would."""
    path = str(tmp_path / "s{step}.ckpt")
    ckpt = ModelCheckpoint(path, save_freq=3, keep=2)
    model = attach(ckpt)
    ckpt.on_train_begin({})
    ckpt.on_epoch_begin(0, {})
    for batch in range(5):  # saves after batch 2 (step 3); batches 3 and 4 are counted
        model.global_step += 1
        ckpt.on_train_batch_end(batch, {"loss": 1.0})
    state = ckpt.state_dict()
    torch.save(state, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # plain types only
    again = ModelCheckpoint(path, save_freq=3, keep=1)
    assert again.latest_checkpoint() == str(tmp_path / "s3.ckpt")  # found on disk
    attach(again, model)
    again.on_train_begin({})  # the model's order: begin, then the saved state
    again.load_state_dict(state)
    for batch in range(5, 8):
        model.global_step += 1
        again.on_train_batch_end(batch, {"loss": 1.0})
    assert files(tmp_path) == ["s6.ckpt", "state.pt"]  # s3 pruned by keep=1


def test_async_save_prunes_only_durable_files(tmp_path):
    """With async_save, an old file goes only once `keep` newer files are durable: the last
    save may still be in flight until the next save or the end of training."""
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"), keep=1, async_save=True)
    model = attach(ckpt)
    ckpt.on_train_begin({})
    ckpt.on_epoch_end(0, {"loss": 1.0})
    # In flight: the background thread writes it.
    assert model.saved == [str(tmp_path / "e1.ckpt")] and files(tmp_path) == []
    ckpt.on_epoch_end(1, {"loss": 1.0})
    assert files(tmp_path) == ["e1.ckpt"]  # e2 is in flight: e1 must stay
    ckpt.on_epoch_end(2, {"loss": 1.0})
    assert files(tmp_path) == ["e2.ckpt"]  # e2 durable, e3 in flight
    ckpt.on_train_end({})  # waits for e3, then prunes
    assert files(tmp_path) == ["e3.ckpt"]
    assert load_checkpoint(tmp_path / "e3.ckpt")["step"] == 0


def test_async_save_error_surfaces_at_next_save_and_at_train_end(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"), keep=1, async_save=True)
    model = attach(ckpt)
    ckpt.on_train_begin({})
    ckpt.on_epoch_end(0, {"loss": 1.0})
    model.fail_async = True
    with pytest.raises(OSError, match="background save of .*e1.ckpt failed"):
        ckpt.on_epoch_end(1, {"loss": 1.0})
    model.fail_async = False
    ckpt.on_epoch_end(2, {"loss": 1.0})
    model.fail_async = True
    with pytest.raises(OSError, match="e3.ckpt"):
        ckpt.on_train_end({})
    assert files(tmp_path) == []  # nothing durable was ever removed


def test_sync_saves_are_durable_at_once(tmp_path):
    ckpt = ModelCheckpoint(str(tmp_path / "e{epoch}.ckpt"), keep=1)
    model = FakeModel()
    attach(ckpt, model)
    ckpt.on_train_begin({})
    ckpt.on_epoch_end(0, {"loss": 1.0})
    ckpt.on_epoch_end(1, {"loss": 1.0})
    assert files(tmp_path) == ["e2.ckpt"]
