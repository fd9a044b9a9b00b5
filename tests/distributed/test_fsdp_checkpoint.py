"""Checkpoints under strategy="fsdp" (issue 20, item 3): sharded saves through DCP from
model.save, ModelCheckpoint and BackupAndRestore; resumed bitwise on 2 ranks, loaded in one
process and on 3 ranks; atomic under SIGKILL."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
import torch
from test_distributed import launch
from torch import nn

import fitdp
from fitdp.callbacks import BackupAndRestore
from fitdp.saving.checkpoint import load_checkpoint
from fitdp.saving.sharded import load_sharded, save_sharded

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_checkpoint_worker.py")
pytestmark = pytest.mark.ranks_script(WORKER)  # fsdp_checkpoint's run (the others launch)


@pytest.fixture(scope="module")
def fsdp_checkpoint(shared_ranks):
    run = shared_ranks(WORKER)  # the shared job's 2 ranks run fsdp_checkpoint_worker.py
    assert run.code == 0, run.output
    assert run.output.count("fsdp checkpoint done") == 2, run.output
    return run.out, run.output


@pytest.fixture(scope="module")
def resharded(fsdp_checkpoint):
    """The 2-rank checkpoint loaded by 3 ranks, saved again in 3 shards, resumed from."""
    out, _ = fsdp_checkpoint
    code, output, _ = launch("", out, script=[WORKER, str(out), "reshard"], limit=120,
                             nproc=3)
    assert code == 0, output
    assert output.count("reshard done") == 3, output
    return out


def weights(out, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.pt", weights_only=True)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str):
    assert got.keys() == want.keys(), what
    assert all(torch.equal(got[k], v) for k, v in want.items()), what


def one_process(checkpoint=None) -> fitdp.Model:
    """The worker's model in one process, loaded from ``checkpoint``."""
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)))
    model.compile(optimizer="adamw", lr=0.05, loss="cross_entropy", grad_accum_steps=2,
                  grad_clip_norm=0.05)
    if checkpoint is not None:
        model.load(checkpoint)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


@pytest.mark.distributed
def test_an_fsdp_checkpoint_resumes_on_two_ranks_bitwise(fsdp_checkpoint):
    """model.save under strategy='fsdp' on every rank: sharded by default (each rank wrote
    its shards, rank 0 the rest), with async_save=True, and one whole-tensor file
    (sharded=False, the format every earlier fitdp wrote): a new 2-rank fit resumed from
    each ends bit for bit where the uninterrupted fit did."""
    out, _ = fsdp_checkpoint
    # Named after the global step (was step-1: it counted saves): the first epoch's 40 rows
    # are 4 global batches of 10 (5 a rank), 2 accumulated per optimizer step.
    step = out / "fsdp.ckpt" / "step-2"
    assert (out / "fsdp.ckpt" / "LATEST").read_text() == "step-2"
    assert sorted(p.name for p in step.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "state.ckpt"]
    rest = load_checkpoint(step / "state.ckpt")  # rank 0's part: references, no weights
    assert rest["module"]["0.weight"]["shape"] == [32, 6] and "run" in rest
    assert not any(isinstance(v, torch.Tensor) for v in rest["module"].values())
    assert (out / "fsdp-whole.ckpt").is_file()
    whole = weights(out, "uninterrupted")
    for saved in ("resumed", "resumed-async", "resumed-whole"):
        assert_equal(weights(out, saved), whole, saved)


@pytest.mark.distributed
def test_backup_and_restore_with_fsdp_resumes_an_interrupted_fit_bitwise(fsdp_checkpoint):
    """BackupAndRestore under strategy='fsdp' (was refused: it saved from rank 0 alone, and
    gathering the shards is a collective): every rank backs up, sync and async; a fit
    interrupted on every rank after its 3rd optimizer step (mid-epoch), run again, resumes
    from the backup and ends bit for bit where the uninterrupted fit did (async: with
    double_checkpoint, the previous backup's folder kept beside it)."""
    out, output = fsdp_checkpoint
    rotated = {"backup": "['backup.ckpt']", "backup-async": "['backup.ckpt', 'backup.prev.ckpt']"}
    for name, backups in rotated.items():
        # a new folder per backup with double_checkpoint (the previous one moved aside)
        steps = "['LATEST', 'step-3']"  # the global step, in a new folder or the same
        assert f"{name} crashed; backups: {backups}, latest: {steps}" in output, output
        assert f"{name} deleted after the fit: True" in output, output
        assert_equal(weights(out, f"{name}-resumed"), weights(out, "uninterrupted"), name)


@pytest.mark.distributed
def test_a_damaged_sharded_backup_under_fsdp_falls_back_on_every_rank(fsdp_checkpoint):
    """double_checkpoint under strategy='fsdp', the latest backup (step 3) with inf written
    over a weight in rank 1's shard file: every rank warns and resumes from the previous
    backup (step 2), ending bit for bit where the uninterrupted fit did (was: resumed from
    the damaged backup without a word; docs/callbacks.md promises the fallback)."""
    out, output = fsdp_checkpoint
    for rank in (0, 1):
        assert f"rank {rank} damaged backup: warned True, resumed from step 2" in output, output
    assert_equal(weights(out, "backup-damaged-resumed"), weights(out, "uninterrupted"),
                 "backup-damaged")


