"""The per-replica routine on worker threads: waits released on failure, the caller's
context carried into each thread, random draws judged on every generator, torch.compile's
first calls one thread at a time, and the loss weights on each slice's device."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import fitdp
from fitdp.call.ranks import Ranks
from fitdp.call.replicas import Placement, Replicas
from fitdp.compiled.losses import Objective
from fitdp.data.batch import DataBatch
from fitdp.executor import DataParallelExecutorManager
from fitdp.executor.replica import Executor
from fitdp.executor.step import Job
from fitdp.executor.weighing import Weighing


def dropout_manager(devices: list[str] | None = None) -> DataParallelExecutorManager:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    return DataParallelExecutorManager(net, devices or ["cpu", "cpu"],
                                       loss=Objective("cross_entropy"))


def batch(rows: int = 8) -> DataBatch:
    g = torch.Generator().manual_seed(1)
    return DataBatch(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g))


def ends_within(fn, seconds: float = 30.0) -> BaseException | None:
    """Run ``fn`` on a thread; fail the test if it is still running after ``seconds``."""
    out: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            out[0] = err

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the step hung"
    return out[0]


def broken_load(*args, **kwargs) -> None:
    raise RuntimeError("out of memory while growing an input buffer")


@pytest.mark.parametrize("path", ["run_batch", "stepwise"])
def test_a_failing_load_never_leaves_the_next_replica_waiting_for_its_turn(path):
    """Regression (issue 21 item 2): with dropout, replicas sharing a device take turns; a
    replica 0 whose load raised never signalled its turn, and replica 1 (and the caller)
    waited for ever."""
    mgr = dropout_manager()
    opt = torch.optim.SGD(mgr.master_parameters(), lr=0.1)
    mgr.run_batch(batch(), True, zero_grad=True, optimizer=opt)  # in turn from here on
    assert mgr.execgrp.stochastic is True
    mgr.execgrp.executors[0].load = broken_load

    def step() -> None:
        if path == "run_batch":
            mgr.run_batch(batch(), True, zero_grad=True, optimizer=opt)
        else:
            mgr.load_data_batch(batch())
            mgr.forward(is_train=True)

    err = ends_within(step)
    assert isinstance(err, RuntimeError) and "out of memory" in str(err)
    del mgr.execgrp.executors[0].load  # the executor's own again: the threads still serve
    assert ends_within(lambda: mgr.run_batch(batch(), True, zero_grad=True, optimizer=opt)) \
        is None
    mgr.close()


class Records(nn.Module):
    """Records what each thread sees while running forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return self.lin(x)


