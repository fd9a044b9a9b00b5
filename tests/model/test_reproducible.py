"""fit(reproducible=True, micro_batch_size=k) (issue 31): weights, BatchNorm statistics,
optimizer state, History and later predictions are bitwise equal (``torch.equal``, never
allclose) on any device list and work loads, and after a mid-epoch resume on other devices;
bad arguments are refused before anything changes. The reference is the same fit on one
device; with one micro-batch per batch the mode is a hand-written torch loop."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torchmetrics import MeanAbsoluteError
from torchmetrics.classification import MulticlassAccuracy

import fitdp
from fitdp.callbacks import ModelCheckpoint
from fitdp.data.sources.tensors import TensorSource
from fitdp.executor.reproducible import BlockStack, canonical_sum, micro_batches
from tests.trees import assert_same

G = torch.Generator().manual_seed(0)
X = torch.randn(72, 6, generator=G)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
IMAGES = torch.randn(40, 2, 6, 6, generator=G)
TARGETS = IMAGES.mean(dim=(1, 2, 3)).unsqueeze(1) * 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(32, 3))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 1))


SETUPS: dict[str, dict[str, Any]] = {
    "mlp": dict(net=mlp, x=X, y=Y, loss="cross_entropy", batch_size=16, micro=4,
                metrics=lambda: [MulticlassAccuracy(num_classes=3)], accum=2, clip=0.5),
    "cnn": dict(net=cnn, x=IMAGES, y=TARGETS, loss="mse", batch_size=12, micro=3,
                metrics=lambda: [MeanAbsoluteError()], accum=1, clip=1.0),
}


def train(setup: str, devices: list[str], loads: list[float] | None = None,
          reproducible: bool = True, **fit: Any) -> tuple[fitdp.Model, Any]:
    s = SETUPS[setup]
    model = fitdp.Model(s["net"]())
    model.compile("adam", s["loss"], metrics=s["metrics"](), lr=0.01,
                  grad_accum_steps=s["accum"], grad_clip_norm=s["clip"])
    history = model.fit(s["x"], s["y"], batch_size=s["batch_size"], epochs=2, verbose=0, seed=7,
                        shuffle=True, devices=devices, work_load_list=loads,
                        validation_data=(s["x"][:20], s["y"][:20]),
                        reproducible=reproducible,
                        micro_batch_size=s["micro"] if reproducible else None, **fit)
    return model, history.history


def results(model: fitdp.Model, history: Any, setup: str) -> dict[str, Any]:
    return {"module": model.module.state_dict(), "optimizer": model.optimizer.state_dict(),
            "history": history, "step": model.global_step,
            "predict": model.predict(SETUPS[setup]["x"], devices=["cpu"])}


@functools.cache
def reference(setup: str) -> dict[str, Any]:
    return results(*train(setup, ["cpu"]), setup)


layouts = st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.just(n), st.none() | st.lists(st.integers(1, 5), min_size=n, max_size=n)))


@pytest.mark.parametrize("setup", ["mlp", "cnn"])
@settings(max_examples=3, deadline=None)
@given(layout=layouts)
def test_any_devices_and_work_loads_train_bitwise_the_one_device_run(setup, layout):
    """Dropout, BatchNorm, shuffling, accumulation and clipping: every layout the same bits."""
    n, loads = layout
    got = results(*train(setup, ["cpu"] * n, loads), setup)
    assert_same(got, reference(setup))


def test_the_ordinary_step_differs_across_devices_where_the_mode_does_not():
    """The control: BatchNorm normalises per device slice in the ordinary step, so three
    replicas train other weights than one (why the mode exists)."""
    one = train("mlp", ["cpu"], reproducible=False)[0].module.state_dict()
    three = train("mlp", ["cpu"] * 3, reproducible=False)[0].module.state_dict()
    assert not all(torch.equal(one[k], three[k]) for k in one)


def test_one_micro_batch_per_batch_is_the_hand_written_torch_loop():
    """With micro_batch_size == batch_size, no shuffle, BatchNorm or dropout, the mode is
    ``zero_grad; loss.backward(); step`` in order (the reference loop), bit for bit, on any
    device list (the other devices then idle)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    ref = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    ref.load_state_dict(net.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(0, 72, 8):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(X[i:i + 8]), Y[i:i + 8]).backward()
        opt.step()
    model = fitdp.Model(net)
    model.compile("sgd", "cross_entropy", lr=0.1)
    model.fit(X, Y, batch_size=8, shuffle=False, verbose=0, devices=["cpu"] * 2,
              reproducible=True, micro_batch_size=8)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))


