"""Averaging replicas (``fitdp.executor.averaging``): exact when equal, the mean otherwise."""

from __future__ import annotations

import pytest
import torch

from fitdp.executor.averaging import average_into, average_replicas, replica_mean


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_equal_replicas_average_to_their_value_bit_for_bit(n):
    # stack().mean(0) moved weights by an ulp here; the replica mean must not
    torch.manual_seed(0)
    a = torch.randn(515) * 10 ** torch.randint(-6, 6, (515,)).float()
    block = [a.clone() for _ in range(n)]
    assert torch.equal(replica_mean(block, a.device), a)
    dst = torch.empty_like(a)
    average_into(dst, block)
    assert torch.equal(dst, a)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_different_replicas_average_to_the_mean(n, dtype):
    torch.manual_seed(1)
    block = [torch.randn(1000, dtype=torch.float64).to(dtype) for _ in range(n)]
    want = torch.stack([t.double() for t in block]).mean(0)
    got = replica_mean(block, block[0].device)
    assert got.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_integer_buffers_take_the_floor_of_the_mean():
    block = [torch.tensor([3, 4]), torch.tensor([4, 4]), torch.tensor([4, 5])]
    assert replica_mean(block, torch.device("cpu")).tolist() == [3, 4]


def test_average_into_casts_to_the_host_dtype_and_leaves_replicas_alone():
    block = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    before = [t.clone() for t in block]
    dst = torch.zeros(2, dtype=torch.float64)
    average_into(dst, block)
    assert dst.tolist() == [2.0, 3.0]
    assert all(torch.equal(t, b) for t, b in zip(block, before))


def test_average_into_a_destination_that_is_one_of_the_replicas():
    a, b = torch.tensor([1.0, 5.0]), torch.tensor([3.0, 7.0])
    average_into(a, [a, b])
    assert a.tolist() == [2.0, 6.0]


def test_average_replicas_writes_the_mean_into_every_replica_and_skips_integers():
    floats = [torch.tensor([0.0, 2.0]), torch.tensor([2.0, 4.0]), torch.tensor([4.0, 9.0])]
    counts = [torch.tensor(1), torch.tensor(2), torch.tensor(3)]
    average_replicas([floats, counts], distributed=False)
    assert all(t.tolist() == [2.0, 5.0] for t in floats)
    assert [int(c) for c in counts] == [1, 2, 3]
