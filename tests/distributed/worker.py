"""One rank of a 2-process gloo job on 127.0.0.1, launched via torchrun by
tests/distributed/test_distributed.py.

Usage: torchrun ... worker.py SCENARIO[+SCENARIO...] OUT_DIR   (each writes in OUT_DIR/SCENARIO)
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitdp
from fitdp.callbacks import BackupAndRestore, Callback, LambdaCallback, ModelCheckpoint

SCENARIO, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ["RANK"])
torch.set_num_threads(1)


def data(n: int = 45) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def model(**compile_kw) -> fitdp.Model:
    torch.manual_seed(RANK)  # different on every rank: fit must broadcast rank 0's weights
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    m = fitdp.Model(net)
    m.compile(optimizer="adam", lr=0.01, loss="cross_entropy", **compile_kw)
    return m


class Fault(Callback):
    """Rank 1 misbehaves after step 2: raises, dies or stalls."""

    def __init__(self, kind: str, out: str) -> None:
        super().__init__()
        self.kind, self.out = kind, out

    def on_train_batch_end(self, batch, logs=None):
        if RANK != 1 or self.model.global_step != 2:
            return
        if self.kind == "raise":
            raise RuntimeError("injected failure on rank 1")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stall":
            time.sleep(3600)
        if self.kind == "kill_once" and not os.path.exists(os.path.join(self.out, "killed")):
            open(os.path.join(self.out, "killed"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def save(out: str, name: str, obj) -> None:
    if RANK == 0:
        torch.save(obj, os.path.join(out, name))


def train(out: str) -> None:
    m = model()
    m.fit(x, y, batch_size=5, epochs=2, shuffle=False, devices="auto", verbose=0)
    save(out, "weights.pt", m.module.state_dict())


def train_local2(out: str) -> None:
    m = model()
    m.fit(x, y, batch_size=5, epochs=2, shuffle=False, devices=["cpu", "cpu"], verbose=0)
    save(out, "weights.pt", m.module.state_dict())


def metrics(out: str) -> None:
    m = model(metrics=[MulticlassAccuracy(num_classes=3)])
    x, y = data(37)  # does not divide by the world size nor by the batch
    logs = m.evaluate(x, y, batch_size=4, verbose=0)
    preds = m.predict(x, batch_size=4)
    save(out, "metrics.pt", {"logs": logs, "preds": preds, "weights": m.module.state_dict()})


def fault(kind: str) -> Callable[[str], None]:
    def run(out: str) -> None:
        m = model()
        m.fit(x, y, batch_size=5, epochs=3, verbose=0, timeout=8, callbacks=[Fault(kind, out)])
    return run


def raise_slow_exit(out: str) -> None:
    # Rank 1 raises, leaves the process group, and is slow to exit (a big interpreter's
    # teardown): its peer's collective fails while rank 1 is still running.
    if RANK == 1:
        atexit.register(time.sleep, 1.5)  # runs after fitdp's own exit handler
    fault("raise")(out)


def resumable(kill: bool) -> Callable[[str], None]:
    def run(out: str) -> None:
        m = model(metrics=[MulticlassAccuracy(num_classes=3)])
        cbs: list[Callback] = [BackupAndRestore(os.path.join(out, "backup"), save_freq=1)]
        if kill:
            cbs.append(Fault("kill_once", out))
        history = m.fit(x, y, batch_size=5, epochs=3, seed=3, verbose=0, callbacks=cbs)
        save(out, "weights.pt", m.module.state_dict())
        save(out, "history.pt", history.history)
    return run


def preempt(out: str) -> None:
    """``uninterrupted``'s fit with per-epoch backups; rank 1 alone is sent SIGTERM after
    step 4 (mid-epoch 0), once: both ranks stop after the same step and exit with 143."""
    def sigterm(batch, logs):
        marker = os.path.join(out, "sigterm")
        if RANK == 1 and m.global_step == 4 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)

    m = model()
    m.fit(x, y, batch_size=5, epochs=3, seed=3, verbose=0, callbacks=[
        BackupAndRestore(os.path.join(out, "backup")), LambdaCallback(on_train_batch_end=sigterm)])
    save(out, "weights.pt", m.module.state_dict())


def stop_with_checkpoint(out: str) -> None:
    m = model()

    def stop(batch, logs):
        m.stop_training = m.global_step == 5

    ckpt = ModelCheckpoint(os.path.join(out, "c.ckpt"), save_freq=1, monitor="loss")
    m.fit(x, y, batch_size=5, epochs=2, seed=3, verbose=0,
          callbacks=[ckpt, LambdaCallback(on_train_batch_end=stop)])


def uneven(out: str) -> None:
    x, y = data(45 if RANK == 0 else 40)  # each rank passed its own, different data
    model().fit(x, y, batch_size=5, verbose=0, timeout=20)


SCENARIOS: dict[str, Callable[[str], None]] = {
    "train": train, "train_local2": train_local2, "metrics": metrics,
    "raise": fault("raise"), "kill": fault("kill"), "stall": fault("stall"),
    "raise_slow_exit": raise_slow_exit, "restart": resumable(kill=True),
    "uninterrupted": resumable(kill=False), "stop_with_checkpoint": stop_with_checkpoint,
    "uneven": uneven, "preempt": preempt,
}

x, y = data()
for name in SCENARIO.split("+"):  # one process group for all: each torchrun start costs ~10 s
    if name not in SCENARIOS:
        raise SystemExit(f"unknown scenario {name}")
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    SCENARIOS[name](folder)
