"""SIGTERM during fit (a preempted job): the step finishes, every BackupAndRestore writes its
backup, fit raises fitdp.Preempted (exit code 143), and the same script run again resumes to
the very weights of an uninterrupted run (issue 32 item 3)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore, Callback, LambdaCallback
from fitdp.saving.checkpoint import load_checkpoint

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 6, generator=G), torch.randint(0, 3, (64,), generator=G)
EPOCHS, BATCH = 3, 8  # 8 steps per epoch


def make() -> fitdp.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    model = fitdp.Model(net)
    model.compile("adam", lr=0.01)
    return model


class Sigterm(Callback):
    """Sends this process SIGTERM at the end of optimizer step ``at`` (as a scheduler would)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def previous_handler():
    """A SIGTERM handler of the caller's own, put back after the test."""
    got: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    yield got
    signal.signal(signal.SIGTERM, old)


def test_sigterm_finishes_the_step_writes_every_backup_and_raises_preempted(
        tmp_path, previous_handler):
    model = make()
    backups = [BackupAndRestore(str(tmp_path / "a")),
               BackupAndRestore(str(tmp_path / "b"), save_freq=3)]
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(fitdp.Preempted, match=r"^fit: preempted \(SIGTERM\) after optimizer "
                       r"step 11; backup: .*a/backup.ckpt, .*b/backup.ckpt") as err:
        model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                  callbacks=[*backups, Sigterm(11)])
    assert err.value.code == 143 and isinstance(err.value, SystemExit)
    assert model.global_step == 11  # the step that was running finished; no other began
    for cb in backups:
        assert load_checkpoint(cb.path)["run"]["global_step"] == 11
    assert signal.getsignal(signal.SIGTERM) is handler  # the caller's handler is back
    assert previous_handler == []  # fit took the signal; the caller's handler did not run


def test_a_sigterm_after_the_last_step_is_sent_on_to_the_previous_handler(previous_handler):
    """Never swallowed: fit ended before acting on it, so the restored handler gets it."""
    kill = LambdaCallback(on_train_end=lambda logs: os.kill(os.getpid(), signal.SIGTERM))
    make().fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[kill])
    assert previous_handler == [signal.SIGTERM]


def test_evaluate_and_predict_leave_sigterm_alone():
    handler = signal.getsignal(signal.SIGTERM)
    model = make()
    seen = []
    cb = LambdaCallback(on_test_batch_end=lambda b, logs: seen.append(
        signal.getsignal(signal.SIGTERM)))
    model.evaluate(X, Y, verbose=0, callbacks=[cb])
    assert seen and all(h is handler for h in seen)


SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    sys.path.insert(0, {tests!r})
    from test_preemption import BATCH, EPOCHS, X, Y, make
    from fitdp.callbacks import BackupAndRestore, Callback

    marker = {marker!r}


    class WaitForTheSignal(Callback):
        # At step 11 of the first run, say so and wait until the test has sent SIGTERM.
        def on_train_batch_end(self, batch, logs=None):
            if self.model.global_step == 11 and not os.path.exists(marker + ".sent"):
                open(marker + ".ready", "w").close()
                deadline = time.monotonic() + 60
                while not os.path.exists(marker + ".sent") and time.monotonic() < deadline:
                    time.sleep(0.01)


    model = make()
    model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, seed=1, verbose=0,
              callbacks=[BackupAndRestore({backup!r}), WaitForTheSignal()])
    torch.save(model.module.state_dict(), {out!r})
""")


def test_a_script_sent_sigterm_mid_epoch_exits_143_and_resumes_bitwise(tmp_path):
    """The SLURM / spot-instance story: SIGTERM mid-epoch (epoch 1, batch 3; the backup is
    per epoch, so only the one written on SIGTERM holds step 11), exit code 143, the same
    command again, and the weights of a run never interrupted (torch.equal)."""
    marker, out = str(tmp_path / "marker"), tmp_path / "final.pt"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(__file__), marker=marker,
                                    backup=str(tmp_path / "backup"), out=str(out)))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker + ".ready"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        open(marker + ".sent", "w").close()
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert "fit: preempted (SIGTERM) after optimizer step 11" in stderr
    assert not out.exists()
    subprocess.run([sys.executable, str(script)], check=True, timeout=120)
    reference = make()
    reference.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, seed=1, verbose=0)
    final = torch.load(out, weights_only=True)
    for k, v in reference.module.state_dict().items():
        assert torch.equal(final[k], v), k
