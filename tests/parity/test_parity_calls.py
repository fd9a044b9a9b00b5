"""evaluate, predict and compile against Keras 3: evaluate's `steps`, `return_dict` and
`sample_weight`, predict's `steps` and `verbose`, `loss_weights` with several outputs,
`model.optimizer` after compile, predict's dtype under bf16-mixed, warnings as UserWarnings,
and the progress output (the resume line, 80 columns)."""

from __future__ import annotations

import ast
import importlib
import pathlib
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from twins import copy_dense, cross_entropy, data, fitdp_model, keras_model, linear, np_

import fitdp

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


# -- evaluate -------------------------------------------------------------------------------

def test_evaluate_return_dict_false_gives_the_keras_forms():
    """Keras's `evaluate(return_dict=False)`: the loss alone when nothing else is tracked,
    else `[loss, *metrics]` in compile order. The default stays a dict (a difference)."""
    x, y, _ = data(16)
    loss = float(cross_entropy(linear(), x, y).mean())
    model = fitdp_model()
    logs = model.evaluate(x, y, verbose=0)
    assert list(logs) == ["loss", "accuracy"] and logs["loss"] == pytest.approx(loss)
    assert model.evaluate(x, y, verbose=0, return_dict=False) == [logs["loss"],
                                                                  logs["accuracy"]]
    bare = fitdp_model(metrics=False).evaluate(x, y, verbose=0, return_dict=False)
    assert isinstance(bare, float) and bare == pytest.approx(loss)


def test_evaluate_return_dict_keras(keras):
    x, y, _ = data(16)
    for metrics in (True, False):
        ours = fitdp_model(metrics=metrics).evaluate(x, y, verbose=0, return_dict=False)
        theirs = keras_model(keras, metrics=metrics).evaluate(*np_(x, y), verbose=0,
                                                              return_dict=False)
        assert type(ours) is type(theirs)
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_evaluate_steps_scores_the_first_batches():
    """Keras: `evaluate(steps=k)` scores the first `k` batches only."""
    x, y, _ = data(16)
    logs = fitdp_model().evaluate(x, y, batch_size=4, steps=2, verbose=0)
    assert logs["loss"] == pytest.approx(float(cross_entropy(linear(), x[:8], y[:8]).mean()))


def test_evaluate_sample_weight_weighs_the_loss():
    """Keras: `evaluate(sample_weight=w)` reports `sum(w_i * loss_i) / n`."""
    x, y, w = data(16)
    logs = fitdp_model().evaluate(x, y, sample_weight=w, batch_size=5, verbose=0)
    assert logs["loss"] == pytest.approx(float((w * cross_entropy(linear(), x, y)).sum() / 16))


def test_evaluate_steps_and_sample_weight_keras(keras):
    x, y, w = data(16)
    kw = {"batch_size": 5, "steps": 2, "verbose": 0, "return_dict": True}
    ours = fitdp_model().evaluate(x, y, sample_weight=w, **kw)
    theirs = keras_model(keras).evaluate(*np_(x, y), sample_weight=w.numpy(), **kw)
    assert ours == pytest.approx(theirs, rel=1e-6)


# -- predict --------------------------------------------------------------------------------

def test_predict_steps_and_verbose(capsys):
    """Keras: `predict(steps=k)` runs the first `k` batches; `verbose=0` prints nothing and
    `verbose=1` reports progress (here one line: the output is not a terminal)."""
    x, _, _ = data(16)
    model = fitdp_model()
    out = model.predict(x, batch_size=3, steps=2, verbose=0)
    assert torch.allclose(out, linear()(x[:6]).detach(), atol=1e-6)
    assert capsys.readouterr().out == ""
    model.predict(x, batch_size=3, verbose=1)
    assert capsys.readouterr().out.startswith("Predict - ")


def test_predict_steps_keras(keras):
    x, _, _ = data(16)
    ours = fitdp_model().predict(x, batch_size=3, steps=2)
    theirs = keras_model(keras).predict(x.numpy(), batch_size=3, steps=2, verbose=0)
    np.testing.assert_allclose(ours.numpy(), theirs, atol=1e-6)


def test_predict_returns_float32_for_a_float32_module_under_bf16_mixed():
    """Keras returns outputs in the model's compute dtype; a float32 module trained with
    `precision="bf16-mixed"` predicts float32 (autocast's bf16 outputs are cast back)."""
    x, y, _ = data(16)
    model = fitdp.Model(linear())
    model.compile("sgd", "cross_entropy", precision="bf16-mixed")
    model.fit(x, y, epochs=1, verbose=0)
    assert model.predict(x).dtype == torch.float32


