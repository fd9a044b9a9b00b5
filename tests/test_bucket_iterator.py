"""BucketIterator: grouping, padding, epoch order, exact resume, automatic buckets, errors."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fitdp.bucketing
from fitdp.batch import DataBatch
from fitdp.bucketing import BucketIterator, choose_buckets


def make_sequences(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Token ids in [1, 1000): never 0, so padding is distinguishable from data."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (n,), generator=g) for n in lengths]


def order(it: BucketIterator) -> list[list[int]]:
    return [b.index.tolist() for b in it]


def lognormal_lengths(n: int = 4000, seed: int = 0) -> list[int]:
    """The workload of the padding target: log-normal, clipped to [4, 256], mean ~40."""
    sigma = 0.8
    mu = float(np.log(40.0)) - sigma**2 / 2  # E[lognormal] = exp(mu + sigma^2 / 2) = 40
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 4, 256).astype(int).tolist()


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
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # the trainer's usual call: keeps a partly consumed epoch's position
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


def test_automatic_buckets_keep_padding_under_5_percent_on_lognormal_lengths():
    lengths = lognormal_lengths()
    assert 35 <= np.mean(lengths) <= 45 and min(lengths) >= 4 and max(lengths) <= 256
    seqs = [torch.full((n,), 7) for n in lengths]
    it = BucketIterator(seqs, None, 32, seed=0)
    assert it.buckets == sorted(it.buckets) and it.buckets[-1] == max(lengths)
    assert it.default_bucket_key == max(lengths)
    assert it.padding_fraction <= 0.05
    assert len(it.buckets) <= fitdp.bucketing.AUTO_MAX_BUCKETS
    counts = np.bincount(np.searchsorted(it.buckets, lengths), minlength=len(it.buckets))
    assert counts.min() >= 32  # no bucket is only a tiny batch
    pad = sum(b.data.numel() for b in it) - it.num_tokens
    assert pad / (pad + it.num_tokens) == pytest.approx(it.padding_fraction)


def test_choose_buckets_with_many_distinct_lengths_and_few_samples():
    lengths = np.random.default_rng(1).integers(1, 5000, 3000).tolist()  # > 512 distinct
    buckets = choose_buckets(lengths, batch_size=16)
    assert buckets == sorted(buckets) and buckets[-1] == max(lengths)
    counts = np.bincount(np.searchsorted(buckets, lengths), minlength=len(buckets))
    assert counts.min() >= 16
    assert choose_buckets([5, 3, 9], batch_size=8) == [9]  # fewer samples than one batch


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
        (dict(buckets=[0, 8]), ValueError, r"buckets: received 0; expected an int >= 1"),
        (dict(buckets=[-3, 8]), ValueError, r"buckets: received -3"),
        (dict(buckets=[2.5, 8]), TypeError, r"buckets: received 2\.5 \(float\)"),
        (dict(buckets=[]), ValueError, r"buckets: received \[\]"),
        (dict(buckets="8"), TypeError, r"buckets: received str"),
        (dict(batch_size=0), ValueError, r"batch_size: received 0; expected an int >= 1"),
        (dict(batch_size=2.0), TypeError, r"batch_size: received 2\.0 \(float\)"),
        (dict(pad_value=0.5), TypeError, r"pad_value: received 0\.5.*torch\.int64"),
        (dict(seed="1"), TypeError, r"seed: received '1'"),
    ],
)
def test_bad_input_raises_a_clear_error(kwargs, error, pattern):
    args = dict(sequences=[[1], [2, 3], [4, 5, 6, 7, 8]], labels=[0, 1, 0], batch_size=2)
    with pytest.raises(error, match=pattern):
        BucketIterator(**(args | kwargs))


def test_bad_epoch_or_state_raises_a_clear_error():
    it = BucketIterator([[1], [2, 3]], None, 1)
    with pytest.raises(ValueError, match=r"epoch: received -1"):
        it.set_epoch(-1)
    with pytest.raises(TypeError, match=r"epoch: received 1\.0"):
        it.set_epoch(1.0)
    with pytest.raises(ValueError, match=r"lacks \['position'\]"):
        it.load_state_dict({"seed": 1, "epoch": 0})
    with pytest.raises(ValueError, match=r"position 9 does not fit .* 2 batches"):
        it.load_state_dict({"seed": 1, "epoch": 0, "position": 9})


def test_docstring_examples_run():
    assert doctest.testmod(fitdp.bucketing, extraglobs={"torch": torch}).failed == 0
