"""fit's data arguments against Keras 3: validation_split, validation_freq/steps/batch_size,
sample_weight (also as `(x, y, w)`), class_weight, generators with steps_per_epoch, and x/y
by keyword. Each behaviour has a hand-computed test; `*_keras` twins run Keras 3 too."""

from __future__ import annotations

import warnings

import pytest
import torch
from twins import close, cross_entropy, data, fitdp_model, keras_model, linear, np_

from fitdp.callbacks import LambdaCallback
from fitdp.checks import FitdpWarning

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning",
                                        "ignore:`shuffle=True` was passed:UserWarning")


def counter() -> tuple[dict[str, list[int]], LambdaCallback]:
    """A callback that records the batch indices its train and test batch hooks see."""
    seen: dict[str, list[int]] = {"train": [], "test": []}
    cb = LambdaCallback(on_train_batch_end=lambda batch, logs: seen["train"].append(batch),
                        on_test_batch_end=lambda batch, logs: seen["test"].append(batch))
    return seen, cb


# -- validation_split -----------------------------------------------------------------------

def test_validation_split_trains_on_the_floor_of_the_samples():
    """Keras 3 (`train_validation_split`): the first `floor(n * (1 - split))` samples train,
    the rest validate, cut before shuffling: 16 samples with 0.2 give 12 and 4."""
    x, y, _ = data(16)
    model = fitdp_model(lr=0.0)  # frozen: the validation loss is that of the start weights
    seen, cb = counter()
    h = model.fit(x, y, batch_size=4, epochs=1, validation_split=0.2, callbacks=[cb],
                  verbose=0)
    assert seen == {"train": [0, 1, 2], "test": [0]}  # 12 rows train, 4 validate
    assert h.history["val_loss"][0] == pytest.approx(float(cross_entropy(linear(), x[12:],
                                                                         y[12:]).mean()))
    assert h.history["loss"][0] == pytest.approx(float(cross_entropy(linear(), x[:12],
                                                                     y[:12]).mean()))


def test_validation_split_keras(keras):
    """The same split and values as Keras's fit on the same weights and data."""
    x, y, _ = data(16)
    ours = fitdp_model().fit(x, y, batch_size=4, epochs=2, validation_split=0.2,
                             shuffle=False, verbose=0)
    theirs = keras_model(keras).fit(*np_(x, y), batch_size=4, epochs=2, validation_split=0.2,
                                    shuffle=False, verbose=0)
    close(ours.history, theirs.history, ["loss", "accuracy", "val_loss", "val_accuracy"])


# -- validation_freq, validation_steps, validation_batch_size -------------------------------

@pytest.mark.parametrize(("freq", "validated"), [(2, [1, 3]), ([1, 4], [0, 3])])
def test_validation_freq_validates_every_nth_or_the_listed_epochs(freq, validated):
    """Keras's `validation_freq`: an int N validates after epochs N, 2N, ... (1-based); a
    list names the epochs. History holds one `val_` value per validation (regression:
    History repeated the last `val_loss` in every epoch without validation)."""
    x, y, _ = data(16)
    logs: dict[int, list[str]] = {}
    cb = LambdaCallback(on_epoch_end=lambda epoch, keys: logs.setdefault(epoch, sorted(keys)))
    h = fitdp_model().fit(x, y, batch_size=8, epochs=4, validation_data=(x[:4], y[:4]),
                          validation_freq=freq, callbacks=[cb], verbose=0)
    assert [e for e in range(4) if "val_loss" in logs[e]] == validated
    assert len(h.history["val_loss"]) == len(validated)
    assert len(set(h.history["val_loss"])) == len(validated)


def test_validation_freq_keras(keras):
    """History equals Keras's with `validation_freq=2`: `val_` lists only as long as the
    number of validations."""
    x, y, _ = data(16)
    val = (x[:4], y[:4])
    ours = fitdp_model().fit(x, y, batch_size=8, epochs=4, validation_data=val,
                             validation_freq=2, shuffle=False, verbose=0)
    theirs = keras_model(keras).fit(*np_(x, y), batch_size=8, epochs=4,
                                    validation_data=tuple(np_(*val)), validation_freq=2,
                                    shuffle=False, verbose=0)
    close(ours.history, theirs.history, ["loss", "val_loss", "val_accuracy"])


