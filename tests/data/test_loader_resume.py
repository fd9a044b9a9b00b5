"""A DataLoader with workers (or torchdata's StatefulDataLoader) resumes mid-epoch to the very
weights of the uninterrupted run, or is refused (issue 32 item 6)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitdp
from fitdp.callbacks import Callback, ModelCheckpoint
from tests.model.test_resume import Crash  # a Ctrl-C after optimizer step `at`

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=G), torch.randint(0, 3, (48,), generator=G)
EPOCHS, BATCH = 2, 8  # 6 batches per epoch


class Noisy(TensorDataset):
    """Rows with a random augmentation drawn where the row is read (a worker, or this
    process with num_workers=0), as image pipelines do."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn(6), y


def stateful_loader(**kw) -> DataLoader:
    # torchdata is an optional extra: a base install skips these tests
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    return stateful.StatefulDataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True, **kw)


def plain_loader(**kw) -> DataLoader:
    return DataLoader(Noisy(X, Y), batch_size=BATCH, shuffle=True, **kw)


def make() -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2),
                                      nn.Linear(16, 3)))
    model.compile("adam", lr=0.01)
    return model


def fit(make_loader, tmp_path=None, *callbacks: Callback, freq: int | str = 2,
        **kw) -> fitdp.Model:
    """A fresh model and loader, made in a script's order, fitted for 2 epochs (with
    checkpoints every ``freq`` steps in ``tmp_path``)."""
    model = make()
    loader = make_loader()  # (torchdata's RandomSampler seeds itself from torch's RNG here)
    if tmp_path is not None:
        callbacks = (ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=freq),
                     *callbacks)
    model.fit(loader, epochs=EPOCHS, verbose=0, callbacks=list(callbacks), **kw)
    return model


def interrupted_then_resumed(make_loader, tmp_path, at: int, freq: int | str = 2
                             ) -> fitdp.Model:
    with pytest.raises(KeyboardInterrupt):
        fit(make_loader, tmp_path, Crash(at), freq=freq)
    return fit(make_loader, tmp_path, freq=freq, resume="latest")


def assert_bitwise(a: fitdp.Model, b: fitdp.Model) -> None:
    for (k, v), w in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.equal(v, w), k


@pytest.mark.parametrize("workers", [2, 0])
@pytest.mark.parametrize("at", [3, 8])  # a checkpoint at step 2 of epoch 0, 8: epoch 1
def test_a_stateful_dataloader_with_workers_resumed_mid_epoch_is_off_no_more(tmp_path,
                                                                             workers, at):
    """Regression (issue 32 item 6): a StatefulDataLoader(num_workers=2) resumed mid-epoch
    about 2e-2 off the uninterrupted run. Its own state_dict() is saved after every
    optimizer step and loaded on resume, as torchdata's tutorial resumes it by hand."""
    reference = fit(lambda: stateful_loader(num_workers=workers))
    resumed = interrupted_then_resumed(lambda: stateful_loader(num_workers=workers),
                                       tmp_path, at)
    assert resumed.global_step == 12
    assert_bitwise(resumed, reference)


def test_a_stateful_dataloader_resumed_at_an_epoch_end_shuffles_the_next_epoch_anew(tmp_path):
    """torchdata's RandomSampler draws every epoch from its own generator: a resume from an
    epoch's end puts it where the epoch left it (not back at epoch 0's order)."""
    reference = fit(lambda: stateful_loader(num_workers=2))
    resumed = interrupted_then_resumed(lambda: stateful_loader(num_workers=2), tmp_path, 7,
                                       freq="epoch")
    assert_bitwise(resumed, reference)


@pytest.mark.parametrize("workers", [2, 0])
def test_a_shuffling_dataloader_resumed_mid_epoch_replays_its_order_and_augmentation(
        tmp_path, workers):
    """Regression (issue 32 item 6): without workers, a shuffling DataLoader resumed mid-epoch
    drew another order (its sampler draws at the first batch, from the resumed RNG). The
    epoch is replayed from the RNG states of its start, so the order and the workers' seeds
    (their augmentation) are the uninterrupted run's."""
    reference = fit(lambda: plain_loader(num_workers=workers))
    resumed = interrupted_then_resumed(lambda: plain_loader(num_workers=workers), tmp_path, 9)
    assert_bitwise(resumed, reference)


@pytest.mark.parametrize("freq", [2, "epoch"])
def test_a_dataloader_with_its_own_generator_resumes_with_that_generator_where_it_was(
        tmp_path, freq):
    """DataLoader(generator=g) draws each epoch's order from g: a resume in epoch 1 (mid-epoch
    or from epoch 0's end) needs g as it was then, not freshly seeded."""
    def loader() -> DataLoader:
        return plain_loader(num_workers=0, generator=torch.Generator().manual_seed(3))

    reference = fit(loader)
    assert_bitwise(interrupted_then_resumed(loader, tmp_path, 8 if freq == 2 else 7, freq),
                   reference)


