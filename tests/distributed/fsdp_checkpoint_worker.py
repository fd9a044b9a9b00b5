"""One rank of tests/distributed/test_strategy.py's FSDP2 checkpoint jobs.

2 ranks (``OUT``): a fit under strategy="fsdp" saves at its first epoch's end (every rank
calls ``save``: sharded by default, each rank writes its shards; also with async_save=True
and as one whole-tensor file, sharded=False) and keeps ModelCheckpoint files; new models
resume from each; fits with BackupAndRestore (sync and async) are interrupted on every rank
and run again, resuming from the backup; with double_checkpoint and the latest backup's
shard damaged, every rank resumes from the previous one. Rank 0 writes every run's final
weights.

3 ranks (``OUT reshard``): the 2-rank checkpoint loaded into 3 shards and saved again, then
a fit resumed from that. 2 ranks (``OUT restart``, under ``--max-restarts 1``): rank 1
killed once while an async backup is written; the restarted job resumes from the backup.

Usage: torchrun ... fsdp_checkpoint_worker.py OUT_DIR [reshard | restart]
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore, ModelCheckpoint
from fitdp.saving.sharded import load_sharded

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
CHECKPOINT = os.path.join(OUT, "fsdp.ckpt")  # a folder: sharded
ASYNC = os.path.join(OUT, "fsdp-async.ckpt")  # the same state, through async_save=True
WHOLE = os.path.join(OUT, "fsdp-whole.ckpt")  # one file of whole tensors (sharded=False)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(40, 6, generator=g)
y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def model() -> fitdp.Model:
    torch.manual_seed(RANK)  # rank 0's weights reach every rank
    m = fitdp.Model(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)))
    m.compile(optimizer="adamw", lr=0.05, loss="cross_entropy", grad_accum_steps=2,
              grad_clip_norm=0.05, strategy=fitdp.FSDP(blocks=(nn.Linear,)))
    return m


def keep(name: str, m: fitdp.Model, history: fitdp.callbacks.History | None = None) -> None:
    weights = m.get_weights()  # rank 0 alone may call it: fit's end gathered the shards
    if RANK == 0:
        torch.save(weights, os.path.join(OUT, f"{name}.pt"))
        if history is not None:
            torch.save(history.history, os.path.join(OUT, f"{name}-history.pt"))


if sys.argv[2:] == ["reshard"]:
    three = model()  # epochs=1: the checkpoint's run is past it, nothing trains
    three.fit(x, y, batch_size=5, epochs=1, verbose=0, resume=CHECKPOINT)
    three.save(os.path.join(OUT, "three.ckpt"))  # 3 ranks' shards
    three.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0,
              resume=os.path.join(OUT, "three.ckpt"))
    keep("three-resumed", three)
    print(f"rank {RANK} reshard done", flush=True)
    sys.exit(0)


class KillRank1Once(fitdp.callbacks.Callback):
    """SIGKILL on rank 1 right after the 3rd optimizer step's async backup started, once."""

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        marker = os.path.join(OUT, "killed")
        if RANK == 1 and self.model.global_step == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


if sys.argv[2:] == ["restart"]:  # torchrun --max-restarts 1 starts both ranks again
    restarted = model()
    history = restarted.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, callbacks=[
        BackupAndRestore(os.path.join(OUT, "killed-backup"), save_freq=1, async_save=True),
        KillRank1Once()])
    keep("killed-resumed", restarted, history)
    sys.exit(0)


class SaveFirstEpoch(fitdp.callbacks.Callback):
    """Every rank saves, in each form."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if epoch == 0:
            self.model.save(CHECKPOINT)
            self.model.save(ASYNC, async_save=True)
            self.model.save(WHOLE, sharded=False)
            keep("at-checkpoint", self.model)


class Crash(BaseException):
    """An interruption (as Ctrl-C) on every rank after the 3rd of 4 optimizer steps."""


class CrashAtStep3(fitdp.callbacks.Callback):
    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self.model.global_step == 3:
            raise Crash


whole = model()
checkpoints = ModelCheckpoint(os.path.join(OUT, "mc-{epoch}.ckpt"), monitor="loss", keep=1,
                              async_save=True)
history = whole.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0,
                    callbacks=[SaveFirstEpoch(), checkpoints])
keep("uninterrupted", whole, history)
for name, path in (("resumed", CHECKPOINT), ("resumed-async", ASYNC), ("resumed-whole", WHOLE)):
    resumed = model()
    resumed.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0, resume=path)
    keep(name, resumed)
for name, is_async in (("backup", False), ("backup-async", True)):
    folder = os.path.join(OUT, name)
    # (async: with the previous backup kept too, the folders rotated)
    options = {"save_freq": 1, "async_save": is_async, "double_checkpoint": is_async}
    try:  # saves after each optimizer step (step 3's mid-epoch), then crashes
        model().fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0,
                    callbacks=[BackupAndRestore(folder, **options), CrashAtStep3()])
    except Crash:
        if RANK == 0:  # (rank 0 publishes a save: another rank may look before)
            print(f"{name} crashed; backups: {sorted(os.listdir(folder))}, latest: "
                  f"{sorted(os.listdir(os.path.join(folder, 'backup.ckpt')))}", flush=True)
    again = model()  # finds the backup and resumes from it
    again.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0,
              callbacks=[BackupAndRestore(folder, **options)])
    keep(f"{name}-resumed", again)
    if RANK == 0:
        print(f"{name} deleted after the fit: {not os.path.exists(folder)}", flush=True)
# double_checkpoint, the latest backup (step 3) damaged in rank 1's shard file: every rank
# warns and resumes from the previous backup (step 2).
folder = os.path.join(OUT, "backup-damaged")
options = {"save_freq": 1, "double_checkpoint": True}
try:
    model().fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0,
                callbacks=[BackupAndRestore(folder, **options), CrashAtStep3()])
except Crash:
    pass
if RANK == 0:  # inf over the last row of the first weight, where rank 1's shard holds it
    latest = os.path.join(folder, "backup.ckpt")
    last_row = load_sharded(latest)["module"]["0.weight"][-1].numpy().tobytes()
    shard = os.path.join(latest, open(os.path.join(latest, "LATEST")).read(), "__1_0.distcp")
    with open(shard, "rb") as f:
        data = f.read()
    at = data.index(last_row)
    with open(shard, "wb") as f:
        f.write(data[:at] + b"\x00\x00\x80\x7f" + data[at + 4:])
dist.barrier()  # no rank looks at the backups before the damage is done
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    again = model()
    again.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0,
              callbacks=[BackupAndRestore(folder, **options)])
warned = any("the latest backup is damaged" in str(w.message) for w in caught)
print(f"rank {RANK} damaged backup: warned {warned}, resumed from step "
      f"{again.history.params['resumed']['step']}", flush=True)
keep("backup-damaged-resumed", again)
if RANK == 0:  # rank 0 alone (the host is whole since fit's end)
    whole.export(os.path.join(OUT, "fsdp.pt2"), x[:4])
print(f"rank {RANK} fsdp checkpoint done", flush=True)