def test_validation_steps_and_batch_size_score_the_first_batches():
    """Keras: validation runs `validation_steps` batches of `validation_batch_size` from the
    start of the validation data, every time."""
    x, y, _ = data(16)
    seen, cb = counter()
    h = fitdp_model(lr=0.0).fit(x, y, batch_size=8, epochs=2, validation_data=(x, y),
                                validation_steps=2, validation_batch_size=3,
                                callbacks=[cb], verbose=0)
    assert seen["test"] == [0, 1, 0, 1]
    first_six = float(cross_entropy(linear(), x[:6], y[:6]).mean())
    assert h.history["val_loss"] == pytest.approx([first_six, first_six])


def test_validation_steps_and_batch_size_keras(keras):
    x, y, _ = data(16)
    kw = {"batch_size": 8, "epochs": 2, "validation_steps": 2, "validation_batch_size": 3,
          "shuffle": False, "verbose": 0}
    ours = fitdp_model().fit(x, y, validation_data=(x, y), **kw)
    theirs = keras_model(keras).fit(*np_(x, y), validation_data=tuple(np_(x, y)), **kw)
    close(ours.history, theirs.history, ["loss", "val_loss", "val_accuracy"])


# -- sample_weight, (x, y, w), class_weight ---------------------------------------------------

def test_sample_weight_scales_each_samples_loss():
    """Keras's default reduction, `sum_over_batch_size`: a batch's loss is
    `sum(w_i * loss_i) / batch_size`, and the epoch's loss is the batch-size-weighted mean
    of those, so over an epoch `sum(w_i * loss_i) / n`. Metrics stay unweighted (Keras
    weighs only `weighted_metrics`)."""
    x, y, w = data(16)
    h = fitdp_model(lr=0.0).fit(x, y, sample_weight=w, batch_size=5, epochs=1, verbose=0)
    per = cross_entropy(linear(), x, y)
    assert h.history["loss"][0] == pytest.approx(float((w * per).sum() / 16), rel=1e-6)
    plain = fitdp_model(lr=0.0).fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert h.history["accuracy"] == plain.history["accuracy"]


def test_a_third_element_of_the_data_is_the_sample_weight():
    """Keras unpacks `(x, y, sample_weight)` tuples, for `x` and for `validation_data`."""
    x, y, w = data(16)
    by_name = fitdp_model().fit(x, y, sample_weight=w, batch_size=4, epochs=2, shuffle=False,
                                validation_data=(x[:8], y[:8], w[:8]), verbose=0)
    in_tuple = fitdp_model().fit((x, y, w), batch_size=4, epochs=2, shuffle=False,
                                 validation_data=(x[:8], y[:8], w[:8]), verbose=0)
    assert by_name.history == in_tuple.history
    val = float((w[:8] * cross_entropy(linear(), x[:8], y[:8])).sum() / 8)
    frozen = fitdp_model(lr=0.0).fit((x, y, w), epochs=1, validation_data=(x[:8], y[:8], w[:8]),
                                     verbose=0)
    assert frozen.history["val_loss"][0] == pytest.approx(val)


def test_sample_weight_keras(keras):
    """Losses with sample weights, in training and validation, equal Keras's."""
    x, y, w = data(16)
    kw = {"batch_size": 5, "epochs": 2, "shuffle": False, "verbose": 0}
    ours = fitdp_model().fit((x, y, w), validation_data=(x[:8], y[:8], w[:8]), **kw)
    theirs = keras_model(keras).fit(*np_(x, y), sample_weight=w.numpy(),
                                    validation_data=tuple(np_(x[:8], y[:8], w[:8])), **kw)
    close(ours.history, theirs.history, ["loss", "accuracy", "val_loss", "val_accuracy"])


def test_class_weight_weighs_each_sample_by_its_class():
    """Keras (`class_weight_to_sample_weights`): each sample's weight is its class's; a
    class without an entry weighs 1."""
    x, y, _ = data(16)
    h = fitdp_model(lr=0.0).fit(x, y, class_weight={0: 2.0, 2: 0.5}, batch_size=8,
                                verbose=0)
    w = torch.tensor([{0: 2.0, 1: 1.0, 2: 0.5}[int(c)] for c in y])
    per = cross_entropy(linear(), x, y)
    assert h.history["loss"][0] == pytest.approx(float((w * per).sum() / 16), rel=1e-6)


def test_class_weight_keras(keras):
    x, y, _ = data(16)
    kw = {"batch_size": 4, "epochs": 2, "shuffle": False, "verbose": 0,
          "class_weight": {0: 2.0, 2: 0.5}}
    ours = fitdp_model().fit(x, y, **kw)
    theirs = keras_model(keras).fit(*np_(x, y), **kw)
    close(ours.history, theirs.history, ["loss", "accuracy"])