def test_worker_threads_run_under_the_callers_autocast():
    """Regression (issue 21 item 3): autocast is per thread; device 1's worker ran outside
    the caller's torch.autocast, so the replicas computed in different precisions."""
    mgr = DataParallelExecutorManager(Records(), ["cpu", "cpu"], loss=Objective("cross_entropy"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mgr.run_batch(batch(), False)
    seen = [s for ex in mgr.execgrp.executors for s in ex.module.seen]
    assert seen == [(True, torch.bfloat16)] * 2
    mgr.close()


def test_the_random_draw_probe_reads_every_generator(monkeypatch):
    """Regression (issue 21 item 8): the probe compared only the CPU generator, so a module
    drawing CUDA random numbers without a listed layer was judged non-random."""
    from fitdp.executor.group import DataParallelExecutorGroup

    draws = iter(range(1000))
    # What a module drawing only from the devices' (CUDA) generators does: every state read
    # differs, while the CPU generator does not move.
    monkeypatch.setattr(DataParallelExecutorGroup, "_rng_states",
                        lambda self: [torch.tensor([next(draws)])])
    mgr = DataParallelExecutorManager(nn.Linear(6, 3), ["cpu", "cpu"],
                                      loss=Objective("cross_entropy"))
    mgr.run_batch(batch(), True)
    assert mgr.execgrp.stochastic is True
    mgr.close()


def test_first_compiled_calls_run_one_thread_at_a_time(monkeypatch):
    """Issue 21 item 9: each replica's graphs compile one thread at a time (dynamo and
    inductor keep process-wide state); cached shapes run at once."""
    import fitdp.executor.replica as executor

    monkeypatch.setattr(executor, "raise_recompile_limit", lambda entries: None)
    mgr = DataParallelExecutorManager(nn.Linear(6, 3), ["cpu", "cpu"],
                                      loss=Objective("cross_entropy"))
    inside, most = [0], [0]
    lock = threading.Lock()

    def slow_first_call(ex: Executor):
        def fn(x: torch.Tensor) -> torch.Tensor:
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)  # a compile: long enough for the other thread to arrive
            with lock:
                inside[0] -= 1
            return ex.module(x)
        return fn

    for ex in mgr.execgrp.executors:
        ex.compiled, ex.plain, ex.fn = True, False, slow_first_call(ex)
    mgr.run_batch(batch(), True)  # the random-draw probe: forwards in turn
    assert mgr.execgrp.stochastic is False
    most[0] = 0
    mgr.run_batch(batch(10), True)  # a new shape, both replicas at once
    assert most[0] == 1
    mgr.close()


def test_cuda_graphs_from_several_threads_are_refused_before_torch_2_13(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    with pytest.raises(ValueError, match="compile: got 'reduce-overhead'.*torch 2.13"):
        DataParallelExecutorManager(nn.Linear(6, 3), ["cpu", "cpu"], compile="reduce-overhead")


def test_a_rows_total_on_device_0_weighs_each_slice_on_its_own_device():
    """Issue 21 item 6: under torchrun the rows summed over ranks are a tensor on device 0;
    each device's weight is moved to that device (same numbers)."""
    executors = [Executor(nn.Linear(6, 3), torch.device("cpu"), {}) for _ in range(2)]
    job = Job(executors)
    b = batch(8)
    job.set(b, 8, 0, [slice(0, 3), slice(3, 8)])
    Weighing(None, [ex.device for ex in executors], ranks=True).weigh(job, torch.tensor(16.0))
    assert [float(w) for w in job.weights] == [3 / 16, 5 / 16]
    assert all(w.device == ex.device for w, ex in zip(job.weights, executors))


@pytest.mark.requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_rows_weights_follow_their_cuda_devices():
    executors = [Executor(nn.Linear(6, 3).to(f"cuda:{d}"), torch.device(f"cuda:{d}"), {})
                 for d in range(2)]
    job = Job(executors)
    job.set(batch(8), 8, 0, [slice(0, 4), slice(4, 8)])
    Weighing(None, [ex.device for ex in executors], ranks=True).weigh(
        job, torch.tensor(16.0, device="cuda:0"))
    assert [w.device for w in job.weights] == [torch.device("cuda:0"), torch.device("cuda:1")]


@pytest.mark.requires_cuda
def test_worker_threads_enter_their_device_and_the_callers_stream():
    """Issue 21 item 3: the current stream is per thread; a worker ran on the default
    stream, unordered against the caller's ``torch.cuda.stream(s)``."""
    seen: list[tuple[int, int]] = []

    class Where(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((torch.cuda.current_device(), torch.cuda.current_stream().stream_id))
            return self.lin(x)

    mgr = DataParallelExecutorManager(Where(), ["cuda:0", "cuda:0"])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        mgr.run_batch(batch(), False)
    assert seen == [(0, stream.stream_id)] * 2
    mgr.close()


def test_sync_batchnorm_with_several_devices_per_rank_is_refused():
    """Issue 21 item 6: SyncBatchNorm from several replica threads of one rank issues
    all_gather on one process group at once (a hang) and covers one thread per rank."""
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)))
    model.compile(optimizer="sgd", loss="mse", sync_batchnorm=True)
    placement = Placement(devices=(torch.device("cpu"),) * 2, work_load_list=(1.0, 1.0),
                          ranks=Ranks(rank=0, world_size=2))  # read only: nothing joined
    with pytest.raises(ValueError, match="sync_batchnorm=True.*one device per rank"):
        Replicas(model.module, None, placement, model._compiled)
