"""Bad input: a clear ValueError/TypeError, raised before any weight changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

import fitdp


def make_model(**compile_kw) -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    model.compile(**{"optimizer": "sgd", "loss": "cross_entropy", **compile_kw})
    return model


X, Y = torch.randn(20, 4), torch.randint(0, 3, (20,))


class ShapeShifter(Dataset):
    """Batches of 4 samples; from sample 8 on, x has one more dimension."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        x = torch.randn(4) if i < 8 else torch.randn(4, 1)
        return x, torch.tensor(0)


def assert_untouched(model: fitdp.Model, before: dict[str, torch.Tensor]) -> None:
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"


FIT_CASES = [
    ("x and y of different lengths", dict(data=X, y=Y[:15]), ValueError, ["y", "15", "20"]),
    ("batch smaller than devices", dict(data=X, y=Y, batch_size=2, devices=["cpu"] * 3),
     ValueError, ["batch_size", "2", "3 devices"]),
    ("no CUDA", dict(data=X, y=Y, devices=[0]), ValueError, ["GPU 0", "devices="]),
    ("GPU index that does not exist", dict(data=X, y=Y, devices=["cuda:7"]), ValueError, ["GPU 7"]),
    ("empty device list", dict(data=X, y=Y, devices=[]), ValueError, ["devices", "empty"]),
    ("work load of wrong length", dict(data=X, y=Y, devices=["cpu", "cpu"], work_load_list=[1]),
     ValueError, ["work_load_list", "1 entries", "2 devices"]),
    ("non-positive work load", dict(data=X, y=Y, devices=["cpu", "cpu"], work_load_list=[1, 0]),
     ValueError, ["work_load_list", "positive"]),
    ("float targets with cross_entropy", dict(data=X, y=Y.float()), ValueError,
     ["cross_entropy", "torch.float32", "long"]),
    ("empty data set", dict(data=X[:0], y=Y[:0]), ValueError, ["0 samples"]),
    ("bad device entry", dict(data=X, y=Y, devices=[1.5]), TypeError, ["devices", "float"]),
    ("batch_size not an int", dict(data=X, y=Y, batch_size=8.0), TypeError, ["batch_size"]),
    ("unknown data type", dict(x="abc", y=Y), TypeError, ["x", "str"]),
    ("callback not a Callback", dict(data=X, y=Y, callbacks=[print]), TypeError, ["callbacks"]),
]


@pytest.mark.parametrize("name,kwargs,exc,words", FIT_CASES, ids=[c[0] for c in FIT_CASES])
def test_fit_bad_input(name, kwargs, exc, words):
    model = make_model()
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    data = kwargs.pop("x") if "x" in kwargs else kwargs.pop("data")
    y = kwargs.pop("y")
    with pytest.raises(exc) as info:
        model.fit(data, y, verbose=0, **kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"
    assert_untouched(model, before)


def test_loss_that_is_not_a_scalar():
    model = make_model(loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(ValueError, match="scalar"):
        model.fit(X, Y, verbose=0, devices=["cpu", "cpu"])
    assert_untouched(model, before)


def test_fit_before_compile():
    model = fitdp.Model(nn.Linear(4, 3))
    with pytest.raises(RuntimeError, match="compile"):
        model.fit(X, Y, verbose=0)


def test_dataloader_whose_batches_change_structure():
    model = make_model()
    with pytest.raises(ValueError, match="structure") as info:
        model.fit(DataLoader(ShapeShifter(), batch_size=4), verbose=0)
    assert "batch 2" in str(info.value)


def test_empty_dataloader():
    model = make_model()
    with pytest.raises(ValueError, match="empty"):
        model.fit(DataLoader(ShapeShifter(), batch_size=4, sampler=[]), verbose=0)


@pytest.mark.parametrize("kw,exc,word", [
    ({"optimizer": "adagradx"}, ValueError, "adagradx"),
    ({"optimizer": 3}, TypeError, "optimizer"),
    ({"loss": "hinge"}, ValueError, "hinge"),
    ({"loss": 3}, TypeError, "loss"),
    ({"metrics": [lambda a, b: 0]}, TypeError, "torchmetrics"),
    ({"metrics": [MulticlassAccuracy(num_classes=3), MulticlassAccuracy(num_classes=3)]},
     ValueError, "log key"),
    ({"precision": "fp8"}, ValueError, "precision"),
    ({"grad_accum_steps": 0}, ValueError, "grad_accum_steps"),
    ({"grad_clip_norm": -1.0}, ValueError, "grad_clip_norm"),
])
def test_compile_bad_input(kw, exc, word):
    model = fitdp.Model(nn.Linear(4, 3))
    with pytest.raises(exc, match=word):
        model.compile(**{"optimizer": "sgd", "loss": "cross_entropy", **kw})


def test_16_mixed_needs_cuda():
    model = make_model(precision="16-mixed")
    with pytest.raises(ValueError, match="bf16-mixed"):
        model.fit(X, Y, verbose=0, devices=["cpu"])


def test_module_must_be_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        fitdp.Model(lambda x: x)


def test_optimizer_instance_on_other_parameters():
    model = fitdp.Model(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="model.module.parameters"):
        model.compile(optimizer=torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=0.1))


def test_split_input_slice_too_many_slices():
    with pytest.raises(ValueError, match="Too many slices"):
        fitdp.executor.split_input_slice(2, [1, 1, 1])


def test_duplicate_parameter_names():
    class Dup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

        def named_parameters(self, *args, **kwargs):  # a module that reports a name twice
            yield from super().named_parameters()
            yield "a.weight", self.a.weight

    with pytest.raises(ValueError, match="a.weight"):
        fitdp.executor.DataParallelExecutorManager(Dup(), ["cpu"])


def test_one_shot_generator_with_several_epochs():
    """Regression: a generator of batches silently trained 0 batches after epoch 1."""
    model = make_model()
    gen = (fitdp.DataBatch(X[i:i + 5], Y[i:i + 5]) for i in range(0, 20, 5))
    with pytest.raises(ValueError, match="one-shot"):
        model.fit(gen, epochs=2, verbose=0)


def test_sync_batchnorm_needs_cuda():
    from fitdp.call.replicas import _convert_sync_batchnorm

    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with pytest.raises(ValueError, match="SyncBatchNorm runs on CUDA only"):
        _convert_sync_batchnorm(net, [torch.device("cpu")])
    assert isinstance(net[1], nn.BatchNorm1d)  # untouched
