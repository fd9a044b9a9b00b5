"""``fit(group_by_length=...)`` and ``fitdp.BucketBatchSampler``: rows of similar length
batched together through the bucketing, for rows a collate function pads (transformers'
``Trainer`` groups by length with its ``LengthGroupedSampler``; MXNet's ``BucketSentenceIter``
batches one bucket at a time). Without transformers: a list of dict rows of token ids and a
padding collate function of the user's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fitdp
from fitdp.data.sources.grouping import row_lengths

SEED, BATCH = 3, 4


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=60),
       batch_size=st.integers(1, 7), seed=st.integers(0, 2**31), epoch=st.integers(0, 3),
       shuffle=st.booleans())
def test_every_row_once_per_epoch_in_batches_of_one_bucket(lengths, batch_size, seed, epoch,
                                                           shuffle):
    """Each epoch holds every row exactly once; a batch's rows all fall in one bucket (the
    smallest bucket >= the row's length); per bucket at most one batch is short; the order
    is a function of (seed, epoch) alone."""
    sampler = fitdp.BucketBatchSampler(lengths, batch_size, seed=seed, shuffle=shuffle)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    short: dict[int, int] = {}
    for batch in batches:
        widths = {min(w for w in sampler.buckets if w >= max(lengths[i], 1)) for i in batch}
        assert len(widths) == 1 and 1 <= len(batch) <= batch_size
        if len(batch) < batch_size:
            width = widths.pop()
            short[width] = short.get(width, 0) + 1
    assert all(n == 1 for n in short.values())
    again = fitdp.BucketBatchSampler(lengths, batch_size, seed=seed, shuffle=shuffle)
    again.set_epoch(epoch)
    assert list(again) == batches


def test_epochs_are_shuffled_differently_and_unshuffled_rows_stay_in_order():
    lengths = [int(n) for n in torch.randint(1, 40, (64,), generator=torch.Generator()
                                             .manual_seed(0))]
    sampler = fitdp.BucketBatchSampler(lengths, 4, seed=SEED)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(map(sorted, first)) != sorted(map(sorted,
                                                                             list(sampler)))
    plain = list(fitdp.BucketBatchSampler(lengths, 4, shuffle=False))
    assert all(b == sorted(b) for b in plain)


def rows(n: int = 30, seed: int = 0) -> list[dict]:
    """Rows of 1..12 token ids and a class (whether token 7 occurs)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(1, 10, (int(torch.randint(1, 13, (), generator=g)),),
                               generator=g)
        out.append({"tokens": tokens, "label": int((tokens == 7).any()), "weight": 1.0})
    return out


