"""A resume in the middle of an epoch continues exactly: BatchNorm statistics of every replica
(issue 17.3) and the epoch's running loss and metrics (issue 17.16)."""

from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

import fitdp
from fitdp.callbacks import Callback, ModelCheckpoint
from fitdp.executor.slicing import split_input_slice

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(80, 6, generator=G), torch.randint(0, 3, (80,), generator=G)
EPOCHS, BATCH = 2, 8  # 10 steps per epoch


def make(accum: int = 1) -> fitdp.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = fitdp.Model(net)
    model.compile("adamw", lr=0.01, grad_accum_steps=accum, metrics={
        "acc": MulticlassAccuracy(num_classes=3, average="micro"),
        "auroc": MulticlassAUROC(num_classes=3),  # "cat" states, once per batch
    }, loss=lambda out, y: nn.functional.cross_entropy(out, y))
    return model


class Stop(Callback):
    """Ends the fit after training batch ``at`` of the run (a crash right after a save)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt(f"stopped after batch {self.at}")


def run(model: fitdp.Model, callbacks, devices, **kw) -> dict[str, list[float]]:
    return model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, seed=1, verbose=0,
                     devices=devices, callbacks=callbacks, **kw).history


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"], ["cpu", "cpu", "cpu"]])
def test_mid_epoch_resume_is_bitwise_with_batchnorm_and_epoch_logs(tmp_path, devices, accum):
    """Regression (issue 17.3): on CPU replicas, running_mean/var after a mid-epoch resume
    differed by ~1e-7 (the checkpoint held the replicas' average, each replica its own).
    Regression (issue 17.16): the resumed epoch's loss and metrics covered only the batches
    after the resume point."""
    reference = make(accum)
    expected = run(reference, [], devices)
    ckpt = str(tmp_path / "c-{step:03d}.ckpt")
    model = make(accum)
    with pytest.raises(KeyboardInterrupt):
        run(model, [ModelCheckpoint(ckpt, save_freq=1, monitor="loss"), Stop(13)], devices)
    resumed = make(accum)
    history = run(resumed, [ModelCheckpoint(ckpt, save_freq=1, monitor="loss")], devices,
                  resume="latest")
    for (k, v), w in zip(resumed.module.state_dict().items(),
                         reference.module.state_dict().values()):
        assert torch.equal(v, w), k
    assert history == expected


@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(n=st.integers(1, 3), loads=st.lists(st.integers(1, 3), min_size=3, max_size=3),
       stop=st.sampled_from([s for s in range(1, EPOCHS * 10) if s % 10]))
def test_mid_epoch_resume_is_bitwise_for_any_replicas_and_loads(n: int, loads: list[int],
                                                                stop: int) -> None:
    """Property (issue 17.3, 17.16): on 1-3 CPU replicas with any work loads, a checkpoint
    every batch and a stop after any mid-epoch step, ``resume="latest"`` gives parameters,
    BatchNorm running statistics and epoch logs bitwise equal to the uninterrupted run."""
    devices, work = ["cpu"] * n, [float(w) for w in loads[:n]]
    # BatchNorm needs two rows per device slice to train (8 rows at 1:3:1 leave one).
    assume(min(s.stop - s.start for s in split_input_slice(BATCH, work)) >= 2)
    reference = make()
    expected = run(reference, [], devices, work_load_list=work)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = f"{tmp}/c-{{step:03d}}.ckpt"
        with pytest.raises(KeyboardInterrupt):
            run(make(), [ModelCheckpoint(ckpt, save_freq=1, monitor="loss"), Stop(stop)],
                devices, work_load_list=work)
        resumed = make()
        history = run(resumed, [ModelCheckpoint(ckpt, save_freq=1, monitor="loss")], devices,
                      resume="latest", work_load_list=work)
    state, want = resumed.module.state_dict(), reference.module.state_dict()
    assert state.keys() == want.keys()
    for k in want:  # weights, running_mean, running_var, num_batches_tracked
        assert torch.equal(state[k], want[k]), k
    assert history == expected


class ExtraLogs(fitdp.Model):
    """A custom train_step that returns another log beside the loss (Keras's dict of logs)."""

    def train_step(self, data):
        x, y = data
        out = self(x, training=True)
        loss = self.compute_loss(x, y, out)
        return {"loss": loss, "confidence": out.softmax(1).amax(1).mean()}


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu", "cpu"]])
def test_a_custom_steps_extra_logs_survive_a_mid_epoch_resume(tmp_path, devices):
    """Regression (issue 28.5): the other keys of train_step's dict covered only the batches
    after the checkpoint (0.68345 against 0.68549 for the whole epoch): their running sums
    were not in the checkpoint. Keras's History holds each key's mean over the epoch."""
    def make_own() -> fitdp.Model:
        torch.manual_seed(0)
        model = ExtraLogs(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
        model.compile("adamw", lr=0.01, loss="cross_entropy")
        return model

    expected = run(make_own(), [], devices)
    ckpt = str(tmp_path / "c-{step:03d}.ckpt")
    with pytest.raises(KeyboardInterrupt):
        run(make_own(), [ModelCheckpoint(ckpt, save_freq=1), Stop(13)], devices)
    history = run(make_own(), [ModelCheckpoint(ckpt, save_freq=1)], devices, resume="latest")
    assert history == expected


SPEEDS = (1.0, 2.0, 1.0)  # rows per ms of each CPU replica: device 1 twice as fast


def _fixed_times(self, rows, times):
    """ShareClock.finished with each share's time from SPEEDS, not the machine's clock: the
    measured loads are then the same in every run, as on a machine whose devices keep their
    speeds (the test's reference must itself be reproducible)."""
    return [(list(rows), [r / s * 1e-3 for r, s in zip(rows, SPEEDS)])]


@pytest.mark.parametrize("bn", [False, True])
def test_a_mid_epoch_resume_on_three_replicas_splits_batches_as_the_uninterrupted_run(
        tmp_path, monkeypatch, bn):
    """Regression (issue 28.16): on 3 CPU replicas (batch 16 split 6/5/5) with
    work_load_list="auto", a fit resumed from step 8 ended 7e-9 off the uninterrupted run
    with an MLP and SGD, 0.04 with BatchNorm and Adam: the resumed call measured its loads
    and ran the slow-replicas check's one-thread batches anew from its first batch, so its
    batches were split (and summed) otherwise than the same batches mid-call. The measures
    are now in the checkpoint (docs/checkpoints.md: a resume on the same devices and loads
    is bitwise)."""
    from fitdp.executor.share_clock import ShareClock

    monkeypatch.setattr(ShareClock, "finished", _fixed_times)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(160, 6, generator=g), torch.randint(0, 3, (160,), generator=g)

    def make_run() -> fitdp.Model:
        torch.manual_seed(0)
        mid = [nn.BatchNorm1d(16)] if bn else []
        model = fitdp.Model(nn.Sequential(nn.Linear(6, 16), *mid, nn.ReLU(), nn.Linear(16, 3)))
        model.compile("adam" if bn else "sgd", lr=0.01, loss="cross_entropy")
        return model

    def fit(model: fitdp.Model, callbacks, **kw) -> None:
        model.fit(x, y, batch_size=16, epochs=2, seed=1, verbose=0, devices=["cpu"] * 3,
                  work_load_list="auto", callbacks=callbacks, **kw)

    reference = make_run()
    fit(reference, [])
    assert reference.work_load_list == [0.75, 1.5, 0.75]  # measured: 4/8/4 rows
    ckpt = str(tmp_path / "c-{step:03d}.ckpt")
    with pytest.raises(KeyboardInterrupt):
        fit(make_run(), [ModelCheckpoint(ckpt, save_freq=4), Stop(10)])
    resumed = make_run()
    fit(resumed, [], resume=str(tmp_path / "c-008.ckpt"))
    state, want = resumed.module.state_dict(), reference.module.state_dict()
    for k in want:  # weights, and BatchNorm's running statistics
        assert torch.equal(state[k], want[k]), k


class _Sums:
    """A manager double: the loss sums ``restore_loss`` put back."""

    def __init__(self) -> None:
        self.restored: list | None = None

    def loss_sums(self):
        return [(torch.tensor(1.0), torch.tensor(2.0))]

    def restore_loss(self, sums) -> None:
        self.restored = [[float(s), float(n)] for s, n in sums]


def _resumed_on(rank: int, world: int, state: dict):
    from fitdp.call.ranks import Ranks
    from fitdp.call.run_state import RunState
    from fitdp.saving.entries import EpochLogs

    manager, run = _Sums(), RunState(batch=3)  # 3 batches into the epoch
    logs = EpochLogs(manager, None, run, None, Ranks(rank, world, rank))
    logs.load_state_dict(state)
    logs.begin()
    return manager.restored


def test_epoch_logs_of_each_rank_go_back_to_that_rank_or_all_to_rank_0():
    """Issue 28.4: a checkpoint holds every rank's running sums (``ranks``); a resume on as
    many ranks gives each its own, on another number rank 0 takes them all (the logs sum
    over ranks), and a one-process checkpoint of an older fitdp (no ``ranks``) still loads."""
    parts = [{"loss": [[torch.tensor(float(r)), torch.tensor(10.0 + r)]], "metrics": None,
              "steps": None} for r in range(2)]
    state = {"ranks": parts}
    assert _resumed_on(1, 2, state) == [[1.0, 11.0]]
    assert _resumed_on(0, 1, state) == [[0.0, 10.0], [1.0, 11.0]]
    assert _resumed_on(1, 3, state) is None and _resumed_on(0, 3, state) is not None
    assert _resumed_on(0, 1, parts[1]) == [[1.0, 11.0]]


def test_epoch_logs_saved_on_rank_0_alone_warn_and_restore_nothing():
    """Issue 28.4: a mid-epoch model.save on rank 0 alone (no share_epoch_logs) holds rank
    0's part only; the resume says so instead of logging rank 0's sums as everyone's."""
    state = {"ranks": [{"loss": [[torch.tensor(1.0), torch.tensor(2.0)]], "metrics": None,
                        "steps": None}, None]}
    with pytest.warns(fitdp.checks.FitdpWarning, match="rank 0 only"):
        assert _resumed_on(0, 2, state) is None
