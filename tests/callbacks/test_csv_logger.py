"""CSVLogger: one row per epoch, late keys widen the file, append, main process only."""

from __future__ import annotations

import csv
import os

import pytest
from callback_helpers import attach

from fitdp.callbacks import CSVLogger


def _read(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_logger_columns_late_keys_and_append(tmp_path):
    path = tmp_path / "logs" / "train.csv"
    logger = CSVLogger(path)
    attach(logger)
    logger.on_train_begin({})
    logger.on_epoch_end(0, {"loss": 1.0, "acc": 0.5})
    assert _read(path) == [["epoch", "acc", "loss"], ["0", "0.5", "1.0"]]  # flushed already
    logger.on_epoch_end(1, {"loss": 0.5, "acc": 0.6, "val_loss": 0.7})
    logger.on_train_end({})
    assert _read(path) == [["epoch", "acc", "loss", "val_loss"], ["0", "0.5", "1.0", "NA"],
                           ["1", "0.6", "0.5", "0.7"]]
    again = CSVLogger(path, append=True)
    attach(again)
    again.on_train_begin({})
    again.on_epoch_end(2, {"loss": 0.25, "acc": 0.7, "val_loss": 0.5})
    again.on_train_end({})
    rows = _read(path)
    assert len(rows) == 4 and rows[0][0] == "epoch" and rows[3] == ["2", "0.7", "0.25", "0.5"]
    fresh = CSVLogger(path, separator=";")
    attach(fresh)
    fresh.on_train_begin({})
    fresh.on_epoch_end(0, {"loss": 1.0})
    fresh.on_train_end({})
    assert path.read_text().splitlines() == ["epoch;loss", "0;1.0"]


def test_csv_logger_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"separator=...\): got ', '"):
        CSVLogger(tmp_path / "x.csv", separator=", ")
    with pytest.raises(TypeError, match="separator"):
        CSVLogger(tmp_path / "x.csv", separator=1)
    with pytest.raises(ValueError, match=r"filename=...\).*a file, not a folder"):
        CSVLogger(tmp_path)
    with pytest.raises(TypeError, match=r"filename=...\): got 3"):
        CSVLogger(3)


def test_csv_logger_writes_nothing_off_main_process(tmp_path):
    logger = CSVLogger(tmp_path / "train.csv")
    attach(logger).is_main_process = False
    logger.on_train_begin({})
    logger.on_epoch_end(0, {"loss": 1.0})
    logger.on_train_end({})
    assert not os.listdir(tmp_path)
