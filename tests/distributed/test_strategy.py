"""compile(strategy=...): checked when compiled, combinations that cannot work refused when a
call attaches (before any weight changes), and the engines' gradient arithmetic (issue 20)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from test_distributed import launch
from torch import nn

import fitdp
from fitdp import DDP, FSDP
from fitdp.executor.ddp import DDPEngine
from fitdp.executor.engines import engine_for
from fitdp.executor.fsdp import FSDPEngine, _blocks
from fitdp.executor.local_reduce import LocalReduce
from fitdp.saving.sharded import load_sharded

CPU = torch.device("cpu")


@pytest.mark.parametrize("bad, error", [("zero", ValueError), (3, ValueError),
                                        (FSDP(blocks=("Linear",)), TypeError)])
def test_compile_refuses_an_unknown_strategy(bad, error):
    model = fitdp.Model(nn.Linear(3, 2))
    with pytest.raises(error, match="strategy"):
        model.compile(optimizer="sgd", loss="mse", strategy=bad)
    assert model._compiled is None  # nothing kept


def kind(engine) -> tuple[type, object]:
    return type(engine), getattr(engine, "options", getattr(engine, "distributed", None))


def test_auto_is_ddp_for_one_device_per_rank_and_fitdps_own_reduction_otherwise():
    assert kind(engine_for("auto", [CPU], 2)) == (DDPEngine, DDP())
    # several local devices: replicas, summed locally, then across the ranks
    assert kind(engine_for("auto", [CPU, CPU], 2)) == (LocalReduce, True)
    assert kind(engine_for("auto", [CPU], 1)) == (LocalReduce, False)
    # each bucket its own module
    assert kind(engine_for("auto", [CPU], 2, bucketed=True)) == (LocalReduce, True)
    assert kind(engine_for("fsdp", [CPU], 4)) == (FSDPEngine, FSDP())
    options = FSDP(blocks=(nn.Linear,))
    assert engine_for(options, [CPU], 2).options is options
    assert engine_for("auto", [CPU], 2) is not engine_for("auto", [CPU], 2)  # one per call


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", FSDP()])
def test_ddp_and_fsdp_with_several_local_devices_are_refused(strategy):
    with pytest.raises(ValueError, match=r"2 local devices in one process.*one device per rank"):
        engine_for(strategy, [CPU, CPU], 2)


def test_ddp_and_fsdp_with_a_bucket_module_are_refused():
    with pytest.raises(ValueError, match="bucket_module"):
        engine_for("ddp", [CPU], 2, bucketed=True)


def test_ddp_in_one_process_is_refused_before_a_weight_moves():
    model = fitdp.Model(nn.Linear(3, 2))
    model.compile(optimizer="sgd", lr=1.0, loss="mse", strategy="ddp")
    before = [p.detach().clone() for p in model.module.parameters()]
    with pytest.raises(ValueError, match=r"strategy='ddp'.*one process.*torchrun"):
        model.fit(torch.randn(8, 3), torch.randn(8, 2), batch_size=4, verbose=0,
                  devices=["cpu"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))


def test_fsdp_blocks_leave_tied_weights_to_the_root():
    """Regression: strategy='fsdp' on GPT-2 124M (lm_head tied to the token embedding, each
    a subtree over min_params) failed its first batch: FSDP2 refused 'lm_head.weight' as
    shared with a parameter another FSDP group manages (then the blocks' ModuleList as a
    container without a forward)."""
    transformers = pytest.importorskip("transformers")

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512,
                                     n_positions=16)
    net = transformers.GPT2LMHeadModel(config)
    blocks = _blocks(net, FSDP(min_params=4000))
    names = {m: n for n, m in net.named_modules()}
    assert net.lm_head not in blocks and net.transformer not in blocks
    assert net.transformer.wte not in blocks
    # the untied subtrees; transformer.h is a ModuleList, which fully_shard refuses
    assert [names[b] for b in blocks] == ["transformer.h.0", "transformer.h.1"]
    tied = {id(net.lm_head.weight)}
    for b in blocks:
        assert not tied & {id(p) for p in b.parameters()}


def test_fsdp_blocks_by_class_or_by_size():
    net = nn.Sequential(nn.Linear(8, 64), nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
                        nn.Linear(64, 2))
    assert _blocks(net, FSDP(blocks=(nn.Linear,))) == [net[0], net[1][0], net[2]]
    assert _blocks(net, FSDP(min_params=1000)) == [net[1]]  # outermost large subtree only


ENGINE_WORKER = os.path.join(os.path.dirname(__file__), "engine_worker.py")


@pytest.fixture(scope="module")
def sharded_job(shared_ranks):
    """One 2-rank run for every engine check (in the tests' shared torchrun job)."""
    run = shared_ranks(ENGINE_WORKER)
    assert run.code == 0, run.output
    assert run.output.count("engines ok") == 2 and \
        run.output.count("sharded checkpoint ok") == 2, run.output
    return run.out


@pytest.mark.distributed
@pytest.mark.ranks_script(ENGINE_WORKER)
def test_ddp_and_fsdp_sum_uneven_ranks_into_the_whole_batch_gradient(sharded_job):
    """(The worker asserts the gradients; this names the check.)"""
    assert (sharded_job / "sync" / "LATEST").read_text() == "step-1"


@pytest.mark.distributed
@pytest.mark.ranks_script(ENGINE_WORKER)
def test_a_two_rank_sharded_checkpoint_loads_in_one_process(sharded_job):
    """The folder 2 FSDP2 ranks wrote (shards of the model and of Adam's state, the second
    save at step 2 async) loads in a process with no process group as whole tensors: the
    ranks' shards gathered, and Adam's state loads into a plain module's optimizer."""
    full = torch.load(sharded_job / "full.pt", weights_only=True)
    state = load_sharded(sharded_job / "ckpt")
    assert state["module"].keys() == full["module"].keys()
    for k, v in state["module"].items():
        assert torch.equal(v, full["module"][k]), k
    module = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    module.load_state_dict(state["module"])
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    opt.load_state_dict(state["optimizer"])
    for i, s in opt.state_dict()["state"].items():
        assert s["step"] == 1
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[k], full["optimizer"][i][k]), (i, k)
    assert sorted(p.name for p in (sharded_job / "ckpt").iterdir()) == ["LATEST", "step-2"]