def test_batchnorm_statistics_fold_the_micro_batches_in_order_like_torch():
    """The running statistics are those of the layer run on each micro-batch in turn
    (torch's momentum update; close, as torch's kernel may fuse the update differently)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(5)
    x = torch.randn(12, 5, generator=G)
    ref = nn.BatchNorm1d(5)
    for i in range(0, 12, 4):
        ref(x[i:i + 4])
    m = fitdp.Model(nn.Sequential(bn, nn.Linear(5, 1)))
    m.compile("sgd", "mse", lr=0.0)
    m.fit(x, torch.zeros(12, 1), batch_size=12, shuffle=False, verbose=0, devices=["cpu"] * 3,
          reproducible=True, micro_batch_size=4)
    assert int(bn.num_batches_tracked) == 3
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_mid_epoch_checkpoint_on_three_replicas_resumes_bitwise_on_fewer(tmp_path, devices):
    """Taken right after optimizer step 2 (batch 4 of 5 of the first epoch, two batches
    accumulated per step) on three replicas with uneven loads, resumed on one and on two:
    the uninterrupted run's bits, History included."""
    class Stop(fitdp.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.global_step == 2:
                self.model.stop_training = True

    path = str(tmp_path / "step-{step}.ckpt")
    train("mlp", ["cpu"] * 3, [1, 2, 3], callbacks=[ModelCheckpoint(path, save_freq=1), Stop()])
    model, history = train("mlp", ["cpu"] * devices, resume=str(tmp_path / "step-2.ckpt"))
    got, ref = results(model, history, "mlp"), reference("mlp")
    assert_same({k: got[k] for k in ("module", "optimizer", "step", "predict")},
                   {k: ref[k] for k in ("module", "optimizer", "step", "predict")})
    assert_same(history, ref["history"])


def test_the_tree_sum_does_not_depend_on_who_summed_what():
    """Any cut of the micro-batches into contiguous runs, each summed with ``BlockStack``,
    joins to the same bits as the whole range summed by one device."""
    leaves = [[torch.randn(7, generator=G) * 10 ** (i % 5)] for i in range(11)]

    def summed(cuts: list[int]) -> torch.Tensor:
        blocks = {}
        for a, b in zip([0, *cuts], [*cuts, 11]):
            stack = BlockStack()
            for i in range(a, b):
                stack.push(i, leaves[i])
            blocks.update(dict(stack.blocks))
        return canonical_sum(blocks, 11)[0]

    whole = summed([])
    for cuts in ([5], [1, 2, 3], [3, 7, 10], [4, 8]):
        assert torch.equal(summed(cuts), whole)
    assert len(BlockStack().blocks) == 0 and micro_batches(7, 3)[-1] == slice(6, 7)


def test_ranks_take_whole_micro_batches_of_the_global_batch_in_order():
    """Under torchrun each rank holds the r-th contiguous run of whole micro-batches, so
    the ranks' rows in rank order are one process's global batch (the last one too)."""
    x = torch.arange(22)
    one = [b.data for b in TensorSource(x, None, 8, shuffle=True, seed=3)]
    parts = []
    for rank in range(2):
        src = TensorSource(x, None, 4, shuffle=True, seed=3, rank=rank, world_size=2,
                           rank_unit=2)
        parts.append([b.data for b in src])
    for step, batch in enumerate(one):
        assert torch.equal(torch.cat([parts[0][step], parts[1][step]]), batch)
        assert len(parts[0][step]) % 2 == 0  # rank 0's part: whole micro-batches


BAD = st.one_of(
    st.tuples(st.just("micro_batch_size"), st.integers(-3, 0)),
    st.tuples(st.just("micro_batch_size"), st.sampled_from([3, 5, 7, 9, 17])),  # not dividing 16
    st.tuples(st.just("micro_batch_size"), st.sampled_from([2.0, "4", True, [4]])),
    st.tuples(st.just("reproducible"), st.sampled_from([1, "yes", None, 0.0])),
    st.tuples(st.just("without"), st.integers(1, 16)),  # micro_batch_size, reproducible=False
    st.tuples(st.just("missing"), st.none()),  # reproducible=True, no micro_batch_size
)


@settings(max_examples=12, deadline=None)
@given(bad=BAD)
def test_bad_arguments_name_themselves_and_change_nothing(bad):
    """A TypeError/ValueError naming the argument, with what was received, raised in
    planning: weights, optimizer state and global_step unchanged."""
    model = _trained()
    before = (
        {k: v.clone() for k, v in model.module.state_dict().items()},
        model.optimizer.state_dict()["state"][0]["exp_avg"].clone(), model.global_step)
    name, value = bad
    kwargs: dict[str, Any] = {"reproducible": True, "micro_batch_size": 4}
    if name == "without":
        kwargs = {"micro_batch_size": value}
        name = "micro_batch_size"
    elif name == "missing":
        kwargs = {"reproducible": True}
        name = "micro_batch_size"
    else:
        kwargs[name] = value
    with pytest.raises((TypeError, ValueError), match=rf"{name}: got"):
        model.fit(X, Y, batch_size=16, verbose=0, devices=["cpu"] * 2, **kwargs)
    after = model.module.state_dict()
    assert all(torch.equal(before[0][k], after[k]) for k in after)
    assert torch.equal(before[1], model.optimizer.state_dict()["state"][0]["exp_avg"])
    assert before[2] == model.global_step


@functools.cache
def _trained() -> fitdp.Model:
    model = fitdp.Model(mlp())
    model.compile("adam", "cross_entropy")
    model.fit(X, Y, batch_size=16, verbose=0, devices=["cpu"])
    return model


def _state(model: fitdp.Model) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    return ({k: v.clone() for k, v in model.module.state_dict().items()},
            model.optimizer.state_dict()["state"][0]["exp_avg"].clone(), model.global_step)


def test_a_one_row_tail_micro_batch_with_batchnorm1d_is_refused_before_any_step():
    """Issue 37 item 7: micro_batch_size=3, batch_size=24 on 64 rows ended the data in a
    1-row micro-batch; BatchNorm1d died there after 2 steps with torch's raw "Expected more
    than 1 value per channel when training". Now refused in planning, naming the argument
    and a size that works; the suggested size then trains."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    model = fitdp.Model(mlp())
    model.compile("adam", "cross_entropy")
    model.fit(x, y, batch_size=16, verbose=0)  # optimizer state and statistics to keep
    before = _state(model)
    with pytest.raises(ValueError, match=r"micro_batch_size: got 3; expected micro-batches of "
                       r"2 rows or more for the BatchNorm1d '1'.*64 rows in micro-batches of "
                       r"3 end in one of 1 row\. Fix: micro_batch_size=2 .* or the first 63 "
                       r"rows") as err:
        model.fit(x, y, batch_size=24, verbose=0, reproducible=True, micro_batch_size=3,
                  devices=["cpu", "cpu"])
    assert_same(_state(model), before)
    with pytest.raises(ValueError, match=r"micro_batch_size: got 1;.*every micro-batch would "
                       r"be 1 row"):
        model.fit(x, y, batch_size=24, verbose=0, reproducible=True, micro_batch_size=1)
    assert_same(_state(model), before)
    suggested = int(str(err.value).split("Fix: micro_batch_size=")[1].split()[0])
    model.fit(x, y, batch_size=24, verbose=0, reproducible=True, micro_batch_size=suggested)
    assert model.global_step == before[2] + 3


def test_a_one_row_tail_micro_batch_is_left_to_batchnorm2d_which_normalises_it():
    """The control: images give BatchNorm2d values per channel in one row: 40 images in
    micro-batches of 3 end in a 1-row micro-batch, and train."""
    model = fitdp.Model(cnn())
    model.compile("adam", "mse")
    model.fit(IMAGES, TARGETS, batch_size=12, verbose=0, reproducible=True, micro_batch_size=3)
    assert model.global_step == 4


def test_a_model_with_its_own_train_step_is_refused():
    class Own(fitdp.Model):
        def train_step(self, data):
            return super().train_step(data)

    model = Own(mlp())
    model.compile("sgd", "cross_entropy")
    with pytest.raises(ValueError, match=r"reproducible: got True.*train_step"):
        model.fit(X, Y, batch_size=16, verbose=0, reproducible=True, micro_batch_size=4)
    assert model.global_step == 0


def test_an_engine_that_shards_the_weights_is_refused_and_ddp_is_told_not_to_reduce(
        monkeypatch):
    """FSDP2 reduce-scatters in backward, in its own order: the manager refuses the mode for
    an engine with ``shards_weights`` (the engine interface, not its type); any other engine
    is told that no batch of the mode is its to reduce (DDP's ``no_sync``: prepare(False))."""
    from fitdp.executor import DataParallelExecutorManager  # noqa: PLC0415
    from fitdp.executor.local_reduce import LocalReduce  # noqa: PLC0415
    from fitdp.executor.reproducible import ReproducibleStep  # noqa: PLC0415

    mgr = DataParallelExecutorManager(mlp(), ["cpu", "cpu"], loss=nn.functional.cross_entropy)
    told: list[bool] = []
    monkeypatch.setattr(mgr.engine, "prepare", told.append)
    opt = torch.optim.SGD(mgr.master_parameters(), lr=0.1)
    step = mgr.bind_step(True, optimizer=opt, micro_batch_size=4)
    assert isinstance(step, ReproducibleStep)
    step(fitdp.DataBatch(X[:16], Y[:16]), zero_grad=True, step=True)
    assert told == [False]
    mgr.engine = type("Sharding", (LocalReduce,), {"shards_weights": True})(False)
    with pytest.raises(ValueError, match=r"reproducible=True.*FSDP2"):
        mgr.bind_step(True, optimizer=opt, micro_batch_size=4)
