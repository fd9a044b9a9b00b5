"""FlatBuckets: parameters and gradients as views of a few flat tensors per device."""

from __future__ import annotations

import torch
from torch import nn

from fitdp.executor.flat_buckets import FlatBuckets
from fitdp.executor.update import Update


def replicas(n: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    out = []
    for _ in range(n):
        m = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
        m.load_state_dict(base.state_dict())
        out.append(m)
    return out


def test_parameters_and_gradients_are_views_of_few_buckets():
    mods = replicas()
    fb = FlatBuckets([list(m.parameters()) for m in mods], bucket_bytes=64)
    assert len(fb.plan) > 1  # 64-byte buckets: several
    for d, m in enumerate(mods):
        flats = {t.untyped_storage().data_ptr() for t in fb.param_flat[d]}
        assert {p.untyped_storage().data_ptr() for p in m.parameters()} <= flats
        assert all(p.grad is not None and not p.grad.any() for p in m.parameters())


def test_reduce_sums_every_device_once_and_broadcast_copies_device_0():
    mods = replicas()
    fb = FlatBuckets([list(m.parameters()) for m in mods])
    x = torch.randn(6, 5)
    expected = [torch.zeros_like(p) for p in mods[0].parameters()]
    for d, m in enumerate(mods):
        m(x[2 * d:2 * d + 2]).sum().backward()  # autograd adds into the bucket views
        for e, p in zip(expected, m.parameters()):
            e += p.grad
    update = Update(fb, list(mods[0].parameters()))
    update.reduce_gradients()
    update.reduce_gradients()  # a second reduce adds nothing: the sources were zeroed
    for e, p in zip(expected, mods[0].parameters()):
        torch.testing.assert_close(p.grad, e)
    with torch.no_grad():
        for p in mods[0].parameters():
            p.add_(1.0)
    update.broadcast_params()
    for m in mods[1:]:
        for a, b in zip(m.parameters(), mods[0].parameters()):
            assert torch.equal(a, b)


def test_zero_grad_rebinds_a_replaced_gradient():
    mods = replicas(2)
    fb = FlatBuckets([list(m.parameters()) for m in mods])
    first = next(mods[0].parameters())
    first.grad = torch.ones_like(first)  # e.g. a user's hook replaced it
    Update(fb, list(mods[0].parameters())).zero_device(0)
    assert first.grad.data_ptr() == fb.grad_views[0][0].data_ptr() and not first.grad.any()


def test_an_extra_cpu_replica_holds_its_weights_and_gradients_once():
    """Bug: each CPU replica kept flat gradient buckets beside fresh .grad tensors, and the
    host module was one more copy of the weights (~5x the weights per extra replica)."""
    from fitdp.data.batch import DataBatch
    from fitdp.executor.manager import DataParallelExecutorManager

    host = replicas(1)[0]
    host_params = list(host.parameters())
    mgr = DataParallelExecutorManager(host, ["cpu", "cpu"], loss=nn.functional.cross_entropy)
    opt = torch.optim.SGD(mgr.master_parameters(), lr=0.1)
    mgr.run_batch(DataBatch(torch.randn(6, 5), torch.tensor([0, 1] * 3)), True,
                  zero_grad=True, optimizer=opt)
    # Device 0's replica holds the host's own parameters, in its flat bucket.
    assert [p is q for p, q in zip(mgr.master_parameters(), host_params)] == [True] * 4
    for d in range(2):
        flats = {t.untyped_storage().data_ptr() for t in mgr.flat.param_flat[d]}
        row = [block[d] for block in mgr.param_arrays]
        assert {p.untyped_storage().data_ptr() for p in row} <= flats
    assert mgr.flat.grad_flat == [[], []]  # no gradient bucket beside the gradients
    assert all(block[1].grad is None for block in mgr.param_arrays)  # added, then dropped
