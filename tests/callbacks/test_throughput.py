"""Throughput per epoch (Lightning's ThroughputMonitor, torchtitan's tokens per second):
``History.throughput`` and the progress bar, with History's own keys left as Keras's."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import History


@pytest.fixture
def one_second_epochs(monkeypatch):
    """A clock that moves one second per reading: an epoch (start, end) lasts 1 s, so a
    rate reads as the count itself."""
    clock = itertools.count()
    monkeypatch.setattr("fitdp.call.throughput.perf_counter", lambda: float(next(clock)))


def mlp() -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)))
    model.compile("sgd", "cross_entropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_samples_per_sec_counts_every_trained_sample_and_no_validation(one_second_epochs,
                                                                        devices):
    x, y = torch.randn(125, 5), torch.randint(0, 3, (125,))
    h = mlp().fit(x, y, batch_size=32, epochs=2, validation_split=0.2, verbose=0,
                  devices=devices)
    assert h.throughput == {"samples_per_sec": [100.0, 100.0]}  # 100 train samples, 1 s
    # History's own keys stay those of the epoch logs (Keras's), throughput apart
    assert set(h.history) == {"loss", "accuracy", "val_loss", "val_accuracy", "lr"}


def test_steps_per_epoch_counts_the_batches_run(one_second_epochs):
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    h = mlp().fit(x, y, batch_size=16, epochs=1, steps_per_epoch=4, verbose=0)
    assert h.throughput["samples_per_sec"] == [16 + 16 + 8 + 16]  # into the next pass


def test_tokens_per_sec_of_a_bucket_iterator_leaves_padding_out(one_second_epochs):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 9, (30,), generator=g).tolist()
    seqs = [torch.randint(1, 10, (n,), generator=g) for n in lengths]
    it = fitdp.BucketIterator(seqs, torch.randint(0, 3, (30,), generator=g), batch_size=4,
                              buckets=[8], seed=1)
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(32, 3)))
    model.compile("sgd", "cross_entropy")
    h = model.fit(it, epochs=2, verbose=0)
    assert h.throughput == {"samples_per_sec": [30.0, 30.0],
                            "tokens_per_sec": [float(sum(lengths))] * 2}
    assert model.throughput == {"samples_per_sec": 30.0, "tokens_per_sec": sum(lengths)}


def test_epoch_logs_hold_no_throughput():
    """Callbacks that compare the epoch logs with Keras's keys see the same keys."""
    seen = []
    cb = fitdp.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(set(logs)))
    mlp().fit(torch.randn(16, 5), torch.randint(0, 3, (16,)), callbacks=[cb], verbose=0)
    assert seen == [{"loss", "accuracy", "lr"}]


def test_progress_line_shows_samples_per_sec(one_second_epochs, capsys):
    mlp().fit(torch.randn(64, 5), torch.randint(0, 3, (64,)), batch_size=16, epochs=1,
              verbose=2)
    line = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(r"Epoch 1/1 - \d+s - [\d.]+ steps/s - 64 samples/s - loss: \S+ - "
                        r"acc: \S+", line), line


def test_history_state_keeps_throughput_for_a_resume():
    h = History()
    h.on_train_begin()
    h.throughput = {"samples_per_sec": [10.0]}
    again = History()
    again.on_train_begin()
    again.load_state_dict(h.state_dict())
    assert again.throughput == {"samples_per_sec": [10.0]}
    again.load_state_dict({"history": {}, "epoch": []})  # a checkpoint from before it
    assert again.throughput == {}
