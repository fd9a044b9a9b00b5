"""BucketIterator: grouping, padding, per-token labels, the data-source interface (epochs, exact
resume), automatic buckets (the cost-model DP), errors."""

from __future__ import annotations

import copy
import doctest

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

import fitdp
import fitdp.data.bucketing
import fitdp.data.length_groups
from fitdp.data.batch import DataBatch, DataDesc
from fitdp.data.bucketing import BucketIterator
from fitdp.data.length_groups import choose_buckets
from fitdp.data.sources.protocol import DataSource, SourcePlan


def make_sequences(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Token ids in [1, 1000): never 0, so padding is distinguishable from data."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (n,), generator=g) for n in lengths]


def order(it: BucketIterator) -> list[list[int]]:
    return [b.index.tolist() for b in it]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[int], int, list[int] | None, bool, int]:
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=60))
    batch_size = draw(st.integers(1, 12))
    buckets = None
    if draw(st.booleans()):
        extra = draw(st.lists(st.integers(1, 60), max_size=5))
        buckets = sorted(set(extra) | {max(lengths) + draw(st.integers(0, 3))})
    return lengths, batch_size, buckets, draw(st.booleans()), draw(st.integers(0, 2**31))


@settings(max_examples=60, deadline=None, database=None)  # database=None: no .hypothesis/ in repo
@given(workloads())
def test_every_sample_exactly_once_per_epoch(workload):
    # Pins: an empty bucket (given buckets=[1, 2], all lengths 1) yielded one empty batch.
    lengths, batch_size, buckets, shuffle, seed = workload
    it = BucketIterator(make_sequences(lengths), None, batch_size, buckets, shuffle=shuffle,
                        seed=seed)
    assert it.num_samples == len(lengths) and it.num_tokens == sum(lengths)
    for epoch in range(2):
        it.set_epoch(epoch)
        batches = list(it)
        assert len(batches) == len(it)
        seen = sorted(i for b in batches for i in b.index.tolist())
        assert seen == list(range(len(lengths)))
        per_bucket: dict[int, list[int]] = {}
        for b in batches:
            assert b.pad == 0 and b.label is None and 1 <= b.batch_size <= batch_size
            for i in b.index.tolist():  # the smallest bucket that fits the sample
                assert b.bucket_key == min(k for k in it.buckets if k >= lengths[i])
            per_bucket.setdefault(b.bucket_key, []).append(b.batch_size)
        for sizes in per_bucket.values():  # full batches, except at most one smaller one
            assert sum(s < batch_size for s in sizes) <= 1


def test_rows_are_the_sequences_followed_by_pad_value():
    lengths = [3, 7, 1, 8, 5, 2, 6, 4, 8, 3]
    seqs = make_sequences(lengths)
    labels = torch.arange(100, 110)
    it = BucketIterator(seqs, labels, 3, buckets=[4, 8], pad_value=-1, include_lengths=True,
                        seed=1)
    rows = 0
    for b in it:
        padded, lens = b.data
        assert padded.dtype == torch.int64 and lens.dtype == torch.int64
        assert padded.shape == (len(b.index), b.bucket_key)
        for row, n, i in zip(padded, lens.tolist(), b.index.tolist()):
            assert n == lengths[i]
            assert torch.equal(row[:n], seqs[i])
            assert (row[n:] == -1).all()
        assert torch.equal(b.label, labels[b.index])
        rows += len(b.index)
    assert rows == len(seqs)


def test_lists_numpy_and_float_sequences_keep_their_dtype():
    from_lists = BucketIterator([[1, 2, 3], [4]], [0, 1], 2, buckets=[4], shuffle=False)
    (b,) = list(from_lists)
    assert b.data.dtype == torch.int64
    assert b.data.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    floats = [np.array([0.5, 1.5], dtype=np.float32), np.array([2.5], dtype=np.float32)]
    (b,) = list(BucketIterator(floats, None, 2, pad_value=-0.5, shuffle=False))
    assert b.data.dtype == torch.float32
    assert b.data.tolist() == [[0.5, 1.5], [2.5, -0.5]]


