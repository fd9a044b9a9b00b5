"""What a new user passes in the first hour (issue 17 items 6-9): each is refused clearly,
naming the argument, before a weight changes, or works as a Keras user expects."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanSquaredError

import fitdp

X, Y = torch.randn(20, 4), torch.randint(0, 3, (20,))


def make_model(**compile_kw) -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    model.compile(**{"optimizer": "adam", "loss": "cross_entropy", **compile_kw})
    return model


def snapshot(model: fitdp.Model) -> tuple:
    return ({k: v.clone() for k, v in model.module.state_dict().items()},
            repr(model.optimizer.state_dict()), model.global_step)


def assert_unchanged(model: fitdp.Model, before: tuple) -> None:
    after = snapshot(model)
    assert all(torch.equal(v, after[0][k]) for k, v in before[0].items())
    assert after[1:] == before[1:]


def with_bad(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# -- item 6: a module without parameters ------------------------------------------------------

def test_a_module_without_parameters_evaluates_and_predicts():
    """Regression (issue 17 item 6): compile on nn.Identity failed with torch's "optimizer
    got an empty parameter list", so it could not even be evaluated. Evaluate and predict
    need no optimizer; their values equal torchmetrics and the identity on the whole data."""
    model = fitdp.Model(nn.Identity())
    model.compile(loss="mse", metrics=[MeanSquaredError()])
    assert model.optimizer is None
    target = X + 0.5
    logs = model.evaluate(X, target, devices=["cpu", "cpu"], verbose=0)
    expected = float(nn.functional.mse_loss(X, target))
    assert logs["loss"] == pytest.approx(expected, rel=1e-6)
    assert logs["mean_squared_error"] == pytest.approx(
        float(MeanSquaredError()(X, target)), rel=1e-6)
    assert torch.equal(model.predict(X, devices=["cpu", "cpu"]), X)


def test_fit_on_a_module_without_parameters_says_there_is_nothing_to_train():
    model = fitdp.Model(nn.Identity())
    model.compile(loss="mse")
    with pytest.raises(ValueError, match=r"module: got Identity, which has no parameters"):
        model.fit(X, X, verbose=0)
    assert model.global_step == 0


# -- item 7: a metric that fails ---------------------------------------------------------------

@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_a_failing_metric_is_named_not_blamed_on_the_module(devices):
    """Regression (issue 17 item 7): MulticlassAccuracy(num_classes=2) on a 3-output model
    was reported as "the module's forward or the loss failed on the first batch"."""
    model = make_model(metrics={"acc": MulticlassAccuracy(num_classes=2)})
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        model.fit(X, Y, devices=devices, verbose=0)
    text = str(info.value)
    assert text.startswith("metrics: 'acc' (MulticlassAccuracy) failed to update"), text
    assert "num_classes" in text and "forward or the loss" not in text
    assert_unchanged(model, before)
    with pytest.raises(ValueError, match=r"'acc' \(MulticlassAccuracy\)"):
        model.evaluate(X, Y, devices=devices, verbose=0)


# -- item 8: NaN or infinity in in-memory data -------------------------------------------------

NON_FINITE = [
    ("NaN in x", dict(x=with_bad(X, (7, 2), float("nan")), y=Y), "x: got nan in row 7"),
    ("inf in x[1]", dict(x=(X, with_bad(X, (13, 0), float("inf"))), y=Y),
     "x[1]: got inf in row 13"),
    ("-inf in y", dict(x=X, y=with_bad(X, (3, 1), -float("inf"))), "y: got -inf in row 3"),
    ("NaN in sample_weight", dict(x=X, y=Y, sample_weight=with_bad(torch.ones(20), (19,),
                                                                   float("nan"))),
     "sample_weight: got nan in row 19"),
    ("NaN in validation_data", dict(x=X, y=Y, validation_data=(with_bad(X, (2, 3), float(
        "nan")), Y)), "validation_data: got nan in row 2"),
    ("NaN in a numpy x", dict(x=with_bad(X, (5, 0), float("nan")).numpy().astype(np.float64),
                              y=Y.numpy()), "x: got nan in row 5"),
]


@pytest.mark.parametrize("name,kwargs,words", NON_FINITE, ids=[c[0] for c in NON_FINITE])
def test_nan_or_inf_in_memory_data_is_refused_before_the_first_step(name, kwargs, words):
    """Regression (issue 17 item 8): NaN or inf in in-memory x or y trained silently to NaN
    weights. The data is scanned once (as the label range is), before the first step."""
    model = make_model()
    if kwargs["y"].ndim == 2:  # float targets: a regression
        model = fitdp.Model(nn.Linear(4, 4))
        model.compile(optimizer="adam", loss="mse")
    before = snapshot(model)
    with pytest.raises(ValueError, match="finite numbers") as info:
        model.fit(kwargs.pop("x"), kwargs.pop("y"), devices=["cpu", "cpu"], verbose=0,
                  **kwargs)
    assert str(info.value).startswith(words), str(info.value)
    assert_unchanged(model, before)


def test_data_found_finite_is_scanned_again_only_after_a_write(monkeypatch):
    """Data passed to one fit after another (an epoch per call) is summed once while torch
    sees no write to it; an in-place write makes the next call scan it again and refuse it."""
    import fitdp.data.sources.convert as convert

    sums = []
    real = torch.isfinite
    monkeypatch.setattr(convert.torch, "isfinite", lambda t: sums.append(t.numel()) or real(t))
    model = make_model()
    x = X.clone()
    model.fit(x, Y, batch_size=5, verbose=0)
    scanned = len(sums)
    assert scanned == 1  # x (Y holds class indices: nothing to scan)
    model.fit(x, Y, batch_size=5, verbose=0)
    assert len(sums) == scanned
    x[3, 2] = float("inf")
    before = snapshot(model)
    with pytest.raises(ValueError, match="x: got inf in row 3"):
        model.fit(x, Y, batch_size=5, verbose=0)
    assert_unchanged(model, before)


def test_evaluate_scans_in_memory_data_and_a_dataloader_is_the_way_around_it():
    model = make_model()
    bad = with_bad(X, (4, 1), float("nan"))
    with pytest.raises(ValueError, match="x: got nan in row 4"):
        model.evaluate(bad, Y, verbose=0)
    loader = DataLoader(TensorDataset(bad, Y), batch_size=5)  # a model that handles NaN
    assert np.isnan(model.evaluate(loader, verbose=0)["loss"])


# -- item 9: values of the right type that are still wrong, and numpy forms ------------------

FIT_CASES = [
    ("validation_split=[]", dict(validation_split=[]), TypeError,
     "validation_split: got [] (list)"),
    ("work_load_list='autox'", dict(work_load_list="autox", devices=["cpu", "cpu"]),
     ValueError, "work_load_list: got 'autox'; expected 'auto'"),
    ("work_load_list that overflows", dict(work_load_list=[1e308, 1e308],
                                           devices=["cpu", "cpu"]), ValueError,
     "work_load_list: got [1e+308, 1e+308], whose sum is not a finite number"),
    ("steps_per_epoch=10**30", dict(steps_per_epoch=10**30), ValueError,
     "steps_per_epoch: got 1000000000000000000000000000000; expected an int from 1 to"),
    ("seed=10**30", dict(seed=10**30), ValueError, "seed: got 1000000000000000000000000000000"),
]


@pytest.mark.parametrize("name,kwargs,exc,words", FIT_CASES, ids=[c[0] for c in FIT_CASES])
def test_fit_refuses_wrong_values_clearly(name, kwargs, exc, words):
    """Regression (issue 17 item 9): an empty validation_split was silently no split,
    'autox' was a TypeError, huge counts and loads overflowed inside itertools/torch."""
    model = make_model()
    before = snapshot(model)
    with pytest.raises(exc) as info:
        model.fit(X, Y, verbose=0, **kwargs)
    assert str(info.value).startswith(words), str(info.value)
    assert_unchanged(model, before)


@pytest.mark.parametrize("kw,exc,words", [
    ({"grad_accum_steps": 10**30}, ValueError,
     "grad_accum_steps: got 1000000000000000000000000000000; expected an int from 1 to"),
    ({"lr_scheduler": torch.optim.lr_scheduler.StepLR}, TypeError,
     "lr_scheduler: calling StepLR with the optimizer alone raised TypeError"),
    ({"lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt)}, TypeError,
     "lr_scheduler: calling"),
    ({"optimizer": lambda params: torch.optim.SGD(params, momentum=-1)}, ValueError,
     "optimizer: calling"),
], ids=["grad_accum_steps=10**30", "StepLR class", "StepLR without step_size",
        "optimizer factory"])
def test_compile_names_the_argument_whose_value_fails(kw, exc, words):
    """Regression (issue 17 item 9): grad_accum_steps=10**30 overflowed in fit; a scheduler
    factory that torch refuses surfaced torch's TypeError without naming lr_scheduler."""
    model = make_model()
    old = model.optimizer
    with pytest.raises(exc) as info:
        model.compile(**kw)
    assert str(info.value).startswith(words), str(info.value)
    assert model.optimizer is old  # the previous compile stays


