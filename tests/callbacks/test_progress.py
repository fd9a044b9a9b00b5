"""ProgressBar (bar and line mode, 80 columns, short names, resume line) and Speedometer."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest
from callback_helpers import FakeModel, attach

from fitdp.callbacks import Callback, ProgressBar, Speedometer
from fitdp.callbacks._log_format import display_names, format_value, short_name, wrap

LONG_LOGS = {"loss": 0.123456, "multiclass_accuracy": 0.961234, "multiclass_f1_score": 0.95,
             "mean_squared_error": 1.5e-5, "my_custom_metric": 12345.678, "lr": 0.001,
             "val_loss": 0.234567, "val_multiclass_accuracy": 0.94, "val_multiclass_f1_score": 0.9,
             "val_mean_squared_error": 2.5e-5, "val_my_custom_metric": 23456.7}


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def terminal(monkeypatch: pytest.MonkeyPatch) -> Tty:
    """An 80-column terminal as stdout, and a tqdm clock at 20 steps/s (a real step's pace:
    the rate tqdm prints then has its usual width). Called in the test itself: pytest puts
    its own stdout back after fixtures run."""
    monkeypatch.setenv("COLUMNS", "80")
    out = Tty()
    monkeypatch.setattr(sys, "stdout", out)
    clock = iter(range(10**6))
    monkeypatch.setattr("tqdm.std.time", lambda: next(clock) * 0.05)
    return out


def _drive(cb: Callback, model: FakeModel, epochs: int = 3, steps: int = 4,
           logs: dict[str, float] | None = None) -> None:
    logs = logs or {"loss": 0.5, "multiclass_accuracy": 0.9612}
    train = {k: v for k, v in logs.items() if not k.startswith("val_")}
    cb.on_train_begin({})
    for epoch in range(epochs):
        cb.on_epoch_begin(epoch, {})
        for batch in range(steps):
            cb.on_train_batch_begin(batch, {})
            cb.on_train_batch_end(batch, train)
        cb.on_test_begin({})
        cb.on_test_batch_end(0, {"loss": 0.7})
        cb.on_test_end({"loss": 0.7})
        cb.on_epoch_end(epoch, {**logs, "val_loss": logs.get("val_loss", 0.7)})
    cb.on_train_end({})


def test_progress_bar_prints_one_line_per_epoch_when_not_a_tty(capsys):
    bar = ProgressBar()
    _drive(bar, attach(bar, epochs=3))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    pattern = r"Epoch {}/3 - \d+s - [\d.]+ steps/s - loss: 0\.5 - acc: 0\.9612 - val_loss: 0\.7"
    for i, line in enumerate(lines):
        assert re.fullmatch(pattern.format(i + 1), line), line


def test_line_mode_wraps_at_80_columns_between_items(capsys, monkeypatch):
    """Regression: with several long metric names the epoch line ran past 80 columns."""
    monkeypatch.setenv("COLUMNS", "80")
    bar = ProgressBar(verbose=2)
    _drive(bar, attach(bar, epochs=1), epochs=1, logs=LONG_LOGS)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("Epoch 1/1 - ") and all(x.startswith("    ") for x in lines[1:])
    text = " - ".join(line.strip() for line in lines)
    for item in ("loss: 0.1235", "acc: 0.9612", "f1: 0.95", "mse: 1.5e-05", "mcm: 1.235e+04",
                 "lr: 0.001", "val_loss: 0.2346", "val_acc: 0.94", "val_mcm: 2.346e+04"):
        assert f" - {item}" in f" - {text}", item


def test_bar_stays_within_80_columns_and_shows_every_value(monkeypatch):
    """A terminal of 80 columns (tqdm ncols=80): no rendered line is wider; what does not fit
    beside the bar at epoch end follows on indented lines."""
    out = terminal(monkeypatch)
    monkeypatch.setattr("fitdp.callbacks.progress._POSTFIX_EVERY", 0.0)  # every batch
    bar = ProgressBar()
    _drive(bar, attach(bar, epochs=2), epochs=2, logs=LONG_LOGS)
    rendered = [r for r in re.split(r"[\r\n]", out.getvalue()) if r.strip()]
    assert all(len(r) <= 80 for r in rendered), max(rendered, key=len)
    finals = out.getvalue().split("\n")  # what stays on screen: the last render of each line
    bar_lines = [line.split("\r")[-1] for line in finals if "Epoch" in line]
    assert [b.split(":")[0] for b in bar_lines] == ["Epoch 1/2", "Epoch 2/2"]
    assert "4/4" in bar_lines[0] and "loss: 0.1235" in bar_lines[0]
    continued = [line for line in finals if line and "Epoch" not in line]
    assert continued and all(line.startswith("  ") for line in continued)
    assert "val_mcm: 2.346e+04" in out.getvalue() and "val_acc: 0.94" in out.getvalue()


def test_bar_with_few_metrics_is_one_line_per_epoch(monkeypatch):
    out = terminal(monkeypatch)
    bar = ProgressBar()
    _drive(bar, attach(bar, epochs=2), epochs=2)
    lines = [line for line in out.getvalue().split("\n") if line]
    assert len(lines) == 2
    assert lines[1].split("\r")[-1].rstrip() == (
        "Epoch 2/2: 4/4 [00:00, 11.43step/s, loss: 0.5 - acc: 0.9612 - val_loss: 0.7]")


def test_short_names_are_deterministic_and_never_clash():
    assert [short_name(k) for k in ("multiclass_accuracy", "binary_accuracy", "val_accuracy",
                                    "multilabel_f1_score", "mean_absolute_error", "loss", "lr",
                                    "val_my_custom_metric", "averylongsinglewordmetric",
                                    "multiclass_")] == [
        "acc", "acc", "val_acc", "f1", "mae", "loss", "lr", "val_mcm", "averylongsin",
        "multiclass_"]
    # Two keys that would share a short name keep their full names; the others shorten.
    names = display_names(("loss", "multiclass_accuracy", "binary_accuracy", "val_recall"))
    assert names == {"loss": "loss", "multiclass_accuracy": "multiclass_accuracy",
                     "binary_accuracy": "binary_accuracy", "val_recall": "val_rec"}
    assert display_names(("acc", "accuracy")) == {"acc": "acc", "accuracy": "accuracy"}


def test_one_number_format():
    assert [format_value(v) for v in (0.5, 0.961234, 12.3456, 0.001, 1.5e-5, 123456.0, 0.0)] \
        == ["0.5", "0.9612", "12.35", "0.001", "1.5e-05", "1.235e+05", "0"]


def test_wrap_breaks_between_items_only():
    assert wrap(["aaaa", "bbbb", "cccc"], 11) == ["aaaa - bbbb", "    cccc"]
    assert wrap(["x" * 20, "y"], 10) == ["x" * 20, "    y"]  # an item longer than a line


@pytest.mark.parametrize("tty", [False, True])
def test_resumed_run_says_so_at_train_begin(monkeypatch, tty):
    out = Tty() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    bar = ProgressBar()
    attach(bar, resumed={"path": "runs/c-007.ckpt", "epoch": 1, "step": 7})
    bar.on_train_begin({})
    assert out.getvalue() == "resumed from runs/c-007.ckpt at epoch 2, step 7\n"


def test_resumed_line_silent_when_quiet_or_not_main(capsys):
    resumed = {"path": "c.ckpt", "epoch": 0, "step": 3}
    quiet = ProgressBar(verbose=0)
    attach(quiet, resumed=resumed)
    other = ProgressBar()
    attach(other, resumed=resumed).is_main_process = False
    fresh = ProgressBar()
    attach(fresh)
    for bar in (quiet, other, fresh):
        bar.on_train_begin({})
    assert capsys.readouterr().out == ""


def test_progress_bar_silent_off_main_process_and_verbose_0(capsys):
    quiet = ProgressBar(verbose=0)
    _drive(quiet, attach(quiet))
    other_rank = ProgressBar()
    model = attach(other_rank)
    model.is_main_process = False
    _drive(other_rank, model)
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match=r"ProgressBar\(verbose=...\): got 3; expected one of"):
        ProgressBar(verbose=3)
    with pytest.raises(ValueError, match="verbose"):
        ProgressBar(verbose=True)


def test_standalone_evaluate_prints_one_line(capsys):
    bar = ProgressBar()
    attach(bar)
    bar.on_test_begin({})
    bar.on_test_batch_end(0, {"loss": 0.25})
    bar.on_test_end({"loss": 0.25, "multiclass_accuracy": 0.5})
    assert re.fullmatch(r"Evaluate - \d+s - [\d.]+ steps/s - loss: 0\.25 - acc: 0\.5\n",
                        capsys.readouterr().out)


def test_speedometer_logs_every_frequent_batches(caplog):
    """MXNet's Speedometer: a report every `frequent` batches, full key names, `%f` values."""
    speed = Speedometer(batch_size=4, frequent=2)
    model = attach(speed)
    with caplog.at_level(logging.INFO, logger="fitdp"):
        _drive(speed, model, epochs=1, steps=5)
    msgs = [r.getMessage() for r in caplog.records if r.name == "fitdp"]
    assert len(msgs) == 2
    assert re.fullmatch(r"Epoch\[0\] Batch \[0-2\]\tSpeed: [\d.]+ samples/sec\tloss=0\.500000"
                        r"\tmulticlass_accuracy=0\.961200", msgs[0])
    assert msgs[1].startswith("Epoch[0] Batch [2-4]\tSpeed: ")
    caplog.clear()
    model.is_main_process = False
    with caplog.at_level(logging.INFO, logger="fitdp"):
        _drive(speed, model, epochs=1, steps=5)
    assert not caplog.records
    with pytest.raises(ValueError, match=r"Speedometer\(frequent=...\): got 0"):
        Speedometer(32, frequent=0)
    with pytest.raises(TypeError, match="batch_size"):
        Speedometer(32.0)