def pad(batch: list[dict]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The user's collate function: tokens padded with 0 to the batch's longest, a mask."""
    width = max(len(r["tokens"]) for r in batch)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        tokens[i, :len(r["tokens"])] = r["tokens"]
    return {"tokens": tokens, "mask": tokens != 0}, torch.tensor([r["label"] for r in batch])


class Bag(nn.Module):
    """Mean of the embeddings of a row's real tokens -> 2 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(10, 8), nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = (self.embed(tokens) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.out(h)


def compiled() -> fitdp.Model:
    model = fitdp.Model(Bag())
    model.compile("sgd", lr=0.5, loss="cross_entropy")
    return model


@pytest.mark.parametrize("devices", [["cpu"], ["cpu"] * 2])
def test_grouped_rows_train_as_a_hand_loop_over_the_samplers_batches(devices):
    """Two shuffled epochs grouped by each row's ``tokens`` length equal the hand loop over
    the sampler's batches (collated by the same function), on 1 and 2 replicas; and the
    grouped batches carry less padding than the same rows batched in a shuffled order."""
    data = rows()
    net, opt = Bag(), None
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    sampler = fitdp.BucketBatchSampler([len(r["tokens"]) for r in data], BATCH, seed=SEED)
    losses = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        total = 0.0
        for index in sampler:
            x, y = pad([data[i] for i in index])
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(**x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(index)
        losses.append(total / len(data))

    seen: list[torch.Tensor] = []

    def recording(batch):
        x, y = pad(batch)
        seen.append(x["tokens"])
        return x, y

    model = compiled()
    history = model.fit(data, batch_size=BATCH, epochs=2, seed=SEED, verbose=0,
                        devices=devices, collate_fn=recording, group_by_length="tokens")
    for p, q in zip(model.module.parameters(), net.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    assert history.history["loss"] == pytest.approx(losses, abs=1e-6)
    grouped = sum(int((t == 0).sum()) for t in seen)
    seen.clear()
    compiled().fit(data, batch_size=BATCH, epochs=2, seed=SEED, verbose=0, devices=devices,
                   collate_fn=recording)
    assert grouped < sum(int((t == 0).sum()) for t in seen) / 2


def test_a_users_loader_with_the_sampler_gets_each_epoch():
    """A DataLoader of the user's with ``batch_sampler=fitdp.BucketBatchSampler(...)``: fit
    tells the batch sampler the epoch (as it tells a DistributedSampler), so each epoch
    has its own order, the sampler's."""
    data = rows()
    sampler = fitdp.BucketBatchSampler([len(r["tokens"]) for r in data], BATCH, seed=SEED)
    seen: list[list[int]] = []

    def recording(batch):
        seen.append([next(i for i, r in enumerate(data) if r is row) for row in batch])
        return pad(batch)

    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=recording)
    compiled().fit(loader, epochs=2, verbose=0, devices=["cpu"])
    expected = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        expected += list(sampler)
    assert seen == expected and seen[:len(sampler)] != seen[len(sampler):]


def test_lengths_are_read_as_trainer_reads_them():
    """True reads a ``length`` column where the rows have one (Trainer's
    ``length_column_name``), else the length of each row's ``input_ids`` (its
    LengthGroupedSampler's default); a name reads that key (ints or sequences); a list is
    taken as the lengths."""
    ids = [{"input_ids": [1] * n, "n": n + 1} for n in (3, 1, 2)]
    assert row_lengths(ids, True, name="x").tolist() == [3, 1, 2]
    assert row_lengths(ids, "n", name="x").tolist() == [4, 2, 3]
    assert row_lengths([{**r, "length": 9} for r in ids], True, name="x").tolist() == [9] * 3
    assert row_lengths(ids, [5, 6, 7], name="x").tolist() == [5, 6, 7]
    assert row_lengths(ids, False, name="x") is None


def _unchanged(model, before):
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not model.optimizer.state


@pytest.mark.parametrize("x,arg,error,message", [
    ("tensors", True, TypeError, r"^group_by_length: got length grouping together with x of "
     r"type Tensor .*Fix: in-memory tensors have one length"),
    ("loader", True, TypeError, r"batch_sampler=fitdp.BucketBatchSampler"),
    ("stream", True, TypeError, r"a stream has no random access"),
    ("rows", "token", ValueError, r"^group_by_length: got 'token', and the rows of x have no "
     r"'token' .*did you mean 'tokens'\?"),
    ("rows", True, ValueError, r"have no 'input_ids'"),
    ("rows", [3, 4], ValueError, r"^group_by_length: got 2 lengths; expected one per row of "
     r"x \(30 rows\)"),
    ("rows", [-1] * 30, ValueError, r"expected one int >= 0 per row"),
    ("rows", 2.5, TypeError, r"^group_by_length: got 2.5; expected True"),
    ("rows", "weight", ValueError, r"'weight', whose value in row 0 is float"),
])
def test_bad_group_by_length_is_refused_before_anything_changes(x, arg, error, message):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(rows())

    data = {"tensors": torch.zeros(8, 3), "rows": rows(),
            "loader": torch.utils.data.DataLoader(rows(), batch_size=4, collate_fn=pad),
            "stream": Stream()}[x]
    model = compiled()
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    with pytest.raises(error, match=message):
        model.fit(data, y=torch.zeros(8, dtype=torch.long) if x == "tensors" else None,
                  epochs=1, verbose=0, devices=["cpu"], group_by_length=arg,
                  collate_fn=pad if x in ("rows", "stream") else None)
    _unchanged(model, before)