def test_shuffle_changes_order_per_epoch_and_is_reproducible_from_seed():
    seqs = make_sequences([1 + i % 20 for i in range(200)])

    def epochs(seed: int | None) -> list[list[list[int]]]:
        it = BucketIterator(seqs, None, 8, buckets=[5, 10, 20], seed=seed)
        out = []
        for e in range(3):
            it.set_epoch(e)
            out.append(order(it))
        return out

    a = epochs(3)
    assert a[0] != a[1] != a[2]
    assert a == epochs(3)
    assert a != epochs(4)
    torch.manual_seed(11)  # seed=None draws from the global RNG at construction
    b = epochs(None)
    torch.manual_seed(11)
    assert b == epochs(None)


def test_no_shuffle_is_deterministic_in_bucket_then_index_order():
    lengths = [9, 2, 5, 3, 8, 1, 7, 4]
    it = BucketIterator(make_sequences(lengths), None, 2, buckets=[4, 9], shuffle=False)
    expected = [[1, 3], [5, 7], [0, 2], [4, 6]]
    assert order(it) == expected
    it.set_epoch(1)
    assert order(it) == expected
    again = BucketIterator(make_sequences(lengths), None, 2, buckets=[4, 9], shuffle=False)
    assert order(again) == expected


@pytest.mark.parametrize("consumed", [0, 1, 5, 11])
def test_state_dict_resume_mid_epoch_yields_exactly_the_remaining_batches(consumed):
    lengths = [1 + (7 * i) % 30 for i in range(90)]
    seqs = make_sequences(lengths)
    ref = BucketIterator(seqs, torch.arange(90), 4, buckets=[10, 20, 30], seed=5)
    ref.set_epoch(2)
    full = list(ref)
    assert len(full) == len(ref) == 24

    it = BucketIterator(seqs, torch.arange(90), 4, buckets=[10, 20, 30], seed=5)
    it.set_epoch(2)
    stream = iter(it)
    for _ in range(consumed):
        next(stream)
    state = it.state_dict()
    assert state == {"seed": 5, "epoch": 2, "position": consumed}
    assert all(type(v) is int for v in state.values())

    fresh = BucketIterator(seqs, torch.arange(90), 4, buckets=[10, 20, 30])  # seed from state
    fresh.load_state_dict(state)  # continuing mid-epoch is load_state_dict only
    rest = list(fresh)
    assert [b.index.tolist() for b in rest] == [b.index.tolist() for b in full[consumed:]]
    assert all(torch.equal(x.data, y.data) for x, y in zip(rest, full[consumed:]))
    assert fresh.state_dict()["position"] == len(fresh)

    # Pins: the epoch's order was cached by epoch only, so a loaded seed was ignored.
    other = BucketIterator(seqs, torch.arange(90), 4, buckets=[10, 20, 30], seed=99)
    other.set_epoch(2)
    list(other)
    other.load_state_dict(state)
    assert [b.index.tolist() for b in other] == [b.index.tolist() for b in full[consumed:]]

    other.load_state_dict(state)
    other.set_epoch(2)  # set_epoch after load_state_dict restarts the epoch
    assert order(other) == [b.index.tolist() for b in full]


def test_epoch_protocol_after_a_full_pass():
    it = BucketIterator(make_sequences([1 + i % 9 for i in range(40)]), None, 4, seed=0)
    it.set_epoch(0)
    first = order(it)
    it.set_epoch(0)  # a finished epoch asked for again is replayed from its start
    assert order(it) == first
    nxt = order(it)  # no set_epoch after a full pass: the next epoch, not an empty one
    assert it.state_dict()["epoch"] == 1 and nxt and nxt != first
    it.set_epoch(1)
    assert order(it) == nxt


def test_a_position_loaded_at_the_epochs_end_yields_nothing_more_of_it():
    """Regression: a position loaded at an epoch's end yielded the whole next epoch as the
    rest of the loaded one (as a finished pass does), so fit trained that epoch twice. The
    tensors and DataLoader sources yield nothing there; fit then calls set_epoch."""
    it = BucketIterator(make_sequences([1 + i % 9 for i in range(20)]), None, 4, seed=0)
    it.load_state_dict({"seed": 0, "epoch": 0, "position": len(it)})
    assert order(it) == [] and it.state_dict()["epoch"] == 0
    nxt = order(it)  # the empty rest ran out: a plain loop goes on to the next epoch
    it.set_epoch(1)
    assert it.state_dict()["epoch"] == 1 and order(it) == nxt


