"""The public executor layer checks its arguments (issue 17 item 11): the Model layer's
message form, raised before anything changes; and a reserved time-major layout splits on N."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fitdp.data.batch import DataBatch, DataDesc
from fitdp.executor import DataParallelExecutorManager, split_input_slice


@pytest.fixture
def mgr():
    m = DataParallelExecutorManager(nn.Linear(4, 2), ["cpu", "cpu"],
                                    loss=nn.functional.cross_entropy)
    yield m
    m.close()


def _replica_weights(m: DataParallelExecutorManager) -> list[torch.Tensor]:
    return [t.detach().clone() for block in m.param_arrays for t in block]


def test_set_params_is_atomic(mgr):
    """Regression: a wrong-shaped second tensor changed the first parameter on every replica
    and then raised torch's size error."""
    before = _replica_weights(mgr)
    with pytest.raises(ValueError, match=r"set_params\(arg_params=\.\.\.\)\['bias'\]: got shape "
                                         r"\[3\]; expected shape \[2\].*Fix: pass a tensor"):
        mgr.set_params({"weight": torch.ones(2, 4), "bias": torch.ones(3)}, {})
    assert all(torch.equal(a, b) for a, b in zip(before, _replica_weights(mgr)))
    mgr.set_params({"weight": torch.ones(2, 4)}, {})  # a good call still copies
    assert all(torch.equal(t.detach(), torch.ones(2, 4)) for t in mgr.param_arrays[0])


@pytest.mark.parametrize("call, error, pattern", [
    (lambda m: m.set_params(None, None), TypeError,
     r"set_params\(arg_params=\.\.\.\): got None \(NoneType\); expected a mapping"),
    (lambda m: m.set_params({}, {"running_mean": torch.zeros(2)}), ValueError,
     r"set_params\(aux_params=\.\.\.\): got unknown names \['running_mean'\]"),
    (lambda m: m.set_params({"weight": [[0.0] * 4] * 2}, {}), TypeError,
     r"set_params\(arg_params=\.\.\.\)\['weight'\]: got .*list.*expected a tensor"),
    (lambda m: m.load_data_batch(torch.ones(3, 4)), TypeError,
     r"data_batch: got a Tensor; expected a fitdp.data.batch.DataBatch. Fix: wrap"),
    (lambda m: m.install_monitor(5), TypeError, r"monitor: got 5; expected a fitdp.Monitor"),
    (lambda m: m.update_metric(None), TypeError,
     r"metric: got None \(NoneType\); expected a torchmetrics Metric"),
    (lambda m: m.copy_to({"weight": torch.zeros(3, 3)}, {}), ValueError,
     r"copy_to\(arg_params=\.\.\.\)\['weight'\]: got shape \[3, 3\]; expected shape \[2, 4\]"),
    (lambda m: DataParallelExecutorManager(None, ["cpu"]), TypeError,
     r"module: got None \(NoneType\); expected a torch.nn.Module"),
])
def test_bad_arguments_are_named(mgr, call, error, pattern):
    """Regression: these raised AttributeError/TypeError from inside, or were accepted."""
    mgr.load_data_batch(DataBatch(torch.randn(4, 4), torch.tensor([0, 1, 0, 1])))
    mgr.forward(is_train=False)
    before = _replica_weights(mgr)
    with pytest.raises(error, match=pattern):
        call(mgr)
    assert all(torch.equal(a, b) for a, b in zip(before, _replica_weights(mgr)))


def test_copy_to_into_the_right_shapes_still_works(mgr):
    target = {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}
    mgr.copy_to(target, {})
    assert torch.equal(target["weight"], mgr.param_arrays[0][0].detach())


@pytest.mark.parametrize("args, error, pattern", [
    ((2.5, [1, 1]), TypeError, r"batch_size: got 2.5; expected an int >= 1"),
    ((0, [1, 1]), ValueError, r"batch_size: got 0; expected an int >= 1"),
    ((5, []), ValueError, r"work_load_list: got \[\] \(list\); expected at least one"),
    ((5, [math.nan, 1]), ValueError, r"work_load_list: got \[nan, 1\]; every entry must be a "
                                     r"positive, finite number"),
    ((5, "ab"), TypeError, r"work_load_list: got 'ab' \(str\); expected a list of positive"),
    ((6, [-1]), ValueError, r"work_load_list: got \[-1\]; every entry must be a positive"),
])
def test_split_input_slice_names_bad_arguments(args, error, pattern):
    """Regression: these gave torch/Python errors (2.5, nan, 'ab') or nothing ([], [-1])."""
    with pytest.raises(error, match=pattern):
        split_input_slice(*args)


