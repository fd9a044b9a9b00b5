"""Exact resume: an interrupted run continues to the very weights of an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore, Callback, ModelCheckpoint
from fitdp.checks import FitdpWarning

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(50, 6, generator=G), torch.randint(0, 3, (50,), generator=G)
EPOCHS, BATCH = 3, 8  # 7 steps per epoch, 21 in all


def make(dropout: float = 0.3) -> fitdp.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3))
    model = fitdp.Model(net)
    model.compile("adamw", lr=0.01,
                  lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    return model


class Crash(Callback):
    """Simulates a crash right after optimizer step ``at`` (after the checkpoint was saved)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == self.at:
            raise KeyboardInterrupt(f"crash at step {self.at}")


def run(model: fitdp.Model, callbacks, devices=("cpu",), **kw) -> None:
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, seed=1, verbose=0, devices=list(devices),
              callbacks=callbacks, **kw)


def assert_bitwise(a: fitdp.Model, b: fitdp.Model) -> None:
    for (k, v), w in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.equal(v, w), k


@pytest.fixture(scope="module")
def reference() -> fitdp.Model:
    model = make()
    run(model, [])
    return model


# 0: died before the first checkpoint; 3: mid-epoch; 7: last batch of epoch 0, before its
# scheduler step; 21: the last step.
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("crash_at", [0, 3, 7, 21])
def test_resume_bitwise_after_interruption(tmp_path, reference, crash_at, async_save):
    ckpt = ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=1, monitor="loss",
                           async_save=async_save)
    model = make()
    with pytest.raises(KeyboardInterrupt):
        run(model, [ckpt, Crash(crash_at)] if crash_at else [ckpt, Crash(1)])
    if crash_at == 0:  # the crash came before any file: start over
        for f in tmp_path.iterdir():
            f.unlink()
    resumed = make()
    run(resumed, [ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=1,
                                  monitor="loss")], resume="latest")
    assert resumed.global_step == EPOCHS * 7
    assert_bitwise(resumed, reference)


def test_resume_at_epoch_boundary_and_twice_in_a_row(tmp_path, reference):
    backup = str(tmp_path / "backup")
    model = make()
    with pytest.raises(KeyboardInterrupt):
        run(model, [BackupAndRestore(backup), Crash(9)])  # backup holds epoch 0's end
    again = make()
    with pytest.raises(KeyboardInterrupt):
        run(again, [BackupAndRestore(backup, save_freq=1), Crash(16)])
    final = make()
    run(final, [BackupAndRestore(backup)])  # resumes from the backup on its own (Keras)
    assert_bitwise(final, reference)
    assert not os.path.exists(os.path.join(backup, "backup.ckpt"))  # deleted after success


def test_resume_on_other_devices_is_close(tmp_path):
    ref = make(dropout=0.0)
    run(ref, [])
    model = make(dropout=0.0)
    path = str(tmp_path / "c.ckpt")
    with pytest.raises(KeyboardInterrupt):
        run(model, [ModelCheckpoint(path, save_freq=1, monitor="loss"), Crash(10)])
    resumed = make(dropout=0.0)
    run(resumed, [], devices=("cpu", "cpu"), resume=path)
    for a, b in zip(resumed.module.parameters(), ref.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_history_and_callback_state_survive_resume(tmp_path):
    path = str(tmp_path / "c.ckpt")
    model = make()
    with pytest.raises(KeyboardInterrupt):
        run(model, [ModelCheckpoint(path, monitor="loss"), Crash(15)])
    resumed = make()
    h = resumed.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, seed=1, verbose=0,
                    callbacks=[ModelCheckpoint(path, monitor="loss")], resume=path)
    assert h.epoch == [0, 1, 2] and len(h.history["loss"]) == 3