def test_set_epoch_restarts_a_partly_consumed_epoch():
    # Regression (issue 9): a fit after an exception trained 6 of 9 batches (position kept).
    it = BucketIterator(make_sequences([1 + i % 9 for i in range(36)]), None, 4,
                        buckets=[3, 6, 9], seed=0)
    assert len(it) == it.num_batches == 9
    full = order(it)
    it.set_epoch(0)
    stream = iter(it)
    for _ in range(3):  # the fit that raised
        next(stream)
    it.set_epoch(0)
    assert next(stream, None) is None  # set_epoch ended the abandoned iteration...
    assert order(it) == full  # ...and the epoch starts again at its first batch


def test_set_epoch_after_a_short_pass_yields_every_sample():
    # Regression (issue 9): predict(it) after fit(it, steps_per_epoch=2) gave 22 rows of 30.
    it = BucketIterator(make_sequences([1 + i % 10 for i in range(30)]), None, 4, buckets=[10],
                        seed=1)
    it.set_epoch(0)
    stream = iter(it)
    next(stream), next(stream)  # fit(it, steps_per_epoch=2)
    it.set_epoch(0)  # predict starts its source at the beginning
    assert sorted(i for b in it for i in b.index.tolist()) == list(range(30))


def test_provide_data_and_label_describe_a_full_default_bucket_batch():
    seqs = make_sequences([2, 3, 6, 6, 5, 1])
    it = BucketIterator(seqs, torch.zeros(6, 3), 2, buckets=[3, 6], include_lengths=True)
    full = next(b for b in it if b.bucket_key == 6 and b.batch_size == 2)
    assert it.provide_data == full.provide_data
    assert [d.name for d in it.provide_data] == ["data0", "data1"]
    assert it.provide_label == full.provide_label
    assert it.provide_label[0].shape == (2, 3)
    plain = BucketIterator(seqs, None, 2, buckets=[3, 6])
    assert [tuple(d) for d in plain.provide_data] == [("data", (2, 6), torch.int64, "NT")]
    assert plain.provide_label == []
    assert isinstance(full, DataBatch)


def test_implements_the_data_source_interface():
    seqs = make_sequences([2, 3, 6, 6, 5, 1])
    it = BucketIterator(seqs, [s % 3 for s in seqs], 2, buckets=[3, 4, 6], include_lengths=True)
    assert isinstance(it, DataSource) and it.num_batches == len(it) == 4
    assert it.plan() == SourcePlan(  # bucket 4 is empty: no executor group for it
        bucket_keys=(3, 6), default_bucket_key=6, inputs=[*it.provide_data, *it.provide_label],
        rows_per_step=None, num_samples=6)
    assert [d.shape for d in it.plan().inputs] == [(2, 6), (2,), (2, 6)]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(sequences=[]), ValueError, r"sequences: received an empty list"),
        (dict(sequences=[[1], [2, 3], []]), ValueError, r"sequences\[2\].*empty sequence"),
        (dict(sequences=[[1], [[1, 2, 3], [4, 5, 6]]]), ValueError,
         r"sequences\[1\]: received shape \(2, 3\); expected a non-empty 1-D"),
        (dict(sequences=[[1], ["a"]]), TypeError, r"sequences\[1\].*not numeric"),
        (dict(labels=[0, 1]), ValueError, r"labels: received 2 labels for 3 sequences"),
        (dict(buckets=[2, 4]), ValueError,
         r"sequences\[2\] has length 5, longer than the largest bucket 4.*"
         r"add a bucket >= 5, or pass buckets=None"),
        (dict(buckets=[0, 8]), ValueError, r"buckets: got 0; expected an int >= 1. Fix: pass pos"),
        (dict(buckets=[-3, 8]), ValueError, r"buckets: got -3"),
        (dict(buckets=[2.5, 8]), TypeError, r"buckets: got 2\.5; expected an int"),
        (dict(buckets=[]), ValueError, r"buckets: received \[\]; expected a non-empty list"),
        (dict(buckets="8"), TypeError, r"buckets: received '8'"),
        (dict(batch_size=0), ValueError, r"batch_size: got 0; expected an int >= 1"),
        (dict(batch_size=2.0), TypeError, r"batch_size: got 2\.0; expected an int"),
        (dict(pad_value=0.5), TypeError, r"pad_value: received 0\.5.*torch\.int64"),
        (dict(seed="1"), TypeError, r"seed: got '1' \(str\)"),
        (dict(labels=[[0], [1, 1], [0, 0, 0]]), ValueError,
         r"labels\[2\]: received shape \(3,\) for sequences\[2\] of length 5; expected "
         r"per-token labels of shape \(5,\)"),
        (dict(labels=[[0], [1, 1], [0, "x", 0, 0, 0]]), TypeError, r"labels\[2\].*not numeric"),
        (dict(labels=[[0], [1, 1], [0] * 5], label_pad=0.5), TypeError,
         r"label_pad: received 0\.5 for labels of dtype torch\.int64.*label_pad=-100"),
    ],
)
def test_bad_input_raises_a_clear_error(kwargs, error, pattern):
    args = dict(sequences=[[1], [2, 3], [4, 5, 6, 7, 8]], labels=[0, 1, 0], batch_size=2)
    with pytest.raises(error, match=pattern):
        BucketIterator(**(args | kwargs))