# -- compile --------------------------------------------------------------------------------

class TwoHeads(nn.Module):
    """Classes and a 2-value regression from the same features."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.cls, self.reg, self.as_dict = linear(0), linear(1, out=2), as_dict

    def forward(self, x):
        a, b = self.cls(x), self.reg(x)
        return {"cls": a, "reg": b} if self.as_dict else (a, b)


def test_loss_weights_sum_a_list_or_dict_of_losses():
    """Keras's `loss_weights`: the loss of a model with several outputs is the weighted sum
    of each output's loss, matched by position (list) or name (dict)."""
    x, y, _ = data(16)
    target = torch.randn(16, 2, generator=torch.Generator().manual_seed(3))
    heads = TwoHeads()
    with torch.no_grad():
        expected = float(cross_entropy(heads.cls, x, y).mean()
                         + 0.5 * nn.functional.mse_loss(heads.reg(x), target))
    as_list = fitdp.Model(TwoHeads())
    as_list.compile("sgd", ["cross_entropy", "mse"], loss_weights=[1.0, 0.5])
    assert as_list.evaluate(x, (y, target), verbose=0)["loss"] == pytest.approx(expected)
    as_dict = fitdp.Model(TwoHeads(as_dict=True))
    as_dict.compile("sgd", {"cls": "cross_entropy", "reg": "mse"},
                    loss_weights={"reg": 0.5, "cls": 1.0})
    logs = as_dict.evaluate(x, {"cls": y, "reg": target}, verbose=0)
    assert logs["loss"] == pytest.approx(expected)


