"""One rank of a 2-process gloo job on 127.0.0.1, launched via torchrun by
tests/distributed/test_distributed.py.

Usage: torchrun ... worker.py SCENARIO OUT_DIR
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

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

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def on_train_batch_end(self, batch, logs=None):
        if RANK != 1 or self.model.global_step != 2:
            return
        if self.kind == "raise":
            raise RuntimeError("injected failure on rank 1")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stall":
            time.sleep(3600)
        if self.kind == "kill_once" and not os.path.exists(os.path.join(OUT, "killed")):
            open(os.path.join(OUT, "killed"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def save(name: str, obj) -> None:
    if RANK == 0:
        torch.save(obj, os.path.join(OUT, name))


x, y = data()
if SCENARIO in ("train", "train_local2"):
    m = model()
    devices = ["cpu", "cpu"] if SCENARIO == "train_local2" else "auto"
    m.fit(x, y, batch_size=5, epochs=2, shuffle=False, devices=devices, verbose=0)
    save("weights.pt", m.module.state_dict())
elif SCENARIO == "metrics":
    m = model(metrics=[MulticlassAccuracy(num_classes=3)])
    x, y = data(37)  # does not divide by the world size nor by the batch
    logs = m.evaluate(x, y, batch_size=4, verbose=0)
    preds = m.predict(x, batch_size=4)
    save("metrics.pt", {"logs": logs, "preds": preds, "weights": m.module.state_dict()})
elif SCENARIO in ("raise", "kill", "stall"):
    m = model()
    m.fit(x, y, batch_size=5, epochs=3, verbose=0, timeout=8, callbacks=[Fault(SCENARIO)])
elif SCENARIO == "raise_slow_exit":
    # Rank 1 raises, leaves the process group, and is slow to exit (a big interpreter's
    # teardown): its peer's collective fails while rank 1 is still running.
    if RANK == 1:
        atexit.register(time.sleep, 1.5)  # runs after fitdp's own exit handler
    m = model()
    m.fit(x, y, batch_size=5, epochs=3, verbose=0, timeout=8, callbacks=[Fault("raise")])
elif SCENARIO in ("restart", "uninterrupted"):
    m = model()
    cbs = [BackupAndRestore(os.path.join(OUT, "backup"), save_freq=1)]
    if SCENARIO == "restart":
        cbs.append(Fault("kill_once"))
    m.fit(x, y, batch_size=5, epochs=3, seed=3, verbose=0, callbacks=cbs)
    save("weights.pt", m.module.state_dict())
elif SCENARIO == "stop_with_checkpoint":
    m = model()

    def stop(batch, logs):
        m.stop_training = m.global_step == 5

    ckpt = ModelCheckpoint(os.path.join(OUT, "c.ckpt"), save_freq=1, monitor="loss")
    m.fit(x, y, batch_size=5, epochs=2, seed=3, verbose=0,
          callbacks=[ckpt, LambdaCallback(on_train_batch_end=stop)])
elif SCENARIO == "uneven":
    x, y = data(45 if RANK == 0 else 40)  # each rank passed its own, different data
    model().fit(x, y, batch_size=5, verbose=0, timeout=20)
else:
    raise SystemExit(f"unknown scenario {SCENARIO}")
