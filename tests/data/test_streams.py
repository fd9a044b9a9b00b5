"""An IterableDataset (a stream) trains: one pass per epoch, batched by the user's DataLoader
or by batch_size, resumable mid-epoch where the stream can say its position (issue 17
item 5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import fitdp
from fitdp.callbacks import LambdaCallback, ModelCheckpoint

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(30, 6, generator=G), torch.randint(0, 3, (30,), generator=G)


class Stream(IterableDataset):
    """The rows in order, once per iter(); counts the passes made."""

    def __init__(self) -> None:
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        for i in range(len(X)):
            yield X[i], Y[i]


class Resumable(Stream):
    """A stream that says its position: state_dict() after the rows read, and
    load_state_dict(state) makes the next iter() continue from there."""

    def __init__(self) -> None:
        super().__init__()
        self.read, self.start = 0, 0

    def __iter__(self):
        self.passes += 1
        start, self.start = self.start, 0
        for i in range(start, len(X)):
            self.read = i + 1
            yield X[i], Y[i]

    def state_dict(self) -> dict[str, int]:
        return {"read": self.read}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["read"]


def Crash(at: int) -> LambdaCallback:  # noqa: N802 - reads like the callback it makes
    """A Ctrl-C right after training batch ``at`` of the fit (its checkpoint is saved)."""
    seen = []

    def end(batch: int, logs: dict[str, float]) -> None:
        seen.append(batch)
        if len(seen) == at:
            raise KeyboardInterrupt(f"crash after {at} batches")

    return LambdaCallback(on_train_batch_end=end)


def make() -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    model.compile("adam", lr=0.01)
    return model


def weights(model: fitdp.Model) -> list[torch.Tensor]:
    return list(model.module.state_dict().values())


def assert_same(a: fitdp.Model, b: fitdp.Model) -> None:
    assert all(torch.equal(u, v) for u, v in zip(weights(a), weights(b)))


@pytest.mark.parametrize("form", ["dataset", "loader"])
def test_an_iterable_dataset_trains_one_pass_per_epoch(form):
    """Regression (issue 17 item 5): fit(IterableDataset) failed with torch's "DataLoader
    with IterableDataset: expected unspecified sampler option". It trains one pass per
    epoch, in the stream's order, exactly like the same rows in memory without shuffling."""
    stream = Stream()
    data = stream if form == "dataset" else DataLoader(stream, batch_size=8)
    model, reference = make(), make()
    history = model.fit(data, batch_size=8, epochs=3, devices=["cpu", "cpu"], verbose=0)
    reference.fit(X, Y, batch_size=8, epochs=3, shuffle=False, devices=["cpu", "cpu"],
                  verbose=0)
    assert model.global_step == 3 * 4 and len(history.history["loss"]) == 3
    assert stream.passes == 3
    assert_same(model, reference)
    logs = model.evaluate(stream, batch_size=8, verbose=0)
    assert logs == reference.evaluate(X, Y, batch_size=8, verbose=0)


def run(model: fitdp.Model, data, tmp_path, callbacks=(), **kw) -> None:
    ckpt = ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=1, monitor="loss")
    model.fit(data, epochs=3, verbose=0, callbacks=[ckpt, *callbacks], **kw)


@pytest.mark.parametrize("form", ["dataset", "loader"])
def test_a_stream_that_says_its_position_resumes_mid_epoch_exactly(tmp_path, form):
    def data(stream):
        return stream if form == "dataset" else DataLoader(stream, batch_size=8)

    reference = make()
    reference.fit(data(Resumable()), batch_size=8, epochs=3, verbose=0)
    model = make()
    with pytest.raises(KeyboardInterrupt):
        run(model, data(Resumable()), tmp_path, [Crash(6)], batch_size=8)  # epoch 1, batch 2
    resumed, stream = make(), Resumable()
    run(resumed, data(stream), tmp_path, batch_size=8, resume="latest")
    assert resumed.global_step == 12 and stream.passes == 2  # the rest of epoch 1, epoch 2
    assert_same(resumed, reference)


def test_a_stream_that_cannot_say_its_position_refuses_a_mid_epoch_resume(tmp_path):
    model = make()
    with pytest.raises(KeyboardInterrupt):
        run(model, Stream(), tmp_path, [Crash(6)], batch_size=8)
    with pytest.raises(ValueError, match=r"^resume: got a checkpoint taken mid-epoch \(2 "
                       r"batches into epoch 1\) of a DataLoader over Stream.*no state_dict"):
        run(make(), Stream(), tmp_path, batch_size=8, resume="latest")
    workers = DataLoader(Resumable(), batch_size=8, num_workers=1)
    with pytest.raises(ValueError, match=r"num_workers=1 its position lives in the worker"):
        run(make(), workers, tmp_path, resume="latest")


def test_a_stream_resumes_from_an_epoch_end_without_saying_its_position(tmp_path):
    """A checkpoint written at an epoch's end (save_freq="epoch"; a batch-end one cannot
    know the stream has ended) resumes with a fresh pass."""
    reference = make()
    reference.fit(Stream(), batch_size=8, epochs=3, verbose=0)
    ckpt = str(tmp_path / "e-{epoch}.ckpt")
    model = make()
    with pytest.raises(KeyboardInterrupt):
        model.fit(Stream(), batch_size=8, epochs=3, verbose=0,
                  callbacks=[ModelCheckpoint(ckpt, monitor="loss"), Crash(10)])
    resumed, stream = make(), Stream()
    resumed.fit(stream, batch_size=8, epochs=3, verbose=0,
                callbacks=[ModelCheckpoint(ckpt, monitor="loss")], resume="latest")
    assert resumed.global_step == 12 and stream.passes == 1
    assert_same(resumed, reference)


def test_a_stream_under_torchrun_is_named_as_the_user_passed_it() -> None:
    """Issue 28 item 11: an IterableDataset without __len__ under torchrun was refused as
    "x: got LoaderSource" (fitdp's wrapper); the message names the user's dataset class."""
    from fitdp.data.sources.loaders import LoaderSource
    from fitdp.data.sources.sharded import ShardedSource

    with pytest.raises(ValueError, match=r"x: got an IterableDataset \(Stream\) without "
                       r"__len__;.*Fix: give the dataset a __len__") as err:
        ShardedSource(LoaderSource(DataLoader(Stream(), batch_size=4)), rank=0, world_size=2)
    assert "LoaderSource" not in str(err.value)
    with pytest.raises(ValueError, match=r"x: got a generator without __len__"):
        ShardedSource(LoaderSource(xy for xy in [(X, Y)]), rank=0, world_size=2)