def test_bad_epoch_or_state_raises_a_clear_error():
    it = BucketIterator([[1], [2, 3]], None, 1)
    with pytest.raises(ValueError, match=r"epoch: got -1"):
        it.set_epoch(-1)
    with pytest.raises(TypeError, match=r"epoch: got 1\.0"):
        it.set_epoch(1.0)
    with pytest.raises(ValueError, match=r"lacks \['position'\]"):
        it.load_state_dict({"seed": 1, "epoch": 0})
    with pytest.raises(ValueError, match=r"position -1 is negative"):
        it.load_state_dict({"seed": 1, "epoch": 0, "position": -1})
    assert it.state_dict() == {"seed": it.seed, "epoch": 0, "position": 0}  # nothing loaded
    # (fit asks this before anything loads: see the test of data too short below)
    assert "9 batches into epoch 0, past the end of this fit's data, which has 2 batches" in (
        it.check_resume({"seed": 1, "epoch": 0, "position": 9}, continues=True))
    assert it.check_resume({"seed": 1, "epoch": 0, "position": 9}, continues=False) is None
    with pytest.raises(ValueError, match=r"max_buckets: got 0"):
        choose_buckets([1, 2], 1, max_buckets=0)
    with pytest.raises(ValueError, match=r"lengths: received \[3, 0\]"):
        choose_buckets([3, 0], 1)


@pytest.mark.parametrize("module", [fitdp.data.bucketing, fitdp.data.length_groups])
def test_docstring_examples_run(module):
    assert doctest.testmod(module, extraglobs={"torch": torch}).failed == 0


def test_per_token_labels_are_padded_with_label_pad():
    lengths = [3, 7, 1, 8, 5, 2]
    seqs = make_sequences(lengths)
    tags = [s % 5 for s in seqs]
    mixed = [tags[0].tolist(), tags[1].numpy(), *tags[2:]]  # lists, arrays and tensors
    it = BucketIterator(seqs, mixed, 2, buckets=[4, 8], include_lengths=True, seed=0)
    assert it.per_token_labels
    assert it.provide_label == [DataDesc("label", (2, 8), torch.int64)]
    for b in it:
        padded, lens = b.data
        assert b.label.shape == padded.shape and b.label.dtype == torch.int64
        for row, n, i in zip(b.label, lens.tolist(), b.index.tolist()):
            assert torch.equal(row[:n], tags[i]) and (row[n:] == -100).all()
    floats = [t.float() / 2 for t in tags]
    (b, *_) = BucketIterator(seqs, floats, 6, buckets=[8], label_pad=-1.5, shuffle=False)
    assert b.label.dtype == torch.float32 and b.label[0, :3].tolist() == floats[0].tolist()
    assert (b.label[0, 3:] == -1.5).all()
    vectors = BucketIterator(seqs, [[1, 0], [0, 1]] * 3, 2, buckets=[8])  # per sample: all alike
    assert not vectors.per_token_labels and vectors.provide_label[0].shape == (2, 2)