def test_persistent_workers_are_refused_on_a_mid_epoch_resume_naming_num_workers(tmp_path):
    """Persistent workers carry their random draws over from every earlier epoch: no replay
    gives the same batches, so the resume says so before any weight changes."""
    with pytest.raises(KeyboardInterrupt):
        fit(lambda: plain_loader(num_workers=2, persistent_workers=True), tmp_path, Crash(9))
    model = make()
    before = [t.clone() for t in model.module.state_dict().values()]
    with pytest.raises(ValueError, match=r"^resume: got a checkpoint taken mid-epoch \(2 "
                       r"batches into epoch 1\) of a DataLoader with num_workers=2 and "
                       r"persistent_workers=True.*Fix: use persistent_workers=False"):
        model.fit(plain_loader(num_workers=2, persistent_workers=True), epochs=EPOCHS,
                  verbose=0, resume=str(tmp_path / "c-008.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.state_dict().values()))


class Rows(torch.utils.data.Dataset):
    """X and Y as a map-style Dataset (fitdp batches and shuffles it itself)."""

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return X[i], Y[i]


def test_a_shuffled_dataset_resumed_mid_epoch_1_keeps_epoch_1s_order(tmp_path):
    """Regression (issue 37 item 2): a shuffled map-style Dataset resumed mid-epoch in epoch
    1 replayed epoch 0's order (the restored epoch never reached fitdp's sampler)."""
    def run(*callbacks: Callback, **kw) -> fitdp.Model:
        model = make()
        model.fit(Rows(), batch_size=BATCH, epochs=EPOCHS, seed=4, verbose=0,
                  callbacks=list(callbacks), **kw)
        return model

    ckpt = ModelCheckpoint(str(tmp_path / "c-{step:03d}.ckpt"), save_freq=2)
    reference = run()
    with pytest.raises(KeyboardInterrupt):
        run(ckpt, Crash(9))  # the checkpoint of step 8: 2 batches into epoch 1
    assert_bitwise(run(ckpt, resume="latest"), reference)


@pytest.mark.parametrize("at", [9, 3])
def test_a_sampler_with_set_epoch_resumed_mid_epoch_gets_the_epoch_back(tmp_path, at):
    """Regression (issue 37 item 2): a DataLoader whose sampler has set_epoch (as
    DistributedSampler, which torch's docs say to call with the epoch before each one)
    resumed in epoch 1 drew epoch 0's order: the loaded epoch is passed to the sampler."""
    from torch.utils.data.distributed import DistributedSampler

    def loader() -> DataLoader:
        ds = TensorDataset(X, Y)
        return DataLoader(ds, batch_size=BATCH,
                          sampler=DistributedSampler(ds, num_replicas=1, rank=0, seed=5))

    assert_bitwise(interrupted_then_resumed(loader, tmp_path, at), fit(loader))


@pytest.mark.parametrize("at", [3, 5])  # checkpoints 2 and 4 batches into epoch 0 of 2
def test_a_stateful_dataloader_with_its_own_generator_resumed_in_epoch_0_shuffles_epoch_1_as_before(
        tmp_path, at):
    """Regression (issue 37 item 3): StatefulDataLoader(generator=g) resumed in epoch 0 of 2
    drew epoch 1's order from g freshly seeded: torchdata's single-process state does not
    carry g past the epoch, so fitdp saves g as it does for a plain DataLoader's."""
    def loader() -> DataLoader:
        return stateful_loader(generator=torch.Generator().manual_seed(3))

    assert_bitwise(interrupted_then_resumed(loader, tmp_path, at), fit(loader))


def test_a_stateful_dataloader_resumed_on_a_shorter_dataset_is_refused_before_any_step(
        tmp_path):
    """Regression (issue 37 item 11): a StatefulDataLoader checkpoint 4 batches into 48 rows
    resumed on 16 rows trained, then failed with "generator raised StopIteration" after the
    weights moved. The position is past the shorter data's end: refused at the door."""
    with pytest.raises(KeyboardInterrupt):
        fit(stateful_loader, tmp_path, Crash(5))  # the checkpoint of step 4
    model = make()
    before = [t.clone() for t in model.module.state_dict().values()]
    from torchdata.stateful_dataloader import StatefulDataLoader

    short = StatefulDataLoader(TensorDataset(X[:16], Y[:16]), batch_size=BATCH, shuffle=True)
    with pytest.raises(fitdp.CheckpointError, match=r"4 batches \(32 samples\) into epoch 0, "
                       r"past the end of this fit's data, which has 16 samples"):
        model.fit(short, epochs=EPOCHS, verbose=0, resume=str(tmp_path / "c-004.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.state_dict().values()))
    assert model.global_step == 0