def test_loss_weights_keras(keras):
    """Training with a list of losses and `loss_weights` gives Keras's losses."""
    x, y, _ = data(16)
    target = torch.randn(16, 2, generator=torch.Generator().manual_seed(3))
    ours = fitdp.Model(TwoHeads())
    ours.compile("sgd", ["cross_entropy", "mse"], lr=0.1, loss_weights=[1.0, 0.5])
    h = ours.fit(x, (y, target), batch_size=4, epochs=2, shuffle=False, verbose=0)
    inp = keras.Input((4,))
    cls, reg = keras.layers.Dense(3), keras.layers.Dense(2)
    twin = keras.Model(inp, [cls(inp), reg(inp)])
    copy_dense(cls, linear(0))
    copy_dense(reg, linear(1, out=2))
    twin.compile(optimizer=keras.optimizers.SGD(0.1), loss_weights=[1.0, 0.5],
                 loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"])
    theirs = twin.fit(x.numpy(), [y.numpy(), target.numpy()], batch_size=4, epochs=2,
                      shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["loss"], theirs.history["loss"], rtol=1e-5)


def test_fit_evaluate_predict_take_keras_positional_order(keras):
    """fit(x, y, 32, 2) was Python's own TypeError; Keras's fit takes (x, y, batch_size,
    epochs, verbose, callbacks, validation_split, validation_data, shuffle, ...) by
    position, evaluate (x, y, batch_size, verbose, ...) and predict (x, batch_size,
    verbose, ...): the same positional calls train, score and predict as the Keras twin."""
    x, y, _ = data(16)
    ours = fitdp_model(metrics=False)
    h = ours.fit(x, y, 4, 2, 0, None, 0.0, None, False)
    twin = keras_model(keras, metrics=False)
    theirs = twin.fit(*np_(x, y), 4, 2, 0, None, 0.0, None, False)
    assert h.epoch == theirs.epoch == [0, 1]
    np.testing.assert_allclose(h.history["loss"], theirs.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(ours.evaluate(x, y, 8, 0, None, None, None, False),
                               twin.evaluate(*np_(x, y), 8, 0, None, None, None, False),
                               rtol=1e-5)
    np.testing.assert_allclose(ours.predict(x, 8, 0).numpy(), twin.predict(x.numpy(), 8, 0),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError):
        ours.fit(x, y, 4, 1, 0, None, 0.0, None, False, None, None, 0, None, None, None, 1,
                 ["cpu"])  # fitdp's own arguments (devices, ...) stay keyword-only


def test_compile_third_positional_is_metrics_and_keras_loss_weights_there_is_refused():
    """compile's third positional argument is metrics in fitdp but loss_weights in Keras
    (optimizer, loss, loss_weights, metrics, ...): metric names there work, numbers there
    or a fourth positional argument (Keras's metrics) are a TypeError naming the keywords,
    before the model changes."""
    x, y, _ = data(8)
    model = fitdp.Model(linear())
    model.compile("sgd", "cross_entropy", ["accuracy"])
    assert list(model.evaluate(x, y, verbose=0)) == ["loss", "accuracy"]
    before = model.optimizer
    for args in (([1.0, 0.5],), ({"cls": 1.0},), (None, ["accuracy"])):
        with pytest.raises(TypeError, match=r"loss_weights.*Fix: pass loss_weights=\.\.\."):
            model.compile("sgd", ["cross_entropy", "mse"], *args)
        assert model.optimizer is before


def test_optimizer_exists_right_after_compile():
    """Keras: `model.optimizer` is set by compile, before any fit; fit trains that very
    optimizer (a callback may adjust it before the first step)."""
    model = fitdp_model()
    opt = model.optimizer
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.1
    opt.param_groups[0]["lr"] = 0.0
    x, y, _ = data(16)
    model.fit(x, y, epochs=1, verbose=0)
    assert model.optimizer is opt
    assert torch.equal(model.module.weight, linear().weight)


# -- warnings and the progress output --------------------------------------------------------

def test_every_warning_fitdp_gives_is_a_user_warning():
    """Keras warns with plain `warnings.warn` (UserWarning), so users' filters catch it.
    Every `warnings.warn` call in fitdp passes a UserWarning subclass (or none: the
    default, UserWarning)."""
    root = pathlib.Path(fitdp.__file__).parent
    calls = 0
    for path in root.rglob("*.py"):
        module = importlib.import_module(
            ".".join(("fitdp", *path.relative_to(root).with_suffix("").parts))
            .removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "warn"
                    and getattr(node.func.value, "id", None) == "warnings"):
                continue
            calls += 1
            given = [k.value for k in node.keywords if k.arg == "category"] + node.args[1:2]
            category = eval(ast.unparse(given[0]), vars(module)) if given else UserWarning
            assert issubclass(category, UserWarning), f"{path.name}:{node.lineno}"
    assert calls >= 5


def test_a_users_filter_silences_fitdps_warnings():
    """`warnings.simplefilter("ignore", UserWarning)` hides what fitdp warns about: the old
    `data=` name, a monitored key missing from the logs, a generator that runs out."""
    from fitdp.callbacks import EarlyStopping

    x, y, _ = data(8)

    def run(silence: bool) -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if silence:
                warnings.simplefilter("ignore", UserWarning)
            gen = ((x[i:i + 4], y[i:i + 4]) for i in (0, 4))
            fitdp_model().fit(data=gen, epochs=2, steps_per_epoch=2, verbose=0,
                              callbacks=[EarlyStopping(monitor="val_loss")])
        return caught

    assert len(run(silence=False)) >= 3
    assert run(silence=True) == []


def test_a_resumed_fit_says_so_on_the_progress_output(tmp_path, capsys):
    """A fit that resumes names the checkpoint and the step it continues from, before the
    first epoch line (Keras's BackupAndRestore resumes silently; fitdp says so)."""
    x, y, _ = data(16)
    first = fitdp_model()
    first.fit(x, y, batch_size=8, epochs=1, verbose=0)
    first.save(tmp_path / "c.ckpt")
    fitdp_model().fit(x, y, batch_size=8, epochs=3, verbose=2, resume=str(tmp_path / "c.ckpt"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"resumed from {tmp_path / 'c.ckpt'} at epoch 2, step 2"
    epochs = [line for line in lines[1:] if not line.startswith(" ")]  # (wrapped items)
    assert [line.split(" - ")[0] for line in epochs] == ["Epoch 2/3", "Epoch 3/3"]


def test_progress_lines_fit_80_columns(monkeypatch, capsys):
    """Keras's ProgbarLogger prints full names and can overflow a terminal; fitdp keeps every
    line within the width (80 without a terminal): long metric names are shortened and
    numbers have one format (4 significant digits), wrapped between items."""
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

    monkeypatch.setenv("COLUMNS", "80")
    x, y, _ = data(16)
    model = fitdp.Model(linear())
    model.compile("sgd", "cross_entropy", metrics={
        "multiclass_accuracy": MulticlassAccuracy(num_classes=3),
        "multiclass_f1_score": MulticlassF1Score(num_classes=3),
        "my_rather_long_custom_metric_name": MulticlassAccuracy(num_classes=3, top_k=2)})
    model.fit(x, y, epochs=2, validation_data=(x, y), verbose=2)
    out = capsys.readouterr().out
    assert out and all(len(line) <= 80 for line in out.splitlines())
    assert "val_acc: " in out and "multiclass_accuracy" not in out
