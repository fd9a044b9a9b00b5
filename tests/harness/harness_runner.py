"""Builds a drawn `Run` (model, data, callbacks) and runs it: uninterrupted, or stopped and
resumed as its `Stop` says. Used in-process by test_harness.py and in each rank by
rank_worker.py, so both sides run the very same code."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from harness_runs import BATCH, ROWS, VAL_ROWS, Run
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import fitdp
from fitdp.callbacks import EMA, SWA, BackupAndRestore, Callback, ModelCheckpoint
from fitdp.saving.seal import CheckpointError

VOCAB, LONGEST = 12, 7
SEED = 3


class Crash(Exception):
    """The harness's interruption (raised by `StopAt`)."""


class Block(nn.Module):
    """The drawn source of randomness, in a block activation checkpointing may wrap."""

    def __init__(self, randomness: str, width: int) -> None:
        super().__init__()
        self.randomness = randomness
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3) if randomness == "dropout" else None
        self.norm = nn.BatchNorm1d(width) if randomness == "batchnorm" else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(h))  # (rows, tokens, width): draws rows * tokens * width
        if self.drop is not None:
            h = self.drop(h)
        if self.randomness == "functional":
            h = F.dropout(h, 0.3, self.training)  # no module says it draws
        if self.norm is not None:
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return h


class Net(nn.Module):
    """Embedding, the block, mean over tokens, a head: about 200 parameters at width 8. With
    ``own_loss`` it takes the labels and returns its loss (Hugging Face's habit)."""

    def __init__(self, randomness: str, own_loss: bool, width: int) -> None:
        super().__init__()
        self.own_loss = own_loss
        self.emb = nn.Embedding(VOCAB, width, padding_idx=0)
        self.block = Block(randomness, width)
        self.head = nn.Linear(width, 3)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(self.block(self.emb(tokens)).mean(1))
        if not self.own_loss:
            return logits
        assert labels is not None, "the model's own loss needs the labels"
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of 2-7 tokens padded with 0 to 7, and a label each."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, LONGEST + 1, (n,), generator=g)
    tokens = torch.randint(1, VOCAB, (n, LONGEST), generator=g)
    tokens = tokens * (torch.arange(LONGEST) < lengths[:, None])
    return tokens, tokens.sum(1) % 3


class DictRows(Dataset):
    """A map-style Dataset of dict items (what a tokenizer gives)."""

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        self.tokens, self.labels = tokens, labels

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[i], "labels": self.labels[i]}


def grouped_lengths(n: int = ROWS) -> list[int]:
    """Each training row's length (its tokens before the padding): ``group_by_length``."""
    return (rows(n, seed=1)[0] != 0).sum(1).tolist()


def grouped_batches(batch_size: int) -> int:
    """Batches per epoch of the training rows grouped by length (a short one per bucket)."""
    return fitdp.BucketBatchSampler(grouped_lengths(), batch_size).num_batches


def trim(items: list[Any]) -> Any:
    """Collate, then cut the padding to the batch's longest sequence (variable lengths)."""
    batch = torch.utils.data.default_collate(items)
    tokens = batch["tokens"] if isinstance(batch, dict) else batch[0]
    longest = int((tokens != 0).sum(1).max())
    if isinstance(batch, dict):
        return {**batch, "tokens": tokens[:, :longest]}
    return [tokens[:, :longest], batch[1]]


