"""`EMA` against torch's own: ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))``
updated after every ``optimizer.step()`` of a hand-written loop on the same batches."""

from __future__ import annotations

import copy

import pytest
import torch
from averaging_helpers import (
    BATCH,
    Backup,
    X,
    Y,
    assert_params,
    batches,
    hand_loop,
    model,
    net,
)
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fitdp
from fitdp.callbacks import EMA, SWA, LambdaCallback

DECAY = 0.9


def reference(module: torch.nn.Module, epochs: int) -> tuple[AveragedModel, torch.nn.Module]:
    trained = copy.deepcopy(module)
    averaged = AveragedModel(trained, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    hand_loop(trained, epochs, averaged)
    return averaged, trained


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_ema_equals_averaged_model_of_a_hand_loop(devices):
    """One device: bit for bit; two CPU replicas: within 1e-6 (their gradient sums round
    differently). After fit the model's weights are the average; the training weights are
    the callback's."""
    module = net()
    m, ema = model(module), EMA(decay=DECAY)
    m.fit(X, Y, batch_size=BATCH, epochs=3, shuffle=False, callbacks=[ema], verbose=0,
          devices=devices)
    averaged, trained = reference(module, 3)
    exact = len(devices) == 1
    assert_params(m.get_weights(), averaged, exact)
    assert_params(m.ema_weights(), averaged, exact)
    for name, want in trained.named_parameters():
        torch.testing.assert_close(ema.training_weights[name], want.detach(),
                                   rtol=0, atol=0 if exact else 1e-6)


def test_ema_with_grad_accumulation_averages_once_per_optimizer_step():
    """grad_accum_steps=2 over 5 batches an epoch: 3 optimizer steps (the last on one batch);
    the average is AveragedModel's over the weights after each of those steps."""
    module = net()
    m = model(module)
    m.compile(optimizer="sgd", lr=0.1, loss="cross_entropy", grad_accum_steps=2)
    seen: list[dict[str, torch.Tensor]] = []

    def record(*_):  # the weights after each optimizer step, once
        if m.global_step > len(seen):
            seen.append(m.get_weights())

    rec = LambdaCallback(on_train_batch_end=record, on_epoch_end=record)
    ema = EMA(decay=DECAY)
    m.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, callbacks=[ema, rec], verbose=0)
    assert m.global_step == len(seen) == 6
    holder = copy.deepcopy(module)
    averaged = AveragedModel(holder, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    for weights in seen:
        holder.load_state_dict(weights)
        averaged.update_parameters(holder)
    assert_params(m.get_weights(), averaged, exact=True)


def test_ema_every_n_steps_equals_averaged_model_updated_every_n_steps():
    """update_every_n_steps=3 (Lightning's EMAWeightAveraging): update_parameters after
    optimizer steps 3, 6, 9, ... of the run (15 steps over 3 epochs: 5 updates)."""
    module = net()
    m = model(module)
    m.fit(X, Y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
          callbacks=[EMA(decay=DECAY, update_every_n_steps=3)])
    trained = copy.deepcopy(module)
    averaged = AveragedModel(trained, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    opt, step = torch.optim.SGD(trained.parameters(), lr=0.1), 0
    for _ in range(3):
        for x, y in batches():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(trained(x), y).backward()
            opt.step()
            step += 1
            if step % 3 == 0:
                averaged.update_parameters(trained)
    assert int(averaged.n_averaged) == 5
    assert_params(m.get_weights(), averaged, exact=True)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
@pytest.mark.parametrize("backup_first", [True, False])
@pytest.mark.parametrize("crash_at", [5, 7])  # the last step of epoch 0; mid-epoch 1
def test_ema_resumes_bitwise_with_its_average(tmp_path, devices, backup_first, crash_at):
    """A fit interrupted after step ``crash_at`` and resumed from its BackupAndRestore
    ends with the uninterrupted run's average and training weights, bit for bit, whatever
    the order of the two callbacks."""

    def run(crash_at=None):
        m, ema = model(net(), "adamw"), EMA(decay=DECAY)
        backup = Backup(str(tmp_path / "backup"), crash_at)
        m.fit(X, Y, batch_size=BATCH, epochs=3, seed=1, verbose=0, devices=devices,
              callbacks=[backup, ema] if backup_first else [ema, backup])
        return m, ema

    whole, whole_ema = run()
    with pytest.raises(KeyboardInterrupt):
        run(crash_at)
    resumed, resumed_ema = run()
    assert resumed.global_step == 15
    for k, v in whole.get_weights().items():
        assert torch.equal(resumed.get_weights()[k], v), k
        assert torch.equal(resumed_ema.training_weights[k], whole_ema.training_weights[k]), k


def test_ema_resumes_bitwise_from_an_async_backup(tmp_path):
    """With async_save the backup's copy of the average is taken when the save is asked
    for: the next steps' updates do not reach the file."""

    def run(crash_at=None):
        m, ema = model(net(), "adamw"), EMA(decay=DECAY)
        m.fit(X, Y, batch_size=BATCH, epochs=3, seed=1, verbose=0,
              callbacks=[Backup(str(tmp_path / "b"), crash_at, async_save=True), ema])
        return m

    whole = run()
    with pytest.raises(KeyboardInterrupt):
        run(crash_at=8)
    resumed = run()
    for k, v in whole.get_weights().items():
        assert torch.equal(resumed.get_weights()[k], v), k


def test_evaluate_predict_save_and_export_use_the_average(tmp_path):
    module = net()
    m = model(module)
    m.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, callbacks=[EMA(decay=DECAY)],
          verbose=0)
    averaged, _ = reference(module, 2)
    want = averaged.module.eval()(X).detach()
    torch.testing.assert_close(m.predict(X, batch_size=40), want, rtol=0, atol=0)
    loss = torch.nn.functional.cross_entropy(want, Y).item()
    assert m.evaluate(X, Y, batch_size=40, verbose=0)["loss"] == pytest.approx(loss, abs=1e-6)
    m.save_weights(tmp_path / "w.bin")
    other = model(net())
    other.load_weights(tmp_path / "w.bin")
    assert_params(other.get_weights(), averaged, exact=True)
    m.export(tmp_path / "p.pt2", X[:2])
    torch.testing.assert_close(fitdp.load_predictor(tmp_path / "p.pt2")(X), want)


@pytest.mark.parametrize("decay, error", [(1.5, ValueError), (-0.1, ValueError),
                                          ("0.9", TypeError), (True, TypeError),
                                          (float("nan"), ValueError)])
def test_bad_decay_names_it(decay, error):
    with pytest.raises(error, match=r"EMA\(decay=\.\.\.\): got .*expected a finite number "
                                    r">= 0 and <= 1"):
        EMA(decay=decay)


@pytest.mark.parametrize("every, error", [(0, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_bad_update_every_n_steps_names_it(every, error):
    with pytest.raises(error, match=r"EMA\(update_every_n_steps=\.\.\.\): got "):
        EMA(update_every_n_steps=every)


def test_two_averaging_callbacks_are_refused_before_training():
    m = model(net())
    before = m.get_weights()
    with pytest.raises(ValueError, match=r"callbacks: got 2 weight-averaging callbacks "
                                         r"\(EMA, SWA\).*keep one"):
        m.fit(X, Y, callbacks=[EMA(), SWA(swa_lr=0.05)], verbose=0)
    assert all(torch.equal(v, m.get_weights()[k]) for k, v in before.items())


def test_ema_weights_without_an_averaging_fit_says_how():
    m = model(net())
    with pytest.raises(RuntimeError, match=r"ema_weights: .*no EMA or SWA"):
        m.ema_weights()
    m.fit(X, Y, callbacks=[EMA()], verbose=0)
    m.fit(X, Y, verbose=0)  # the latest fit had none: its weights are not averaged
    with pytest.raises(RuntimeError, match="ema_weights"):
        m.ema_weights()


def test_ema_batches_helper_matches_fit_order():
    """The hand loop's batches are fit's with shuffle=False (the premise of the tests)."""
    assert len(batches()) == 5 and torch.equal(batches()[1][0], X[8:16])
