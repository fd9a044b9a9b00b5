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
    assert torch.equal(replica_mean(block), a)
    dst = torch.empty_like(a)
    average_into(dst, block)
    assert torch.equal(dst, a)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_different_replicas_average_to_the_mean(n, dtype):
    torch.manual_seed(1)
    block = [torch.randn(1000, dtype=torch.float64).to(dtype) for _ in range(n)]
    want = torch.stack([t.double() for t in block]).mean(0)
    got = replica_mean(block)
    assert got.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_integer_buffers_take_the_floor_of_the_mean():
    block = [torch.tensor([3, 4]), torch.tensor([4, 4]), torch.tensor([4, 5])]
    assert replica_mean(block).tolist() == [3, 4]


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


class _Ops(torch.overrides.TorchFunctionMode):
    """Records (op name, devices of its tensor arguments, non_blocking) of every torch call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, set[str], object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.calls.append((getattr(func, "__name__", str(func)),
                           {t.device.type for t in tensors}, kwargs.get("non_blocking")))
        return func(*args, **kwargs)


@pytest.mark.parametrize("n", [2, 3])
def test_the_mean_is_taken_on_the_first_replicas_device_then_copied_blocking(n):
    # copy_to read GPU weights before they arrived: replicas were copied to the host with
    # non_blocking=True and averaged there at once. The mean must be taken where the first
    # replica lives and reach the destination in one blocking copy. (Here the destination is
    # on "meta", the replicas on the CPU: the arithmetic must run on the CPU.)
    block = [torch.full((4,), float(i)) for i in range(n)]
    dst = torch.empty(4, device="meta")
    with _Ops() as ops:
        average_into(dst, block)
    math = [c for c in ops.calls if c[0] in ("lerp", "add", "__sub__", "sub", "add_", "sub_")]
    assert math and all(devices == {"cpu"} for _, devices, _ in math), ops.calls
    copies = [c for c in ops.calls if c[0] == "copy_"]
    assert copies == [("copy_", {"cpu", "meta"}, None)], ops.calls  # one, blocking


def test_a_cpu_first_replica_gathers_the_others_blocking():
    # Towards the host a non_blocking copy returns before the data lands: the gather onto a
    # CPU first replica must block (only CPU tensors here: what is asked for is recorded).
    block = [torch.ones(3), torch.zeros(3)]
    with _Ops() as ops:
        got = replica_mean(block)
    assert got.tolist() == [0.5] * 3
    assert all(nb in (None, False) for name, _, nb in ops.calls if name == "to"), ops.calls