@pytest.mark.parametrize("array,arg", [
    (np.array([[1, 2, 3, 4]] * 20, dtype=object), "x"),
    (np.array([["a", "b", "c", "d"]] * 20), "x"),
    (np.array(["cat"] * 20), "y"),
])
def test_numpy_arrays_of_objects_or_strings_are_a_type_error_naming_them(array, arg):
    """Regression (issue 17 item 9): torch's "can't convert np.ndarray of type
    numpy.object_" reached the user."""
    model = make_model()
    data = {"x": X.numpy(), "y": Y.numpy(), arg: array}
    with pytest.raises(TypeError, match=rf"^{arg}: got a numpy array of dtype"):
        model.fit(data["x"], data["y"], verbose=0)


def test_reversed_numpy_arrays_train_like_their_copy():
    """Regression (issue 17 item 9): x[::-1] failed with torch's "negative strides" error;
    it is copied, as a user expects, and trains exactly like np.ascontiguousarray(x)."""
    xs, ys = X.numpy()[::-1], Y.numpy()[::-1]
    models = [make_model(), make_model()]
    models[0].fit(xs, ys, epochs=2, seed=0, verbose=0)
    models[1].fit(np.ascontiguousarray(xs), np.ascontiguousarray(ys), epochs=2, seed=0,
                  verbose=0)
    for a, b in zip(*(m.module.state_dict().values() for m in models)):
        assert torch.equal(a, b)
