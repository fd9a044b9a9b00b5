"""BucketOverlap: a rank's cross-rank all-reduces started during backward, bucket by bucket,
in one fixed order, from the arming thread (issue 20, the hybrid case). The collective is
recorded here instead of run (no process group); tests/distributed/test_strategy.py runs it
under torchrun."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from fitdp.call import ranks
from fitdp.executor import overlap
from fitdp.executor.flat_buckets import FlatBuckets
from fitdp.executor.overlap import BucketOverlap


class Done:
    """A finished async work."""

    def wait(self) -> bool:
        return True


class Failed:
    """A work whose peer left."""

    def wait(self) -> bool:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")


@pytest.fixture
def launches(monkeypatch):
    """Each all-reduce as (bucket values at launch, phase), instead of a collective."""
    seen: list[tuple[torch.Tensor, str]] = []
    phase = ["backward"]

    def all_reduce(tensor, async_op=False):
        assert async_op
        seen.append((tensor.clone(), phase[0]))
        return Done()

    monkeypatch.setattr(overlap.dist, "all_reduce", all_reduce)
    return seen, phase


def replicas(extra: bool = False) -> tuple[list[nn.Module], BucketOverlap]:
    """Two replicas of one MLP; every parameter its own bucket (4, or 6 with an unused layer)."""
    mods = []
    for _ in range(2):
        torch.manual_seed(0)
        layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)]
        mods.append(nn.Sequential(*layers, nn.Linear(3, 3)) if extra else nn.Sequential(*layers))
    flat = FlatBuckets([list(m.parameters()) for m in mods], bucket_bytes=1)
    return mods, BucketOverlap(flat)


def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m[2](m[1](m[0](x))).square().mean()  # (an extra last layer stays unused)


def test_each_bucket_starts_once_every_replica_finished_it_last_bucket_first(launches):
    seen, phase = launches
    mods, ov = replicas()
    x = torch.randn(2, 6, 4)
    grads = [torch.autograd.grad(loss(m, xi), list(m.parameters())) for m, xi in zip(mods, x)]
    sums = [a + b for a, b in zip(*grads, strict=True)]  # (autograd.grad: no hook fires)
    ov.arm(True)
    loss(mods[0], x[0]).backward()  # replica 0 alone finishes nothing: replica 1 has not run
    assert seen == []
    loss(mods[1], x[1]).backward()  # each of its gradients completes a bucket, on this thread
    phase[0] = "finish"
    ov.finish()
    assert [p for _, p in seen] == ["backward"] * 4 and ov.early == 4
    # the last bucket first (backward reaches it first), each the sum of both replicas'
    for (got, _), want in zip(seen, reversed(sums), strict=True):
        torch.testing.assert_close(got, want.reshape(-1), rtol=0, atol=0)
    assert all(torch.count_nonzero(p.grad) == 0 for p in mods[1].parameters())


def test_other_threads_only_count_and_finish_launches_the_rest_in_the_same_order(launches):
    """Collectives are issued from the arming thread alone, so every rank's order is the
    fixed one; a bucket a replica thread finished waits for finish (or device 0's hooks)."""
    seen, phase = launches
    mods, ov = replicas()
    x = torch.randn(2, 6, 4)
    ov.arm(True)
    loss(mods[0], x[0]).backward()
    other = threading.Thread(target=lambda: loss(mods[1], x[1]).backward())
    other.start()
    other.join()
    assert seen == []
    phase[0] = "finish"
    ov.finish()
    sizes = [p.numel() for p in mods[0].parameters()][::-1]
    assert [(t.numel(), p) for t, p in seen] == [(n, "finish") for n in sizes]


def test_a_bucket_ready_early_waits_for_the_ones_before_it_in_the_order(launches):
    """The last layer is never used: its bucket, first in the order, is not ready during
    backward, so no later bucket starts before it (as DDP's reducer waits in order)."""
    seen, phase = launches
    mods, ov = replicas(extra=True)
    x = torch.randn(2, 6, 4)
    ov.arm(True)
    for m, xi in zip(mods, x):
        loss(m, xi).backward()
    assert seen == []
    phase[0] = "finish"
    ov.finish()
    assert len(seen) == 6  # the unused layer's bias and weight first, zeros
    assert [torch.count_nonzero(t) == 0 for t, _ in seen[:3]] == [True, True, False]


def test_an_accumulating_batch_starts_nothing(launches):
    seen, _ = launches
    mods, ov = replicas()
    ov.arm(False)
    for m, xi in zip(mods, torch.randn(2, 6, 4)):
        loss(m, xi).backward()
    assert seen == [] and not ov.armed


def test_a_peer_that_left_during_the_overlapped_wait_is_a_collective_error():
    """Regression: gloo's wait raises a RuntimeError from fitdp's own frame, which the
    failing-rank protocol did not see as a collective's error (it names the root cause by
    that: the healthy rank would not wait for the raising one to be named first)."""
    _, ov = replicas()
    ov.arm(True)
    ov.works = [Done(), Failed(), Done()]
    ov.next = len(ov.order)  # every bucket launched
    with pytest.raises(torch.distributed.DistBackendError, match="closed by peer") as err:
        ov.finish()
    assert ranks._in_collective(err.value) and ov.works == []