def test_class_weight_and_sample_weight_multiply():
    """A deliberate difference: Keras refuses both at once; fitdp multiplies them."""
    x, y, w = data(16)
    both = fitdp_model(lr=0.0).fit(x, y, sample_weight=w, class_weight={1: 3.0}, epochs=1,
                                   verbose=0)
    cw = torch.where(y == 1, 3.0, 1.0)
    per = cross_entropy(linear(), x, y)
    assert both.history["loss"][0] == pytest.approx(float((w * cw * per).sum() / 16))


# -- generators and steps_per_epoch --------------------------------------------------------

def cycle(x: torch.Tensor, y: torch.Tensor, batch: int):
    """An endless generator of `(x, y)` batches, in order."""
    while True:
        for i in range(0, len(x), batch):
            yield x[i:i + batch], y[i:i + batch]


def test_an_endless_generator_trains_with_steps_per_epoch():
    """Keras: a generator that never ends trains `steps_per_epoch` batches per epoch, for
    as many epochs as asked, continuing where the last epoch stopped."""
    x, y, _ = data(12)
    seen, cb = counter()
    model = fitdp_model()
    h = model.fit(cycle(x, y, 4), epochs=3, steps_per_epoch=2, callbacks=[cb], verbose=0)
    assert h.epoch == [0, 1, 2] and seen["train"] == [0, 1] * 3 and model.global_step == 6
    arrays = fitdp_model()  # the same six batches, in the same order
    arrays.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert torch.allclose(model.module.weight, arrays.module.weight)


def test_an_endless_generator_keras(keras):
    """Epoch losses of an endless generator with steps_per_epoch equal Keras's."""
    x, y, _ = data(12)
    ours = fitdp_model().fit(cycle(x, y, 4), epochs=3, steps_per_epoch=2, verbose=0)
    theirs = keras_model(keras).fit(((a.numpy(), b.numpy()) for a, b in cycle(x, y, 4)),
                                    epochs=3, steps_per_epoch=2, verbose=0)
    close(ours.history, theirs.history, ["loss", "accuracy"])


def test_a_generator_that_runs_out_stops_training_with_a_warning():
    """Keras warns "Your input ran out of data; interrupting training" when a generator ends
    before `steps_per_epoch * epochs` batches. fitdp gives the same advice as a
    UserWarning and stops the fit there (Keras goes on to further, short epochs)."""
    x, y, _ = data(20)
    gen = ((x[i:i + 4], y[i:i + 4]) for i in range(0, 20, 4))  # 5 batches
    with pytest.warns(UserWarning, match="ran out before steps_per_epoch"):
        h = fitdp_model().fit(gen, epochs=4, steps_per_epoch=2, verbose=0)
    assert h.epoch == [0, 1, 2]


def test_steps_per_epoch_on_arrays_continues_into_the_next_pass():
    """A deliberate difference: with in-memory data whose batches `steps_per_epoch` does not
    divide, Keras ends an epoch early at the data's end (with the warning above); fitdp
    starts the next pass of the data, so every epoch has `steps_per_epoch` batches."""
    x, y, _ = data(12)  # 3 batches of 4
    seen, cb = counter()
    model = fitdp_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=4, epochs=3, steps_per_epoch=2, shuffle=False,
                  callbacks=[cb], verbose=0)
    assert seen["train"] == [0, 1] * 3 and model.global_step == 6


# -- x and y by keyword ---------------------------------------------------------------------

def test_fit_evaluate_predict_take_x_and_y_by_keyword():
    """Keras's keyword names `x=` and `y=` (positional use unchanged); `data=`, the old
    name, still works with a deprecation warning (a UserWarning)."""
    x, y, _ = data(16)
    by_keyword = fitdp_model().fit(x=x, y=y, epochs=2, shuffle=False, verbose=0)
    by_position = fitdp_model().fit(x, y, epochs=2, shuffle=False, verbose=0)
    assert by_keyword.history == by_position.history
    model = fitdp_model()
    assert model.evaluate(x=x, y=y, verbose=0) == model.evaluate(x, y, verbose=0)
    assert torch.equal(model.predict(x=x), model.predict(x))
    with pytest.warns(FitdpWarning, match="deprecated"):
        old = model.evaluate(data=(x, y), verbose=0)
    assert old == model.evaluate(x, y, verbose=0)
    assert issubclass(FitdpWarning, UserWarning)
