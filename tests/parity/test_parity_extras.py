"""`Model.summary()` and the one-batch calls `train_on_batch`, `test_on_batch` and
`predict_on_batch` against Keras 3."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from torch import nn
from twins import cross_entropy, data, fitdp_model, keras_model, linear, np_, same_weights

import fitdp
import fitdp.model.extras
import fitdp.model.summary

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def small_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def summary_text(model: fitdp.Model, *args, **kwargs) -> str:
    """The table summary() hands its print_fn (Keras's way to keep it)."""
    got: list[str] = []
    model.summary(*args, print_fn=got.append, **kwargs)
    assert len(got) == 1
    return got[0]


def totals(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip().startswith(("Total params", "Trainable params", "Non-trainable"))]


# -- summary ----------------------------------------------------------------------------------

def test_summary_shows_layers_output_shapes_and_parameter_counts(capsys):
    """Keras's summary: one row per layer with its type, output shape and parameters, then
    total, trainable and non-trainable counts (BatchNorm's running statistics are
    non-trainable weights). Printed, and the same text goes to a print_fn."""
    model = fitdp.Model(small_net())
    text = summary_text(model, torch.zeros(2, 4))
    assert model.summary(torch.zeros(2, 4)) is None
    assert capsys.readouterr().out == text + "\n"
    rows = [line.split() for line in text.splitlines()[4:8]]
    assert rows == [["0", "(Linear)", "(2,", "8)", "40"], ["1", "(BatchNorm1d)", "(2,", "8)", "32"],
                    ["2", "(ReLU)", "(2,", "8)", "0"], ["3", "(Linear)", "(2,", "3)", "27"]]
    assert totals(text) == ["Total params: 99 (396.00 B)", "Trainable params: 83 (332.00 B)",
                            "Non-trainable params: 16 (64.00 B)"]
    assert all(len(line) <= 80 for line in text.splitlines())


def test_summary_without_an_example_frozen_layers_and_nesting():
    """Without an example batch the shapes are unknown (`?`, as for an unbuilt Keras model);
    a frozen layer's parameters count as non-trainable; `expand_nested` indents the layers
    of nested modules; `print_fn` receives the text instead of stdout."""
    net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 3), nn.Softmax(-1)))
    net[0].requires_grad_(False)
    text = summary_text(fitdp.Model(net), expand_nested=True, show_trainable=True)
    rows = [line.split() for line in text.splitlines()[4:8]]
    assert rows == [["0", "(Linear)", "?", "40", "N"], ["1", "(Sequential)", "?", "27", "Y"],
                    ["0", "(Linear)", "?", "27", "Y"], ["1", "(Softmax)", "?", "0", "-"]]
    assert text.splitlines()[6].startswith("   0 (Linear)")  # nested: indented
    assert totals(text) == ["Total params: 67 (268.00 B)", "Trainable params: 27 (108.00 B)",
                            "Non-trainable params: 40 (160.00 B)"]


def test_summary_runs_the_example_without_changing_the_module():
    """The example batch runs in eval mode without gradients: BatchNorm statistics, train
    mode and weights are as before."""
    net = small_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net[1].eval()  # a user's mixed modes come back as they were
    fitdp.Model(net).summary(torch.randn(5, 4) * 10, print_fn=lambda text: None)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert [m.training for m in net] == [True, False, True, True] and net.training


def test_summary_counts_keras(keras):
    """The same counts and sizes as Keras's summary of the same layers."""
    twin = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(),
                             keras.layers.Dense(3)])
    lines: list[str] = []
    twin.summary(print_fn=lambda text, **kw: lines.append(text))
    theirs = [line.strip(" │┃") for line in totals("\n".join(lines))]
    text = summary_text(fitdp.Model(small_net()))
    assert totals(text) == theirs
    per_layer = [int(line.split()[-1]) for line in text.splitlines()[4:8]]
    assert per_layer == [layer.count_params() for layer in twin.layers]


def test_summary_shapes_after_a_fit_or_from_input_shape_as_keras(keras):
    """summary() showed `?` for every layer after a fit and took no input shape; now both
    give Keras's per-layer output shapes, batch axis None."""
    twin = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(),
                             keras.layers.Dense(3)])
    theirs = [str(layer.output.shape) for layer in twin.layers]
    model = fitdp.Model(small_net())
    shapes = [line.split("(", 2)[2].split(")")[0] for line in summary_text(
        model, input_shape=(4,)).splitlines()[4:8]]
    assert [f"({s})" for s in shapes] == theirs == ["(None, 8)"] * 3 + ["(None, 3)"]
    model.compile("sgd", "cross_entropy")
    x, y, _ = data(16)
    model.fit(x, y, batch_size=8, verbose=0)
    assert summary_text(model) == summary_text(model, input_shape=(4,))
    with pytest.raises(TypeError, match="input_shape"):
        model.summary(input_shape="4")


def test_summary_returns_none_so_a_notebook_shows_the_table_once(keras, capsys):
    """summary() printed the table and returned it, so a notebook cell ending in
    model.summary() showed it twice; Keras's summary prints and returns None, and hands
    the text to print_fn instead of printing it."""
    twin = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    assert twin.summary(print_fn=lambda text, **kw: None) is None
    model = fitdp.Model(small_net())
    assert model.summary() is None
    printed = capsys.readouterr().out
    assert printed.count("Total params") == 1
    assert summary_text(model) + "\n" == printed


# -- train_on_batch -----------------------------------------------------------------------------