@pytest.mark.distributed
def test_a_killed_fsdp_rank_restarts_from_the_sharded_backup_bitwise(fsdp_checkpoint):
    """torchrun --max-restarts 1: rank 1 is SIGKILLed just after its 3rd step's async sharded
    backup started; the restarted job resumes from the last complete backup and ends bit for
    bit where the uninterrupted fit did."""
    out, _ = fsdp_checkpoint
    code, output, _ = launch("", out, script=[WORKER, str(out), "restart"], max_restarts=1,
                             limit=120)
    assert code == 0, output
    assert (out / "killed").exists()  # rank 1 really died once
    assert_equal(weights(out, "killed-resumed"), weights(out, "uninterrupted"), "restart")
    # Regression (issue 28.4): the resumed epoch's loss was off (rank 0's running sums came
    # back on every rank); History holds the uninterrupted run's numbers.
    want = torch.load(out / "uninterrupted-history.pt", weights_only=True)
    got = torch.load(out / "killed-resumed-history.pt", weights_only=True)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)


@pytest.mark.distributed
def test_model_checkpoint_with_fsdp_keeps_sharded_checkpoints(fsdp_checkpoint):
    """ModelCheckpoint under strategy='fsdp' (was refused), async, keep=1: the last epoch's
    sharded checkpoint remains (the first one pruned) and holds the fit's final weights."""
    out, _ = fsdp_checkpoint
    assert not (out / "mc-1.ckpt").exists() and (out / "mc-2.ckpt" / "LATEST").is_file()
    assert_equal(one_process(out / "mc-2.ckpt").get_weights(), weights(out, "uninterrupted"),
                 "mc-2.ckpt")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fsdp.ckpt", "fsdp-whole.ckpt"])
def test_an_fsdp_checkpoint_loads_and_resumes_in_one_process(fsdp_checkpoint, name):
    """A 2-rank FSDP checkpoint, sharded or whole: a single-process Model loads the weights
    rank 0's get_weights gave, and resumes to the 2-rank run's end (allclose)."""
    out, _ = fsdp_checkpoint
    model = one_process(out / name)
    assert_equal(model.get_weights(), weights(out, "at-checkpoint"), name)
    x, y = data()
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, devices=["cpu"],
              resume=out / name)
    whole = weights(out, "uninterrupted")
    for k, v in model.get_weights().items():
        torch.testing.assert_close(v, whole[k], rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.distributed
def test_an_fsdp_checkpoint_loads_on_another_world_size(resharded):
    """Saved by 2 ranks, loaded into 3 ranks' shards and saved again by 3: the 3-shard
    checkpoint holds the same weights and AdamW state bit for bit (read in one process), and
    a fit resumed from it on 3 ranks ends where one process on the same global batches of
    15 does (allclose)."""
    out = resharded
    two, three = load_sharded(out / "fsdp.ckpt"), load_sharded(out / "three.ckpt")
    assert_equal(three["module"], two["module"], "module")
    for i, state in two["optimizer"]["state"].items():
        assert_equal(three["optimizer"]["state"][i], state, f"optimizer state {i}")
    assert three["run"] == two["run"]
    model = one_process()
    x, y = data()
    model.fit(x, y, batch_size=15, epochs=2, shuffle=False, verbose=0, devices=["cpu"],
              resume=out / "fsdp.ckpt")
    got = weights(out, "three-resumed")
    for k, v in model.get_weights().items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.distributed
def test_an_fsdp_models_export_holds_the_whole_weights(fsdp_checkpoint):
    out, _ = fsdp_checkpoint
    x = torch.randn(7, 6)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    net.load_state_dict(weights(out, "uninterrupted"))
    torch.testing.assert_close(fitdp.load_predictor(out / "fsdp.pt2")(x), net(x))


KILLED_SAVER = """
import sys, torch
from fitdp.saving.sharded import save_sharded
weight = torch.zeros(1024, 512)
for step in range(1, 1000):
    weight.fill_(step)
    save_sharded(sys.argv[1], {"module": {"weight": weight}, "run": {"step": step}}, step=step)
    print(step, flush=True)
"""


def test_a_sharded_save_killed_at_any_moment_leaves_the_previous_complete_one(tmp_path):
    """SIGKILL lands while the next sharded checkpoint is being written (2 MB of shards and
    rank 0's file per save, no pause): the folder still loads, whole, every value (shards
    and rank 0's part) from one step."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, str(tmp_path / "c")],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(3):
            assert proc.stdout is not None and proc.stdout.readline()
        time.sleep(random.uniform(0, 0.02))  # somewhere inside a later save
    finally:
        proc.kill()
        proc.wait()
    state = load_sharded(tmp_path / "c")
    step = state["run"]["step"]
    assert step >= 3
    assert torch.equal(state["module"]["weight"], torch.full((1024, 512), float(step)))


def test_a_damaged_sharded_backup_falls_back_to_the_previous_one(tmp_path):
    """double_checkpoint with sharded backups (folders): a latest backup whose rank-0 file is
    damaged is set aside and the previous one resumed from."""
    backup = BackupAndRestore(tmp_path / "b", double_checkpoint=True)
    for path, step in ((backup.previous_path, 1), (backup.path, 2)):
        save_sharded(path, {"module": {"w": torch.full((3,), float(step))}, "run": {"s": step}},
                     step=step)
    assert backup.resume_path() == backup.path
    rest = tmp_path / "b" / "backup.ckpt" / "step-2" / "state.ckpt"
    rest.write_bytes(rest.read_bytes()[:-20])  # truncated
    with pytest.warns(UserWarning, match="damaged"):
        assert backup.resume_path() == backup.previous_path
    assert load_sharded(backup.previous_path)["run"] == {"s": 1}
    assert (tmp_path / "b" / "backup.ckpt.damaged" / "LATEST").is_file()
