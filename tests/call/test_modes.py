"""Submodule train/eval modes (issue 17.1): every submodule keeps the mode its owner gave it;
fit/evaluate/predict switch only what the user's own train()/eval() would, on every replica,
and give the module back as they found it."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import fitdp

SEEN: list[tuple[bool, bool]] = []  # (root, teacher) modes per forward, from every replica


class Distill(nn.Module):
    """A student and a frozen teacher (Dropout and BatchNorm the user put in eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 3))
        self.teacher = nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append((self.training, self.teacher.training))
        return self.student(self.teacher(x))


def modes(net: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in net.named_modules()}


X, Y = torch.randn(24, 4), torch.randint(0, 3, (24,))


def test_frozen_teacher_stays_in_eval_across_epochs_and_validation() -> None:
    """Regression (issue 17.1): the teacher ran in train mode from the second epoch
    ([False, False, True, True, True, True] per training batch) and fit left it in train."""
    net = Distill()
    net.teacher.eval()
    before = modes(net)
    model = fitdp.Model(net)
    model.compile("sgd", loss="cross_entropy")
    SEEN.clear()
    model.fit(X, Y, batch_size=12, epochs=3, validation_data=(X, Y), devices=["cpu"],
              verbose=0, shuffle=False)
    assert SEEN == ([(True, False)] * 2 + [(False, False)] * 2) * 3  # 2 batches, 2 val
    assert modes(net) == before


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 3), loads=st.lists(st.integers(1, 4), min_size=3, max_size=3),
       evals=st.lists(st.booleans(), min_size=9, max_size=9), root_eval=st.booleans())
def test_modes_after_every_call_equal_those_before(n: int, loads: list[int], evals: list[bool],
                                                   root_eval: bool) -> None:
    """Property (issue 17.1): on 1-3 CPU replicas with any work loads and any submodules in
    eval, each training forward runs the modes of the call's start (or all in train when
    the module was in eval: what module.train() gives), each evaluation forward all in eval
    (or the start modes when the module was in eval), and every call gives them back."""
    # BatchNorm in training refuses a single row, and the teacher's BatchNorm trains whenever
    # its flag says so: loads such as [3, 1, 4] give device 1 one of the 12 rows. Keep loads where
    # every device's floored share of a 12-row batch is at least 2 rows (still skewed: [4, 1, 1]).
    work = loads[:n]
    assume(12 * min(work) >= 2 * sum(work))
    net = Distill()
    if root_eval:
        net.eval()
    for flag, m in zip(evals, net.modules()):
        m.training = not flag if m is not net else m.training
    before = modes(net)
    model = fitdp.Model(net)
    model.compile("sgd", loss="cross_entropy")
    devices = ["cpu"] * n
    train_teacher = before["teacher"] if before[""] else True
    eval_teacher = before["teacher"] if not before[""] else False
    SEEN.clear()
    model.fit(X, Y, batch_size=12, epochs=2, validation_data=(X, Y), devices=devices,
              work_load_list=work, verbose=0)
    assert set(SEEN) == {(True, train_teacher), (False, eval_teacher)}
    assert modes(net) == before
    for call in (model.evaluate, model.predict):
        SEEN.clear()
        call(X, **({"y": Y} if call == model.evaluate else {}), devices=devices,
             work_load_list=work, verbose=0)
        assert set(SEEN) == {(False, eval_teacher)}
        assert modes(net) == before
