"""Every data-parallel path ends with the weights of a hand-written single-device loop."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitdp
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager

DEVICE_SETUPS = [
    (["cpu"], None),
    (["cpu", "cpu"], None),
    (["cpu"] * 3, [1, 2, 3]),
]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 5))


def data(n: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def hand_loop(net: nn.Module, opt_cls: type, x: torch.Tensor, y: torch.Tensor, steps: int, bs: int,
              **opt_kw: float) -> nn.Module:
    """The reference: whole batches, one device, in order."""
    opt = opt_cls(net.parameters(), **opt_kw)
    n = len(x)
    for step in range(steps):
        i = (step * bs) % n
        xb, yb = x[i:i + bs], y[i:i + bs]
        opt.zero_grad()
        nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
    return net


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("devices,work_load", DEVICE_SETUPS)
@pytest.mark.parametrize("opt_cls,opt_kw", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.01}),
])
def test_fit_matches_hand_loop(devices, work_load, opt_cls, opt_kw):
    x, y = data(100)
    ref = hand_loop(mlp(), opt_cls, x, y, steps=10, bs=10, **opt_kw)
    model = fitdp.Model(mlp())
    model.compile(optimizer=lambda p: opt_cls(p, **opt_kw), loss="cross_entropy")
    model.fit(x, y, batch_size=10, epochs=1, devices=devices, work_load_list=work_load,
              shuffle=False, verbose=0)
    assert_same_weights(model.module, ref)


@pytest.mark.parametrize("devices,work_load", DEVICE_SETUPS[1:])
def test_last_partial_batch_is_trained(devices, work_load):
    # 23 samples, batch 10: the last batch has 3 rows and is trained, not dropped or padded.
    x, y = data(23)
    net = mlp()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(0, 23, 10):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x[i:i + 10]), y[i:i + 10]).backward()
        opt.step()
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy")
    model.fit(x, y, batch_size=10, devices=devices, work_load_list=work_load, shuffle=False,
              verbose=0)
    assert model.global_step == 3
    assert_same_weights(model.module, ref)


def test_tail_batch_smaller_than_device_count():
    # 9 samples, batch 4, 3 devices: the last batch (1 row) runs on the first device only.
    x, y = data(9)
    ref = hand_loop(mlp(), torch.optim.SGD, x, y, steps=3, bs=4, lr=0.1)
    model = fitdp.Model(mlp())
    model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy")
    model.fit(x, y, batch_size=4, devices=["cpu"] * 3, shuffle=False, verbose=0)
    assert_same_weights(model.module, ref)


def test_grad_accumulation_matches_mean_of_micro_batches():
    x, y = data(40)
    net = mlp()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(0, 40, 20):  # two micro-batches of 10 per step, each weighted 1/2
        opt.zero_grad()
        for j in (i, i + 10):
            (nn.functional.cross_entropy(ref(x[j:j + 10]), y[j:j + 10]) / 2).backward()
        opt.step()
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.1, loss="cross_entropy", grad_accum_steps=2)
    model.fit(x, y, batch_size=10, devices=["cpu", "cpu"], shuffle=False, verbose=0)
    assert model.global_step == 2
    assert_same_weights(model.module, ref)


def test_grad_clip_norm_matches_torch_clip():
    x, y = data(20)
    net = mlp()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i in range(0, 20, 10):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x[i:i + 10]), y[i:i + 10]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
    model = fitdp.Model(net)
    model.compile(optimizer="sgd", lr=0.5, loss="cross_entropy", grad_clip_norm=0.05)
    model.fit(x, y, batch_size=10, devices=["cpu", "cpu"], shuffle=False, verbose=0)
    assert_same_weights(model.module, ref)


def test_batchnorm_replicas_and_copy_to_mean():
    """Each replica's BatchNorm statistics follow its own slice; copy_to averages them (the
    seed's semantics), and sync_buffers gives every replica that average."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    mgr = DataParallelExecutorManager(net, ["cpu", "cpu"], loss=nn.functional.cross_entropy)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    mgr.load_data_batch(DataBatch(x, y))
    mgr.forward(is_train=True)
    idx = mgr.aux_names.index("1.running_mean")
    replicas = mgr.aux_arrays[idx]
    assert not torch.equal(replicas[0], replicas[1])  # each replica saw its own half
    target = {"1.running_mean": torch.empty(8, dtype=torch.float64)}
    mgr.copy_to({}, target)
    mean = (replicas[0] + replicas[1]) / 2
    torch.testing.assert_close(target["1.running_mean"], mean.double())
    mgr.sync_buffers()
    assert torch.equal(replicas[0], replicas[1])
    torch.testing.assert_close(replicas[0], mean)
    mgr.close()


def test_bf16_mixed_trains_close_to_fp32():
    x, y = data(64)
    losses = {}
    for precision in ("32", "bf16-mixed"):
        model = fitdp.Model(mlp())
        model.compile(optimizer="adam", lr=0.01, loss="cross_entropy", precision=precision)
        h = model.fit(x, y, batch_size=16, epochs=3, devices=["cpu", "cpu"], verbose=0, seed=0)
        losses[precision] = h.history["loss"]
    assert losses["bf16-mixed"][-1] < losses["bf16-mixed"][0]
    assert abs(losses["bf16-mixed"][-1] - losses["32"][-1]) < 0.1


def frozen_net() -> nn.Module:
    """A model with a frozen BatchNorm and a switched-off Dropout (both in eval): what a
    fine-tuning user trains. Its statistics are set, so a wrong mode shows in the numbers."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.5),
                        nn.Linear(16, 5))
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    net[1].eval()
    net[3].eval()
    return net


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 3), loads=st.lists(st.integers(1, 4), min_size=3, max_size=3),
       accum=st.integers(1, 2), batch=st.integers(5, 16))
def test_any_device_list_and_work_loads_equal_one_device(n, loads, accum, batch):
    """Property (the brief: "compare with one device on random device lists"): on 2-3 CPU
    replicas with any work loads (a device may get no rows of a short batch), any batch size
    and gradient accumulation, fit with a torchmetrics metric and validation ends with the
    one-device weights, the frozen BatchNorm's statistics untouched, every submodule's mode
    as it was, the same logs, and the global generator where one device leaves it."""
    x, y = data(50)
    runs = []
    for devices, work in ((["cpu"], None), (["cpu"] * n, loads[:n])):
        model = fitdp.Model(frozen_net())
        model.compile("adam", lr=0.01, loss="cross_entropy", grad_accum_steps=accum,
                      metrics=[MulticlassAccuracy(num_classes=5)])
        torch.manual_seed(7)
        history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                            validation_data=(x[:20], y[:20]), devices=devices,
                            work_load_list=work, verbose=0)
        runs.append((model, history.history, torch.get_rng_state()))
    (one, logs_one, rng_one), (many, logs_many, rng_many) = runs
    assert_same_weights(one.module, many.module)
    for name, t in one.module.named_buffers():
        assert torch.equal(t, dict(many.module.named_buffers())[name]), name
    assert [m.training for m in many.module.modules()] == [True, True, False, True, False,
                                                           True]
    assert logs_one.keys() == logs_many.keys()
    for key in logs_one:
        assert logs_many[key] == pytest.approx(logs_one[key], rel=1e-5, abs=1e-6), key
    assert torch.equal(rng_one, rng_many)