def test_train_on_batch_is_one_optimizer_step_on_that_batch():
    """Keras: one optimizer step on the batch, returning the loss and metrics computed on
    it before the step: the loss alone, `[loss, *metrics]`, or a dict."""
    x, y, _ = data(16)
    model = fitdp_model()
    loss = float(cross_entropy(linear(), x, y).mean())
    values = model.train_on_batch(x, y)
    assert values[0] == pytest.approx(loss) and len(values) == 2
    assert model.global_step == 1
    same = fitdp_model()
    same.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert torch.allclose(model.module.weight, same.module.weight)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert list(logs) == ["loss", "accuracy"] and model.global_step == 2
    assert (model.run.epoch, model.run.batch) == (0, 0)  # a step, not a place in an epoch
    bare = fitdp_model(metrics=False).train_on_batch(x, y)
    assert isinstance(bare, float) and bare == pytest.approx(loss)


def test_on_batch_metrics_restart_every_call():
    """Keras 3 resets the metrics before each `*_on_batch` call: a call reports its batch
    alone."""
    x, y, _ = data(16)
    model = fitdp_model(lr=0.0)
    alone = model.evaluate(x[8:], y[8:], verbose=0)["accuracy"]
    model.train_on_batch(x[:8], y[:8])
    assert model.train_on_batch(x[8:], y[8:], return_dict=True)["accuracy"] == alone
    model.test_on_batch(x[:8], y[:8])
    assert model.test_on_batch(x[8:], y[8:], return_dict=True)["accuracy"] == alone


def test_train_on_batch_sample_and_class_weight():
    """The batch's loss is weighted as in fit: `sum(w_i * loss_i) / batch_size`."""
    x, y, w = data(16)
    per = cross_entropy(linear(), x, y)
    got = fitdp_model(metrics=False).train_on_batch(x, y, sample_weight=w)
    assert got == pytest.approx(float((w * per).mean()))
    cw = torch.where(y == 2, 4.0, 1.0)
    got = fitdp_model(metrics=False).train_on_batch(x, y, class_weight={2: 4.0})
    assert got == pytest.approx(float((cw * per).mean()))


def test_train_on_batch_accumulates_like_a_keras_optimizer():
    """With `grad_accum_steps=k` every k-th call steps with the mean gradient of the k
    batches, as a Keras optimizer with `gradient_accumulation_steps=k` does."""
    x, y, _ = data(16)

    def accumulating() -> fitdp.Model:
        model = fitdp.Model(linear())
        model.compile("sgd", "cross_entropy", lr=0.1, grad_accum_steps=2)
        return model

    model = accumulating()
    model.train_on_batch(x[:8], y[:8])
    assert model.global_step == 0 and torch.equal(model.module.weight, linear().weight)
    model.train_on_batch(x[8:], y[8:])
    fitted = accumulating()
    fitted.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert model.global_step == 1
    assert torch.allclose(model.module.weight, fitted.module.weight)


def test_train_on_batch_on_several_devices_and_needs_compile():
    """The step is the same on two replicas; the model's devices are kept between calls.
    Before compile it is a RuntimeError naming the fix."""
    x, y, _ = data(16)
    one, two = fitdp_model(), fitdp_model()
    two.fit(x[:2], y[:2], epochs=1, devices=["cpu", "cpu"], verbose=0)
    one.fit(x[:2], y[:2], epochs=1, verbose=0)
    assert one.train_on_batch(x, y) == pytest.approx(two.train_on_batch(x, y))
    assert torch.allclose(one.module.weight, two.module.weight, atol=1e-6)
    with pytest.raises(RuntimeError, match="compile"):
        fitdp.Model(linear()).train_on_batch(x, y)
    with pytest.raises(TypeError, match="x: got a DataBatch"):
        one.train_on_batch(fitdp.DataBatch(x, y))


# -- test_on_batch, predict_on_batch ------------------------------------------------------------

def test_test_and_predict_on_batch_match_evaluate_and_predict():
    """Keras: `test_on_batch` scores one batch without training, `predict_on_batch` returns
    its outputs; `predict_on_batch` needs no compile."""
    x, y, w = data(16)
    model = fitdp_model()
    assert model.test_on_batch(x, y) == model.evaluate(x, y, batch_size=16, verbose=0,
                                                       return_dict=False)
    weighted = model.test_on_batch(x, y, sample_weight=w, return_dict=True)
    assert weighted == model.evaluate(x, y, sample_weight=w, batch_size=16, verbose=0)
    assert model.global_step == 0 and torch.equal(model.module.weight, linear().weight)
    out = fitdp.Model(linear()).predict_on_batch(x)
    assert torch.allclose(out, linear()(x).detach())


def test_on_batch_calls_keras(keras):
    """A sequence of one-batch calls returns what Keras's returns and ends with the same
    weights."""
    x, y, w = data(16)
    ours, twin = fitdp_model(), keras_model(keras)
    for rows in (slice(0, 8), slice(8, 16)):
        a = ours.train_on_batch(x[rows], y[rows], sample_weight=w[rows])
        b = twin.train_on_batch(*np_(x[rows], y[rows]), sample_weight=w[rows].numpy())
        np.testing.assert_allclose(a, b, rtol=1e-5)
        a = ours.test_on_batch(x[rows], y[rows], return_dict=True)
        b = twin.test_on_batch(*np_(x[rows], y[rows]), return_dict=True)
        assert a == pytest.approx(b, rel=1e-5)
    np.testing.assert_allclose(ours.predict_on_batch(x).numpy(),
                               np.asarray(twin.predict_on_batch(x.numpy())), atol=1e-5)
    assert same_weights(ours, twin, atol=1e-5)


def test_doctests():
    for module in (fitdp.model.summary, fitdp.model.extras):
        assert doctest.testmod(module).failed == 0
