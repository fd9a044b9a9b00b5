"""Which buffers ``StepStart`` copies at each optimizer step (``fitdp/call/restore_points.py``):
every one at the call's first step, then only those a step writes to."""

from __future__ import annotations

import torch
from torch import nn

from fitdp.call.restore_points import StepStart


class Counter(nn.Module):
    """A buffer its forward writes in place (moving its version), one it never writes."""

    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("fixed", torch.arange(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(len(x))
        return x


def test_after_the_first_step_only_the_written_buffers_are_copied():
    net = nn.Sequential(Counter(), nn.BatchNorm1d(3))
    replicas = [net]
    blocks = [[b] for b in net.buffers()]
    start = StepStart(blocks, replicas)
    start.save(0)
    net(torch.randn(4, 3))
    start.save(1)  # BatchNorm's statistics (written without a version bump) and ``seen``
    kept = {id(t) for t in start.live}
    names = [n for n, b in net.named_buffers() if id(b) in kept]
    assert names == ["0.seen", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    before = {n: b.clone() for n, b in net.named_buffers()}
    net(torch.randn(4, 3))
    start.restore(1)
    assert all(torch.equal(b, before[n]) for n, b in net.named_buffers())


def test_a_step_completed_since_the_copy_keeps_its_buffers():
    norm = nn.BatchNorm1d(3)
    start = StepStart([[b] for b in norm.buffers()], [norm])
    start.save(0)
    norm(torch.randn(4, 3))
    after = norm.running_mean.clone()
    start.restore(1)  # step 1 completed after the copy: nothing to put back
    assert torch.equal(norm.running_mean, after)