V, K = 30, 3  # tagger: vocabulary (0 is padding) and tag classes


class Tagger(nn.Module):
    """Embedding + GRU + per-step head: logits (batch, classes, time), as F.cross_entropy and
    torchmetrics take them for sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.gru = nn.Embedding(V, 16, padding_idx=0), nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, K)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(tokens))[0]).transpose(1, 2)


def tagger_and_task(n: int) -> tuple[fitdp.Model, list[torch.Tensor], list[torch.Tensor]]:
    """A compiled tagger, and n sequences whose tags depend on a token and the one before."""
    torch.manual_seed(0)
    seqs = [s % (V - 1) + 1 for s in make_sequences(torch.randint(2, 16, (n,)).tolist())]
    tags = [(s + torch.cat([s.new_zeros(1), s[:-1]])) % K for s in seqs]
    model = fitdp.Model(Tagger())
    accuracy = MulticlassAccuracy(num_classes=K, ignore_index=-100, average="micro")
    model.compile(optimizer="adam", lr=0.02, loss="cross_entropy", metrics={"accuracy": accuracy})
    return model, seqs, tags


def test_tagger_loss_and_accuracy_skip_the_label_padding():
    """MXNet's BucketSentenceIter pads each sentence and its per-step labels to the bucket
    length with one ``invalid_label``; its bucketing example scores with
    ``Perplexity(invalid_label)`` so padded steps count nowhere. fitdp pads labels with -100,
    the default ``ignore_index`` of F.cross_entropy, and MulticlassAccuracy(ignore_index=-100)
    skips it: the loss is the mean over real tokens only, and so is the accuracy."""
    model, seqs, tags = tagger_and_task(24)
    before = copy.deepcopy(model.module)
    it = BucketIterator(seqs, tags, 24, buckets=[15], shuffle=False)  # one padded batch
    (batch,) = list(it)
    assert (batch.label == -100).float().mean() > 0.3
    logs = model.fit(it, epochs=1, devices=["cpu"], verbose=0).history  # one step
    with torch.no_grad():
        logits, padded_as_0 = torch.cat([before(s[None])[0].T for s in seqs]), F.cross_entropy(
            before(batch.data), batch.label.clamp(min=0))  # as if the padding were tag 0
    assert logs["loss"][0] == pytest.approx(float(F.cross_entropy(logits, torch.cat(tags))))
    assert float(padded_as_0) != pytest.approx(logs["loss"][0], rel=1e-3)
    hits = (logits.argmax(1) == torch.cat(tags)).float()
    assert logs["accuracy"][0] == pytest.approx(float(hits.mean()), abs=1e-6)


def test_a_tagger_trains_and_its_accuracy_ignores_padding_across_buckets_and_devices():
    model, seqs, tags = tagger_and_task(120)
    it = BucketIterator(seqs, tags, 16, seed=0)
    assert len(it.buckets) > 1 and it.per_token_labels
    h = model.fit(it, epochs=15, devices=["cpu", "cpu"], verbose=0).history
    assert h["loss"][-1] < 0.4 * h["loss"][0] and h["accuracy"][-1] > 0.85
    logs = model.evaluate(it, devices=["cpu", "cpu"], verbose=0)
    with torch.no_grad():
        hits = torch.cat([model.module(s[None])[0].argmax(0) == t for s, t in zip(seqs, tags)])
    assert logs["accuracy"] == pytest.approx(float(hits.float().mean()), abs=1e-6)


def bag_model() -> fitdp.Model:
    """Mean of embedded tokens (one bag per row), then a linear head."""
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.EmbeddingBag(1000, 4, mode="mean"), nn.Linear(4, 2)))
    model.compile("adam", "cross_entropy", lr=0.05)
    return model


def bag_data(n: int = 24) -> BucketIterator:
    """n sequences of lengths 2..7 in buckets [4, 8], 6 to a batch (24: 4 batches)."""
    seqs = make_sequences([2 + i * 5 % 6 for i in range(n)])
    return BucketIterator(seqs, torch.tensor([int(s.sum()) % 2 for s in seqs]), 6,
                          buckets=[4, 8], seed=5)


def crash_at_step(step: int) -> fitdp.callbacks.Callback:
    class Crash(fitdp.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.global_step == step:
                raise KeyboardInterrupt
    return Crash()


def test_a_checkpoint_of_an_epochs_last_batch_resumes_with_the_next_epoch(tmp_path):
    """Regression (found by the equivalence harness): fit(resume=) from a checkpoint saved
    after epoch 0's last batch (on_train_batch_end, before the epoch ended) trained a whole
    epoch more (global_step 12 of 8 here). Keras' BackupAndRestore promises a resumed fit
    continues the interrupted one: here it equals the uninterrupted run, bit for bit."""
    ref = bag_model()
    ref_loss = ref.fit(bag_data(), epochs=2, verbose=0).history["loss"]
    last = len(bag_data())
    with pytest.raises(KeyboardInterrupt):
        bag_model().fit(bag_data(), epochs=2, verbose=0, callbacks=[
            fitdp.callbacks.ModelCheckpoint(str(tmp_path / "s-{step}.ckpt"), save_freq=1),
            crash_at_step(last)])
    model = bag_model()
    loss = model.fit(bag_data(), epochs=2, verbose=0,
                     resume=str(tmp_path / f"s-{last}.ckpt")).history["loss"]
    assert model.global_step == ref.global_step == 2 * last
    assert loss == ref_loss
    for a, b in zip(model.module.parameters(), ref.module.parameters()):
        assert torch.equal(a, b)


def test_steps_per_epoch_ending_on_the_datas_last_batch_go_on_in_the_next_epoch():
    """Regression: with steps_per_epoch=4 on 6 batches, fit's epoch that ended on the data's
    last batch left the iterator to start the next data epoch by itself, unseen by fit,
    which later called set_epoch with the number of the epoch already under way: data
    epoch 2 trained twice, epoch 3 never. Keras draws steps_per_epoch batches from one
    running stream of the data's epochs."""
    seen = []

    class Recorded(BucketIterator):
        def _make_batch(self, width, index):
            seen.append(index.tolist())
            return super()._make_batch(width, index)

    seqs = make_sequences([3] * 12 + [7] * 12)
    data = Recorded(seqs, torch.zeros(24, dtype=torch.long), 4, buckets=[4, 8], seed=1)
    bag_model().fit(data, epochs=5, steps_per_epoch=4, verbose=0)
    epochs = BucketIterator(seqs, None, 4, buckets=[4, 8], seed=1)
    assert len(epochs) == 6  # 20 batches: data epochs 0, 1, 2 and 3's first two
    expected = []
    for epoch in range(4):
        epochs.set_epoch(epoch)
        expected += order(epochs)
    assert seen == expected[:20]


def test_a_mid_epoch_position_past_this_datas_end_is_refused_naming_both_sizes(tmp_path):
    """As the in-memory and DataLoader sources (data.md: a checkpoint taken further into
    its epoch than this data reaches is a CheckpointError naming both sizes, the model left
    as it was); before, a position was refused only past the saved data's own epochs."""
    with pytest.raises(KeyboardInterrupt):
        bag_model().fit(bag_data(), epochs=2, verbose=0, callbacks=[
            fitdp.callbacks.ModelCheckpoint(str(tmp_path / "s-{step}.ckpt"), save_freq=1),
            crash_at_step(3)])
    model = bag_model()
    model.fit(bag_data(6), epochs=1, verbose=0)
    before = {k: v.clone() for k, v in model.get_weights().items()}
    with pytest.raises(fitdp.CheckpointError, match=r"data state does not fit.*3 batches into "
                       r"epoch 0, past the end of this fit's data, which has 2 batches"):
        model.fit(bag_data(6), epochs=2, verbose=0, resume=str(tmp_path / "s-3.ckpt"))
    assert model.global_step == 2
    for key, value in model.get_weights().items():
        assert torch.equal(value, before[key])
