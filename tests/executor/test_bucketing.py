"""Bucketed executors: groups and buffers reused, parameters shared, the seed's warning,
equivalence with a single-device loop, predict order, monitors, compile per bucket, errors."""

from __future__ import annotations

import copy
import functools
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fitdp
from fitdp.callbacks import LambdaCallback
from fitdp.data.batch import DataBatch, DataDesc
from fitdp.executor import DataParallelExecutorManager

CPU2 = ["cpu", "cpu"]
VOCAB = 64
ROOT = Path(__file__).resolve().parents[2]


class PoolNet(nn.Module):
    """Embedding -> tanh(Linear) -> mean over time -> head (no GRU: dynamo can trace it)."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, classes)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(x))).mean(1)) * self.scale


class GRUNet(nn.Module):
    """Embedding + GRU, classifying from the last valid step (``include_lengths=True``)."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(x))
        return self.head(h[torch.arange(len(x)), lengths - 1])


class PosNet(PoolNet):
    """A positional table sized by the bucket: cannot be shared between buckets."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(length, 8))


class ExtraNet(PoolNet):
    """A parameter the default bucket's module does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.zeros(2))


class TiedNet(nn.Module):
    """Output projection tied to the embedding (one tensor, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x).mean(1))


def sequences(lengths: list[int], seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Token ids in [1, VOCAB) (0 is padding) and labels in [0, 3)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    return seqs, torch.randint(0, 3, (len(lengths),), generator=g)


def batch(rows: int, length: int, seed: int = 0) -> DataBatch:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (rows, length), generator=g)
    return DataBatch(x, torch.randint(0, 3, (rows,), generator=g), bucket_key=length)


def bucketed_manager(default_key: int, rows: int) -> DataParallelExecutorManager:
    torch.manual_seed(0)
    mgr = DataParallelExecutorManager(PoolNet(), CPU2, bucket_module=lambda key: PoolNet(),
                                      default_bucket_key=default_key, loss=F.cross_entropy)
    mgr.reserve([DataDesc("data", (rows, default_key), torch.int64),
                 DataDesc("label", (rows,), torch.int64)])
    return mgr


def step(mgr: DataParallelExecutorManager, b: DataBatch) -> None:
    mgr.load_data_batch(b)
    mgr.forward(is_train=True)
    mgr.backward()


# -- groups, buffers and parameters ------------------------------------------------------------


def test_seen_bucket_key_reuses_its_group_and_the_shared_input_buffers():
    mgr = bucketed_manager(default_key=16, rows=8)
    buffers = [{name: buf for name, (buf, _) in dev.items()} for dev in mgr.shared_buffers]
    step(mgr, batch(8, 8))
    groups = dict(mgr.groups)
    assert list(groups) == [16, 8]
    for b in (batch(8, 8, seed=1), batch(6, 8, seed=2), batch(8, 16, seed=3)):
        step(mgr, b)
        assert mgr.groups == groups and all(mgr.groups[k] is g for k, g in groups.items())
        for d, dev in enumerate(mgr.shared_buffers):
            assert {n: buf for n, (buf, _) in dev.items()}.keys() == buffers[d].keys()
            assert all(dev[n][0] is buffers[d][n] for n in buffers[d])
            ex = mgr.curr_execgrp.executors[d]
            # The bucket's input is a view of the one buffer, not a copy.
            assert ex.inputs.untyped_storage().data_ptr() == buffers[d]["data"].data_ptr()


def test_every_bucket_uses_the_default_buckets_parameter_and_buffer_objects():
    mgr = bucketed_manager(default_key=16, rows=8)
    for length in (4, 8):
        step(mgr, batch(8, length))
    assert len(mgr.groups) == 3
    for group in mgr.groups.values():
        for d, ex in enumerate(group.executors):
            params = dict(ex.module.named_parameters())
            for name, row in zip(mgr.param_names, mgr.param_arrays):
                assert params[name] is row[d], (group.bucket_key, d, name)
            buffers = dict(ex.module.named_buffers())
            for name, row in zip(mgr.aux_names, mgr.aux_arrays):
                assert buffers[name] is row[d], (group.bucket_key, d, name)


def test_tied_weight_is_shared_under_both_names():
    # Regression: share_by_name skipped the second name of a tied weight (out.weight kept the
    # bucket module's own fresh tensor, so that bucket trained a copy nobody updated).
    mgr = DataParallelExecutorManager(TiedNet(), CPU2, bucket_module=lambda key: TiedNet(),
                                      default_bucket_key=16, loss=F.cross_entropy)
    step(mgr, DataBatch(torch.randint(1, VOCAB, (4, 8)), torch.zeros(4, dtype=torch.long), 8))
    for d, ex in enumerate(mgr.groups[8].executors):
        shared = mgr.groups[16].executors[d].module.emb.weight
        assert ex.module.emb.weight is shared and ex.module.out.weight is shared


# -- the seed's re-allocation warning ----------------------------------------------------------


def bucket_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("bucketing:")]


def test_warning_once_when_a_bucket_outgrows_the_default_bucket(caplog):
    mgr = bucketed_manager(default_key=4, rows=8)
    with caplog.at_level(logging.WARNING, logger="fitdp"):
        step(mgr, batch(8, 4))
        assert bucket_warnings(caplog) == []
        step(mgr, batch(8, 8))  # larger than allocated, on both devices: one warning
        [msg] = bucket_warnings(caplog)
        assert '"data"' in msg and "(4, 8)" in msg and "(4, 4)" in msg
        assert "default_bucket_key" in msg
        for b in (batch(8, 8, seed=1), batch(8, 4), batch(3, 8)):  # all fit now
            step(mgr, b)
        assert len(bucket_warnings(caplog)) == 1


def test_no_warning_when_the_default_bucket_is_the_largest(caplog):
    # Regression: a second fit with a larger batch grew the buffers through reserve(), and
    # the default bucket's next batch logged the warning for that.
    seqs, labels = sequences([3, 4, 7, 9, 12, 15, 16, 2] * 3)
    model = fitdp.Model(PoolNet(), bucket_module=lambda key: PoolNet())
    model.compile(optimizer="sgd", loss="cross_entropy")
    with caplog.at_level(logging.WARNING, logger="fitdp"):
        for batch_size in (2, 4):
            it = fitdp.BucketIterator(seqs, labels, batch_size, buckets=[4, 8, 16], seed=0)
            model.fit(it, epochs=2, devices=CPU2, verbose=0)
    assert bucket_warnings(caplog) == []
    assert sorted(model._replicas.manager.groups) == [4, 8, 16]


# -- training equals a single-device loop; every sample once; predict order ---------------------


def test_bucketed_fit_matches_single_device_loop_over_the_same_batches():
    # 13 + 12 + 12 samples in buckets 5, 10, 20 with batch 6: tails of 1 row (fewer rows than
    # devices), shuffled batches, uneven slices, two epochs.
    lengths = [2, 3, 4, 5, 5, 1, 2, 3, 4, 5, 3, 2, 1] + [6, 7, 8, 9, 10] * 2 + [7, 8]
    lengths += [11, 15, 20, 19, 12, 14, 16, 18, 20, 13, 17, 11]
    seqs, labels = sequences(lengths, seed=1)
    torch.manual_seed(0)
    net = GRUNet()
    ref = copy.deepcopy(net)

    def make_iter() -> fitdp.BucketIterator:
        return fitdp.BucketIterator(seqs, labels, batch_size=6, buckets=[5, 10, 20], seed=7,
                                    include_lengths=True)

    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    replay = make_iter()
    for epoch in range(2):
        replay.set_epoch(epoch)
        for b in replay:
            opt.zero_grad()
            F.cross_entropy(ref(*b.data), b.label).backward()
            opt.step()

    model = fitdp.Model(net, bucket_module=lambda key: GRUNet())
    model.compile(optimizer=lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
                  loss="cross_entropy")
    model.fit(make_iter(), epochs=2, devices=CPU2, verbose=0)
    assert sorted(model._replicas.manager.groups) == [5, 10, 20]
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_fit_trains_every_sample_once_per_epoch():
    seen: list[torch.Tensor] = []

    class Recorder(PoolNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x[:, 0] - 1)  # the first token is the sample id + 1
            return super().forward(x)

    lengths = [1 + (7 * i) % 19 for i in range(41)]
    seqs = [torch.cat([torch.tensor([i + 1]), s[1:]]) for i, s in enumerate(sequences(lengths)[0])]
    it = fitdp.BucketIterator(seqs, torch.zeros(41, dtype=torch.long), batch_size=5, seed=3)
    epochs: list[list[int]] = []
    model = fitdp.Model(Recorder(), bucket_module=lambda key: Recorder())
    model.compile(optimizer="sgd", loss="cross_entropy")
    cb = LambdaCallback(on_epoch_end=lambda epoch, logs: (
        epochs.append(sorted(torch.cat(seen).tolist())), seen.clear()))
    model.fit(it, epochs=2, devices=CPU2, callbacks=[cb], verbose=0)
    assert epochs == [list(range(41))] * 2


@pytest.mark.parametrize("bucketed", [True, False])
def test_predict_returns_rows_in_sample_order(bucketed):
    lengths = [1 + (5 * i) % 13 for i in range(23)]
    seqs, _ = sequences(lengths, seed=2)
    torch.manual_seed(0)
    net = GRUNet()
    model = fitdp.Model(net, bucket_module=(lambda key: GRUNet()) if bucketed else None)
    it = fitdp.BucketIterator(seqs, None, batch_size=4, buckets=[4, 8, 13], seed=5,
                              include_lengths=True)
    preds = model.predict(it, devices=CPU2)
    with torch.no_grad():
        expected = torch.cat([net(s[None], torch.tensor([len(s)])) for s in seqs])
    torch.testing.assert_close(preds, expected, rtol=1e-5, atol=1e-6)


# -- monitors ------------------------------------------------------------------------------------


def test_monitor_names_every_bucket_and_every_device():
    seqs, labels = sequences([3, 4, 7, 8, 12, 16] * 4)
    it = fitdp.BucketIterator(seqs, labels, batch_size=4, buckets=[4, 8, 16], seed=0)
    model = fitdp.Model(PoolNet(), bucket_module=lambda key: PoolNet())
    model.compile(optimizer="sgd", loss="cross_entropy")
    reported: list = []
    monitor = fitdp.Monitor(1, pattern="head", verbose=False, on_rows=reported.extend)
    model.fit(it, devices=CPU2, monitor=monitor, verbose=0)
    names = {row.name for row in reported}
    outputs = {f"b{k}/d{d}/head_output" for k in (4, 8, 16) for d in (0, 1)}
    assert outputs <= names
    assert {"head.weight", "head.weight_grad", "head.bias", "head.bias_grad"} <= names


# -- compile=True: one graph per bucket shape, none twice -----------------------------------------


@pytest.mark.parametrize("bucketed", [True, False])
def test_compile_one_graph_per_shape_and_no_recompilation(bucketed, monkeypatch):
    # Without bucket_module one replica meets all 9 shapes: above dynamo's default limit of 8,
    # past which it used to run the 9th eagerly. With it, 9 groups x 2 devices.
    graphs: list[tuple[int, ...]] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(next(tuple(t.shape) for t in example_inputs if t.dtype == torch.int64))
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    buckets = list(range(2, 20, 2))
    seqs, labels = sequences([n for n in buckets for _ in range(4)])
    it = fitdp.BucketIterator(seqs, labels, batch_size=4, buckets=buckets, seed=0)
    model = fitdp.Model(PoolNet(), bucket_module=(lambda key: PoolNet()) if bucketed else None)
    model.compile(optimizer="sgd", loss="cross_entropy", compile=True)
    model.fit(it, epochs=1, devices=CPU2, verbose=0)
    assert sorted(graphs) == sorted((2, n) for n in buckets for _ in range(2))  # per device
    model.fit(it, epochs=2, devices=CPU2, verbose=0)
    assert len(graphs) == 2 * len(buckets)  # shapes seen before: no recompilation
    torch._dynamo.reset()


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda key: PosNet(key), r"bucket_module\(8\).*'pos'.*\(8, 8\).*\(16, 8\)"),
    (lambda key: ExtraNet(), r"bucket_module\(8\).*'extra'.*does not have"),
    (lambda key: "not a module", r"bucket_module\(8\) returned str"),
])
def test_bucket_module_that_cannot_share_is_rejected(make, match):
    seqs, labels = sequences([3, 7, 8, 12, 16, 15])
    it = fitdp.BucketIterator(seqs, labels, batch_size=2, buckets=[8, 16], shuffle=False)
    model = fitdp.Model(PosNet(16) if "pos" in match else PoolNet(), bucket_module=make)
    model.compile(optimizer="sgd", loss="cross_entropy")
    before = copy.deepcopy(model.module.state_dict())
    with pytest.raises((ValueError, TypeError), match=match):
        model.fit(it, devices=CPU2, verbose=0)
    for k, v in model.module.state_dict().items():  # bucket 8 comes first: no step was taken
        assert torch.equal(v, before[k]), k


def test_unhashable_bucket_key_is_a_type_error():
    batches = [DataBatch(torch.randint(1, VOCAB, (4, 5)), torch.zeros(4, dtype=torch.long),
                         bucket_key=[5])]
    model = fitdp.Model(PoolNet(), bucket_module=lambda key: PoolNet())
    model.compile(optimizer="sgd", loss="cross_entropy")
    with pytest.raises(TypeError, match=r"bucket_key: got \[5\].*not hashable"):
        model.fit(batches, devices=CPU2, verbose=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sequences=[[1, 2], []]), r"sequences\[1\].*empty sequence"),
    (dict(labels=[0, 1, 2]), r"labels: received 3 labels for 2 sequences"),
    (dict(buckets=[2]), r"sequences\[1\] has length 3, longer than the largest bucket 2"),
])
def test_bucket_iterator_rejects_bad_sequences(kwargs, match):
    args = {"sequences": [[1, 2], [3, 4, 5]], "labels": [0, 1], "batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        fitdp.BucketIterator(**args)


# -- the example ---------------------------------------------------------------------------------


def test_example_runs_fast():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "bucketing.py"), "--fast"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "accuracy" in proc.stdout and "padding" in proc.stdout


def test_batches_without_bucket_key_run_the_default_bucket():
    # Regression: validation tensors (bucket_key None) next to a bucketed training set called
    # bucket_module(None) instead of running the default bucket's module.
    def make(key: int) -> PoolNet:
        if not isinstance(key, int):
            raise AssertionError(f"bucket_module called with {key!r}")
        return PoolNet()

    seqs, labels = sequences([3, 7, 12, 16] * 3)
    it = fitdp.BucketIterator(seqs, labels, batch_size=4, buckets=[8, 16], seed=0)
    model = fitdp.Model(PoolNet(), bucket_module=make)
    model.compile(optimizer="sgd", loss="cross_entropy")
    val = (torch.randint(1, VOCAB, (6, 16)), torch.randint(0, 3, (6,)))
    history = model.fit(it, validation_data=val, devices=CPU2, verbose=0)
    assert "val_loss" in history.history


def test_inputs_already_on_the_device_are_staged_without_a_copy_unless_buckets_share_buffers():
    """A tensor or a dict of tensors (a Hugging Face batch) already on the replica's device
    is run as it is; with buckets, every input goes through the buffers the buckets share
    (MXNet's shared memory), so a later, larger bucket reuses them."""
    from fitdp.executor.replica import Executor

    cpu = torch.device("cpu")
    batch = {"ids": torch.arange(6).view(3, 2), "mask": torch.ones(3, 2)}
    for tree in (batch["mask"], batch):
        plain = Executor(nn.Identity(), cpu, {})
        plain.load(tree, None, valid=3)
        assert plain.inputs is tree and plain.shared_buffers == {}
        shared: dict = {}
        bucketed = Executor(nn.Identity(), cpu, shared, warn_on_grow=True)
        bucketed.load(tree, None, valid=3)
        assert bucketed.inputs is not tree and shared
        staged = [bucketed.inputs] if isinstance(tree, torch.Tensor) else list(
            bucketed.inputs.values())
        originals = [tree] if isinstance(tree, torch.Tensor) else list(tree.values())
        for got, want in zip(staged, originals):
            torch.testing.assert_close(got, want)
            assert got.data_ptr() != want.data_ptr()