def test_save_load_restores_weights_and_optimizer(tmp_path):
    model = make()
    run(model, [])
    model.save(tmp_path / "m.ckpt")
    state = torch.load(tmp_path / "m.ckpt", weights_only=True)  # plain torch can read it
    assert state["run"]["global_step"] == 21 and set(state) >= {"module", "optimizer", "rng"}
    other = make()
    other.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, devices=["cpu", "cpu"])
    other.load(tmp_path / "m.ckpt")
    assert_bitwise(other, model)
    replicas = other._replicas.manager.param_arrays[0]
    assert all(torch.equal(r, model.module[0].weight) for r in replicas)  # into every replica
    assert other.optimizer.state_dict()["state"][0]["step"] == 21


def test_resume_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        run(make(), [], resume=str(tmp_path / "missing.ckpt"))
    with pytest.raises(ValueError, match="latest"):
        run(make(), [], resume="latest")
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(fitdp.CheckpointError, match="bad.ckpt"):
        run(make(), [], resume=str(bad))


TRAINER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_resume import make, run
    from fitdp.callbacks import BackupAndRestore
    model = make()
    run(model, [BackupAndRestore({backup!r}, save_freq=1, async_save={async_save!r})])
    torch.save(model.module.state_dict(), {out!r})
""")


@pytest.mark.parametrize("async_save", [False, True])
def test_sigkill_at_random_moments_then_resume(tmp_path, reference, async_save):
    """A real crash: SIGKILL the training process mid-run, restart, compare final weights
    (with backups written in the background too)."""
    out = tmp_path / "final.pt"
    script = tmp_path / "train.py"
    script.write_text(TRAINER.format(tests=os.path.dirname(__file__), async_save=async_save,
                                     backup=str(tmp_path / "b"), out=str(out)))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # kill three times at random moments, then let it finish
        proc = subprocess.Popen([sys.executable, str(script)])
        try:
            proc.wait(timeout=1.5 + 1.5 * float(torch.rand(1, generator=g)))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
    subprocess.run([sys.executable, str(script)], check=True, timeout=120)
    final = torch.load(out, weights_only=True)
    for k, v in reference.module.state_dict().items():
        assert torch.equal(final[k], v), k
    assert not [p for p in (tmp_path / "b").glob(".*tmp*")]


def test_load_before_first_fit_keeps_optimizer_state(tmp_path):
    """Regression: load() right after compile() dropped the optimizer state (none existed)."""
    model = make()
    run(model, [])
    model.save(tmp_path / "m.ckpt")
    fresh = make()
    fresh.load(tmp_path / "m.ckpt")
    fresh.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, devices=["cpu"])
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 21 + 7


@pytest.mark.parametrize("size,again,steps", [(4, 0, 3 + 7 + 2 * 13), (5, 4, 3 + 6 + 2 * 10)])
def test_resume_with_another_batch_size_warns_naming_both(tmp_path, size, again, steps):
    """Regression (issue 17 item 17): resuming with another batch_size continued silently
    from a batch position that no longer lined up with the samples trained. It continues
    after the samples already trained (rounded down to a whole new batch) and warns, naming
    both sizes and how many samples train again."""
    path = str(tmp_path / "c-{step:03d}.ckpt")
    model = make()
    with pytest.raises(KeyboardInterrupt):
        run(model, [ModelCheckpoint(path, save_freq=1, monitor="loss"), Crash(3)])
    resumed = make()
    with pytest.warns(FitdpWarning, match=rf"3 batches into epoch 0 with batch_size=8, "
                      rf"this fit has batch_size={size}; the epoch continues after the 24 "
                      rf"samples already trained{f', and the last {again}' if again else '[.]'}"):
        resumed.fit(X, Y, batch_size=size, epochs=EPOCHS, seed=1, verbose=0,
                    callbacks=[ModelCheckpoint(path, save_freq=1, monitor="loss")],
                    resume="latest")
    assert resumed.global_step == steps


def test_resume_with_the_same_batch_size_says_nothing(tmp_path, recwarn):
    path = str(tmp_path / "c-{step:03d}.ckpt")
    with pytest.raises(KeyboardInterrupt):
        run(make(), [ModelCheckpoint(path, save_freq=1, monitor="loss"), Crash(3)])
    run(make(), [], resume=sorted(tmp_path.iterdir())[-1])
    assert not [w for w in recwarn if "batch_size" in str(w.message)]