def test_split_input_slice_with_huge_work_loads_splits_or_names_them():
    """Issue 28 item 11: a load of 1e300 times a large batch overflowed to inf and raised
    Python's OverflowError; an int too large for a float did the same. Only the loads'
    ratios count: equal huge loads split as equal small ones, a 401-digit int is named."""
    assert split_input_slice(10**9, [1e300, 1e300]) == split_input_slice(10**9, [1, 1])
    assert split_input_slice(12, [3e300, 1e300]) == [slice(0, 9), slice(9, 12)]
    with pytest.raises(ValueError, match=r"work_load_list: got an int of 401 digits;.*Fix: "
                       r"scale them down"):
        split_input_slice(10, [10**400, 1])

def test_manager_refuses_a_bucket_module_that_is_not_callable():
    """Issue 28 item 11: DataParallelExecutorManager(bucket_module=5) was accepted (and
    failed at the first new bucket); fitdp.Model refused it already."""
    with pytest.raises(TypeError, match=r"bucket_module: got 5; expected a callable"):
        DataParallelExecutorManager(nn.Linear(4, 2), ["cpu"], bucket_module=5)


def test_a_bucket_too_large_to_allocate_is_named_with_its_shape():
    """Issue 28 item 11: reserving a bucket of 10**12 rows surfaced the allocator's bare
    "can't allocate memory: you tried to allocate 16000000000000 bytes"; the message now
    names the input, its shape and the fix."""
    m = DataParallelExecutorManager(nn.Linear(4, 2), ["cpu"])
    try:
        with pytest.raises(RuntimeError, match=r"input 'data': a buffer of shape "
                           r"\(1000000000000, 4\) torch.float32 \(16,000.0 GB\) cannot be "
                           r"allocated on cpu.*Fix: a smaller batch_size or bucket"):
            m.reserve([DataDesc("data", (10**12, 4))])
    finally:
        m.close()


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_forward_backward_on_a_module_without_parameters_is_a_no_op(devices):
    """Issue 28 item 11: MXNet's test_module_update_no_param (apache/mxnet,
    tests/python/unittest/test_module.py) binds a Dropout-only module, runs
    forward_backward and update on ones((10, 10)) and expects outputs of that shape; the
    manager's backward raised torch's "element 0 of tensors does not require grad"."""
    m = DataParallelExecutorManager(nn.Dropout(0.5), devices, loss=nn.functional.mse_loss)
    try:
        m.load_data_batch(DataBatch(torch.ones(10, 10), torch.zeros(10, 10)))
        m.forward(is_train=True)
        m.backward()
        assert sum(o.shape[0] for o in m.outputs()) == 10
        assert all(o.shape[1:] == (10,) for o in m.outputs())
    finally:
        m.close()

def test_reserved_time_major_layout_splits_on_the_batch_axis():
    """Regression: after reserve([DataDesc(layout="TNC")]) a (3, 8, 7) batch went to two CPU
    devices as (2, 8, 7) and (1, 8, 7). MXNet's test_module_layout (apache/mxnet,
    tests/python/unittest/test_module.py) binds DataDesc('data', (3, 8, 7), layout='TNC') on
    [cpu(0), cpu(1)], runs a DataBatch that names no layout, and expects (3, 4, 7) per
    context and (3, 8, 7) merged."""
    m = DataParallelExecutorManager(nn.ReLU(), ["cpu", "cpu"])
    try:
        m.reserve([DataDesc("data", (3, 8, 7), layout="TNC")])
        x = torch.randn(3, 8, 7)
        m.load_data_batch(DataBatch(x))
        m.forward(is_train=False)
        assert [tuple(o.shape) for o in m.outputs()] == [(3, 4, 7), (3, 4, 7)]
        assert torch.equal(torch.cat(m.outputs(), dim=1), x.relu())
    finally:
        m.close()