def one_process(optimizer: str, accum: int, clip: float | None, precision: str,
                rows: int = 44) -> dict:
    """strategy_worker.py's fit in one process on the whole global batch of 10."""
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)))
    model.compile(optimizer=optimizer, lr=0.05, loss="cross_entropy", grad_accum_steps=accum,
                  grad_clip_norm=clip, precision=precision)
    model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, devices=["cpu"])
    return model.get_weights()


@pytest.fixture(scope="module")
def strategy_job(tmp_path_factory):
    """One 2-rank launch for every fit-level case (each strategy, each setup)."""
    out = tmp_path_factory.mktemp("strategies")
    worker = os.path.join(os.path.dirname(__file__), "strategy_worker.py")
    code, output, _ = launch("", out, script=[
        worker, str(out), "ddp,fsdp,fsdp-blocks,hybrid"], limit=240)
    assert code == 0, output
    return out, output


# (name, one_process's setup, tolerance): strategy_worker.py's SETUPS
SETUPS = [("sgd", ("sgd", 1, None, "32"), 1e-5),
          ("adamw", ("adamw", 2, 0.05, "bf16-mixed"), 2e-2),
          ("adamw32", ("adamw", 3, 0.05, "32"), 1e-4)]


def assert_equals_one_process(out, strategy: str, rows: int = 44) -> None:
    for name, setup, tol in SETUPS:
        got = torch.load(out / f"{strategy}-{name}.pt", weights_only=True)
        for k, v in one_process(*setup, rows=rows).items():
            torch.testing.assert_close(got[k], v, rtol=tol, atol=tol,
                                       msg=f"{strategy} {name} {k}")


@pytest.mark.distributed
def test_ddp_fit_equals_one_process_on_the_whole_batch(strategy_job):
    """fit under strategy='ddp' (the rank's replica in DistributedDataParallel, bound by fit)
    equals one process on the global batches: SGD; AdamW with accumulation, clipping, bf16."""
    out, output = strategy_job
    # one engine per call: 3 setups under each of 4 strategies
    engines = "engines ['DDPEngine', 'FSDPEngine', 'LocalReduce'] chosen 12 times"
    assert output.count(engines) == 2, output
    # Regression: the models' DDP reducers outlived the process group at exit (a rank can
    # abort there: "terminate called without an active exception").
    assert output.count("DDP wrappers alive at teardown: 0") == 2, output
    assert_equals_one_process(out, "ddp")


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp-blocks"])
def test_fsdp_fit_equals_one_process_on_the_whole_batch(strategy_job, strategy):
    """fit under strategy='fsdp' (was refused: "not yet bound into fit"): the rank's replica
    sharded by FSDP2 (the root alone by the size rule, or each Linear named by
    FSDP(blocks=...)), Adam's state in shards, gradients summed by reduce-scatter, clipping
    on the whole norm, equals one process on the global batches (rank 0's get_weights,
    gathered at fit's end)."""
    out, output = strategy_job
    assert output.count("sharded parameters per replica [4, 4, 4, 4, 4, 4]") == 2, output
    assert output.count(f"{strategy} optimizer state in shards: 8 of 12") == 2, output
    assert_equals_one_process(out, strategy)


@pytest.mark.distributed
def test_hybrid_fit_equals_one_process_on_the_whole_batch(strategy_job):
    """Two CPU replicas per rank (DDP cannot wrap them): summed locally into three flat
    buckets of different sizes, each all-reduced across the ranks after backward, equals
    one process on the global batches: SGD; AdamW with accumulation and clipping (bf16 too);
    empty shares and an epoch's tail step."""
    out, _ = strategy_job
    assert_equals_one_process(out, "hybrid", rows=41)


def test_ddp_wrap_triggers_no_broadcast_buffers_deprecation(tmp_path):
    """Every DDP rank printed torch's "FutureWarning: broadcast_buffers is deprecated"
    (torch 2.13 renamed it forward_sync_buffers); the wrap now spells it the new way and
    still leaves buffers to fitdp (no sync in forward)."""
    from fitdp.executor.ddp import wrap_ddp

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            ddp = wrap_ddp(nn.BatchNorm1d(3), CPU, DDP())
        assert getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) \
            is False
    finally:
        torch.distributed.destroy_process_group()
