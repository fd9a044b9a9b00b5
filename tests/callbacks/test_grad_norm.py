"""GradNormLogger and on_before_optimizer_step: callbacks see the step (issue 39 item 3).

Lightning's `on_before_optimizer_step` runs after the gradients are reduced and unscaled and
before clipping; its `grad_norm` utility and `clip_grad_norm_`'s return value are the norm of
the gradients before clipping. The logged norm must be that of the whole batch's gradient,
whatever the devices, and read on the host only at log points."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fitdp
from fitdp.callbacks import Callback, GradNormLogger, is_log_point

X = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1))
CLIP = 0.05  # below every norm here: clipping changes each step


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def hand_norms(bs: int, accum: int = 1) -> list[float]:
    """The pre-clip norm of every optimizer step of a hand loop over the same batches."""
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    norms = []
    batches = [(X[i:i + bs], Y[i:i + bs]) for i in range(0, len(X), bs)]
    for k, (xb, yb) in enumerate(batches):
        (F.cross_entropy(m(xb), yb) / accum).backward()
        if (k + 1) % accum == 0 or k + 1 == len(batches):
            norms.append(float(nn.utils.clip_grad_norm_(m.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
    return norms


class BatchNorms(Callback):
    """The `grad_norm` of every batch's logs (None before the call's first step)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(logs.get("grad_norm"))


def fitted(devices: list[str], bs: int = 8, accum: int = 1, **fit) -> tuple[list[float], dict]:
    model = fitdp.Model(net())
    model.compile("sgd", lr=0.1, loss="cross_entropy", grad_clip_norm=CLIP,
                  grad_accum_steps=accum)
    probe = BatchNorms()
    h = model.fit(X, Y, batch_size=bs, epochs=1, shuffle=False, verbose=0, devices=devices,
                  callbacks=[GradNormLogger(), probe], **fit)
    return probe.seen, h.history


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"], ["cpu", "cpu", "cpu"]])
def test_grad_norm_is_the_whole_batch_norm_before_clipping_on_any_device_list(devices):
    seen, history = fitted(devices)
    expected = hand_norms(8)
    assert seen == pytest.approx(expected, rel=1e-5)  # every batch: CPU logs are exact
    assert history["grad_norm"] == pytest.approx([expected[-1]], rel=1e-5)
    assert min(expected) > CLIP  # (the norm is before clipping: clipping bit every step)


def test_grad_norm_with_accumulation_is_the_last_optimizer_steps():
    seen, _ = fitted(["cpu", "cpu"], bs=4, accum=2)
    expected = hand_norms(4, accum=2)
    assert seen[0] is None  # no step yet
    assert seen[1::2] == pytest.approx(expected, rel=1e-5)  # the batches that step
    assert seen[2::2] == pytest.approx(expected[:-1], rel=1e-5)  # between: the last step's


def test_grad_norm_in_the_reproducible_mode():
    seen, _ = fitted(["cpu", "cpu"], reproducible=True, micro_batch_size=4)
    assert seen == pytest.approx(hand_norms(8), rel=1e-5)


@pytest.mark.distributed
@pytest.mark.ranks_script(str(Path(__file__).with_name("grad_norm_worker.py")))
def test_grad_norm_under_two_ranks(shared_ranks):
    """2 gloo ranks, each its half of every batch of 8 rows: the norm of the reduced
    gradient, the same on both ranks, equals the one-process loop's over batches of 16."""
    run = shared_ranks(str(Path(__file__).with_name("grad_norm_worker.py")))
    assert run.code == 0, run.output[-3000:]
    ranks = [torch.load(run.out / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1]
    assert ranks[0] == pytest.approx(hand_norms(16), rel=1e-5)


class Reads(Callback):
    """A batch-end hook that leaves the logs alone: the call reads them only at log points."""

    needs_batch_logs = False

    def on_train_batch_end(self, batch, logs=None):
        pass


def host_reads(monkeypatch, callbacks: list) -> int:
    """How many tensors a fit of 40 rows in batches of 4 (log_every=4) read on the host."""
    count = [0]
    for name in ("__float__", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            count[0] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    model = fitdp.Model(net())
    model.compile("sgd", lr=0.1, loss="cross_entropy")
    model.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0, log_every=4,
              callbacks=callbacks)
    monkeypatch.undo()
    return count[0]


def test_the_norm_is_read_on_the_host_once_per_log_point_and_never_between(monkeypatch):
    with_norm = host_reads(monkeypatch, [Reads(), GradNormLogger()])
    without = host_reads(monkeypatch, [Reads()])
    points = sum(is_log_point(b, 4) for b in range(10)) + 1  # batches 0, 3, 7; epoch end
    assert points == 4
    assert with_norm - without == points


class BeforeStep(Callback):
    """What `on_before_optimizer_step` sees: the step count and the gradients' norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.norms.append(float(torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in params]))))


def test_on_before_optimizer_step_sees_the_reduced_gradients_before_clipping():
    probe = BeforeStep()
    model = fitdp.Model(net())
    model.compile("sgd", lr=0.1, loss="cross_entropy", grad_clip_norm=CLIP, grad_accum_steps=2)
    model.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0, devices=["cpu", "cpu"],
              callbacks=[probe])
    # once per optimizer step (not per batch), with the whole step's gradient, unclipped
    assert probe.norms == pytest.approx(hand_norms(4, accum=2), rel=1e-5)


def test_log_points_are_in_the_params_and_the_step_state_outside_fit_is_none():
    class Params(Callback):
        def on_train_begin(self, logs=None):
            self.log_every = self.params["log_every"]
            self.state = self.model.step_state

    class Reader(Params):  # reads every batch's logs: on the CPU they are then exact
        def on_train_batch_end(self, batch, logs=None):
            pass

    model = fitdp.Model(net())
    model.compile("sgd", lr=0.1, loss="cross_entropy")
    for probe, every in ((Params(), 3), (Reader(), 1)):
        model.fit(X, Y, batch_size=8, verbose=0, log_every=3, callbacks=[probe])
        assert probe.log_every == every
        assert probe.state is not None
    assert model.step_state is None


def test_skipped_is_read_from_the_scalers_per_device_flags():
    """A 16-mixed step (CUDA only) keeps GradScaler's found-inf flags as they are; whether it
    was skipped is summed when someone reads it, not at every step."""
    from fitdp.executor.update import StepState

    state = StepState()
    assert state.skipped is None  # no GradScaler
    state.found_inf = {"cuda:0": torch.tensor(0.0), "cuda:1": torch.tensor(0.0)}
    assert not bool(state.skipped)
    state.found_inf = {"cuda:0": torch.tensor(0.0), "cuda:1": torch.tensor(1.0)}
    assert bool(state.skipped)
