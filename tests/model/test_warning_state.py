"""A call leaves Python's warning machinery as it found it: the process-wide filter list and
each module's record of warnings already shown. A user's show-once warning is shown once per
place, as Python's default action for a UserWarning does in a hand-written torch loop."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import fitdp
from fitdp.callbacks import SWA
from fitdp.compiled.setup import CompileArgs, Compiled

MESSAGE = "the user's own show-once warning"


class Warns(nn.Module):
    """A linear layer whose forward warns every time (shown once: Python's "default")."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn(MESSAGE, UserWarning, stacklevel=1)
        return self.layer(x)


def times_shown(run: object) -> int:
    """How often MESSAGE reaches the user while ``run()`` runs under Python's default."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        run()  # type: ignore[operator]
    return sum(str(w.message) == MESSAGE for w in seen)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)


def test_per_step_scheduler_showed_a_users_show_once_warning_again_at_every_step() -> None:
    """Regression: a per-step LR scheduler (and each metric compute, each SWA epoch) entered
    warnings.catch_warnings, which resets the process's record of warnings shown."""
    x, y = data()

    def hand_loop() -> None:  # the reference: torch alone, scheduler stepped per step
        net = Warns()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1000)
        for i in range(0, 64, 8):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[i:i + 8]), y[i:i + 8]).backward()
            opt.step()
            sched.step()

    def fit() -> None:
        model = fitdp.Model(Warns())
        model.compile(optimizer="sgd", loss="cross_entropy", metrics=["accuracy"],
                      lr_scheduler=(lambda o: torch.optim.lr_scheduler.StepLR(o, 1000), "step"))
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, devices=["cpu"],
                  callbacks=[SWA(0.05, swa_epoch_start=1)])

    assert times_shown(hand_loop) == 1
    assert times_shown(fit) == 1


def test_a_resumed_runs_first_scheduler_step_still_passes_without_torchs_order_warning() -> None:
    """A run resumed at an epoch's end steps its scheduler before this process's first
    optimizer step: torch warns of the order (checked here on a plain scheduler), fitdp,
    whose order is right, filters that one warning."""
    def first_steps(step: object) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step()  # type: ignore[operator]
            step()  # type: ignore[operator]
        return [str(w.message) for w in seen]

    opt = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)
    plain = torch.optim.lr_scheduler.StepLR(opt, 10)
    assert any("Detected call of `lr_scheduler.step()`" in m for m in first_steps(plain.step))
    trainer = Compiled.build(nn.Linear(3, 2), CompileArgs(
        optimizer="sgd", lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 10)))
    assert first_steps(lambda: trainer.step_scheduler("epoch")) == []
    assert trainer.scheduler is not None and trainer.scheduler.last_epoch == 2