def fit_data(run: Run, n: int = ROWS) -> dict[str, Any]:
    """The ``fit`` arguments that give this run's training data, built fresh (a loader's
    generator starts at its seed; a resumed fit skips what a one-shot stream trained)."""
    tokens, labels = rows(n, seed=1)
    as_dict = run.own_loss
    dataset = DictRows(tokens, labels) if as_dict else TensorDataset(tokens, labels)
    bs, kind = run.batch, run.kind
    collate = trim if run.varlen else None
    if kind == "tensors":
        return {"x": tokens, "y": labels, "batch_size": bs, "shuffle": run.shuffle}
    if kind == "dict":
        if as_dict:
            return {"x": {"tokens": tokens, "labels": labels}, "batch_size": bs,
                    "shuffle": run.shuffle}
        return {"x": {"tokens": tokens}, "y": labels, "batch_size": bs, "shuffle": run.shuffle}
    if kind == "dataset":
        return {"x": dataset, "batch_size": bs, "shuffle": run.shuffle}
    if kind == "grouped":
        return {"x": dataset, "batch_size": bs, "shuffle": run.shuffle, "collate_fn": collate,
                "group_by_length": grouped_lengths()}
    if kind == "buckets":
        sequences = [t[t != 0] for t in tokens]
        return {"x": fitdp.BucketIterator(sequences, labels, batch_size=bs, buckets=[4, 7],
                                          shuffle=run.shuffle, seed=5)}
    if kind == "generator":
        def stream():  # noqa: ANN202 (each epoch starts one batch later than the last)
            for epoch in range(run.epochs):
                for i in range(0, n, bs):
                    j = (i + epoch * bs) % n
                    if as_dict:
                        yield {"tokens": tokens[j:j + bs], "labels": labels[j:j + bs]}
                    else:
                        yield tokens[j:j + bs], labels[j:j + bs]
        return {"x": stream(), "steps_per_epoch": -(-n // bs)}
    loader_kw: dict[str, Any] = {"batch_size": bs, "collate_fn": collate}
    if kind == "loader_sampler":
        loader_kw["sampler"] = DistributedSampler(dataset, num_replicas=1, rank=0,
                                                  shuffle=run.shuffle, seed=7)
    else:
        loader_kw["shuffle"] = run.shuffle
    if kind.endswith("_generator"):
        loader_kw["generator"] = torch.Generator().manual_seed(11)
    if kind == "loader_workers":
        loader_kw["num_workers"] = 1
    if kind.startswith("stateful"):
        from torchdata.stateful_dataloader import StatefulDataLoader
        return {"x": StatefulDataLoader(dataset, **loader_kw)}
    return {"x": DataLoader(dataset, **loader_kw)}


def validation(run: Run) -> Any:
    """Validation rows in the training data's form (variable lengths: a loader that cuts
    each batch's padding, as fitdp checks trailing shapes against the training batches)."""
    tokens, labels = rows(VAL_ROWS, seed=2)
    if run.varlen:
        dataset = DictRows(tokens, labels) if run.own_loss else TensorDataset(tokens, labels)
        return DataLoader(dataset, batch_size=BATCH, collate_fn=trim)
    if run.own_loss:
        return {"tokens": tokens, "labels": labels}
    return ({"tokens": tokens}, labels) if run.kind == "dict" else (tokens, labels)


def make_model(run: Run, checkpointing: bool) -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(Net(run.randomness, run.own_loss, run.width))
    compile_kw: dict[str, Any] = {"grad_accum_steps": run.accum, "metrics": ["accuracy"]}
    if checkpointing:
        compile_kw["activation_checkpointing"] = [Block]
    if run.own_loss:
        compile_kw["loss"] = None
        if run.loss_items:
            compile_kw["loss_items"] = lambda batch: len(batch["labels"])
    model.compile("adam", lr=0.05, **compile_kw)
    return model


def averaging(run: Run) -> list[Callback]:
    if run.callback == "ema":
        return [EMA(decay=0.8)]
    if run.callback == "swa":
        return [SWA(swa_lr=0.02, swa_epoch_start=0.5)]
    return []


class StopAt(Callback):
    """Raises `Crash` once, right after optimizer step ``step``'s batch or at the end of the
    epoch holding it (after its validation)."""

    def __init__(self, step: int, at: str) -> None:
        super().__init__()
        self.step, self.at, self.done = step, at, False

    def _maybe(self) -> None:
        if not self.done and self.model.global_step == self.step:
            self.done = True
            raise Crash(f"stopped after step {self.step}")

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self.at == "batch":
            self._maybe()

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if self.at == "epoch_end":
            self._maybe()


def fit(model: fitdp.Model, run: Run, callbacks: list[Callback], **kw: Any) -> Any:
    devices = ["cpu"] * run.devices
    extra: dict[str, Any] = {}
    if run.reproducible:
        extra.update(reproducible=True, micro_batch_size=3)
    data = kw.pop("data", None) or fit_data(run)
    if run.validation:
        extra["validation_data"] = validation(run)
    return model.fit(**data, epochs=run.epochs, devices=devices, work_load_list=run.loads,
                     seed=SEED, verbose=0, callbacks=callbacks, timeout=60, **extra, **kw)


def outcome(model: fitdp.Model, history: Any, run: Run) -> dict[str, Any]:
    """What the harness compares: weights and buffers, optimizer state, step, History, and
    (in one process) ``evaluate`` on the validation data with one device."""
    assert model.optimizer is not None
    got = {"weights": {k: v.clone() for k, v in model.module.state_dict().items()},
           "optimizer": model.optimizer.state_dict()["state"],
           "step": model.global_step, "history": dict(history.history)}
    if run.ranks == 1:
        data = validation(run)
        x, y = data if isinstance(data, tuple) else (data, None)
        got["evaluate"] = model.evaluate(x, y, batch_size=BATCH, devices=["cpu"], verbose=0)
    return got


def uninterrupted(run: Run, checkpointing: bool | None = None) -> dict[str, Any]:
    model = make_model(run, run.checkpointing if checkpointing is None else checkpointing)
    return outcome(model, fit(model, run, averaging(run)), run)


def _saver(run: Run, folder: str) -> Callback:
    stop = run.stop
    assert stop is not None
    if stop.how == "backup":
        return BackupAndRestore(os.path.join(folder, "backup"), save_freq=stop.every)
    return ModelCheckpoint(os.path.join(folder, "step-{step:03d}.ckpt"), monitor="loss",
                           save_freq=1)


def first_part(run: Run, folder: str) -> None:
    """Runs ``run`` until its stop, saving as drawn."""
    stop = run.stop
    assert stop is not None
    savers = [_saver(run, folder)]
    if stop.at == "epoch_end" and stop.how == "checkpoint":
        savers.append(ModelCheckpoint(os.path.join(folder, "epoch-{epoch:03d}.ckpt"),
                                      monitor="loss"))
    model = make_model(run, run.checkpointing)
    try:
        fit(model, run, [*savers, *averaging(run), StopAt(stop.step, stop.at)])
    except Crash:
        pass
    else:
        raise AssertionError(f"the run never reached step {stop.step}")
    finally:
        model.close()


def resume_part(run: Run, folder: str) -> dict[str, Any]:
    """Resumes what `first_part` saved, on the stop's placement, in a fresh Model. With
    ``stop.short`` the resume gets one batch of data: the result is then the refusal (was
    it a clear error, did anything move)."""
    stop = run.stop
    assert stop is not None
    again = replace(run, devices=stop.devices, loads=stop.loads, ranks=stop.ranks)
    model = make_model(again, run.checkpointing)
    if stop.how == "backup":
        return outcome(model, fit(model, again, [_saver(run, folder), *averaging(run)]), again)
    if stop.at == "epoch_end":  # ModelCheckpoint numbers epochs from 1, as Keras does
        name = f"epoch-{stop.step // run.steps_per_epoch:03d}.ckpt"
    else:
        name = f"step-{stop.step:03d}.ckpt"
    path = os.path.join(folder, name)
    if not stop.short:
        return outcome(model, fit(model, again, averaging(run), resume=path), again)
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    try:
        fit(model, again, averaging(run), resume=path, data=fit_data(again, n=BATCH))
    except Exception as err:  # noqa: BLE001 (which error it is is the check's to judge)
        error = f"{type(err).__name__}: {err}"
        clear = isinstance(err, (CheckpointError, ValueError))
    else:
        error, clear = "none", False
    after = model.module.state_dict()
    return {"refusal": error, "clear": clear, "step": model.global_step,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def interrupted(run: Run, folder: str) -> dict[str, Any]:
    """``run`` stopped where drawn and resumed as drawn, in this process."""
    first_part(run, folder)
    return resume_part(run, folder)
