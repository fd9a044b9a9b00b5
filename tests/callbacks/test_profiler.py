"""Profiler: torch.profiler traces of fit's steps (Lightning's PyTorchProfiler) that parse as
Chrome trace JSON, with fitdp's phases as named ranges on every device thread."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from torch import nn

import fitdp
from fitdp.callbacks import Profiler
from fitdp.executor import DataParallelExecutorManager
from fitdp.executor.step import PLAIN
from fitdp.executor.update import NamedUpdate, Update

PHASE_NAMES = {"fitdp.load", "fitdp.forward", "fitdp.backward", "fitdp.metrics",
               "fitdp.reduce", "fitdp.step"}


def model() -> fitdp.Model:
    torch.manual_seed(0)
    m = fitdp.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    m.compile("adam", "cross_entropy", metrics=["accuracy"])
    return m


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(128, 6, generator=g), torch.randint(0, 3, (128,), generator=g)


def events(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]  # Chrome trace JSON, as Perfetto reads it


def test_profiler_writes_a_trace_with_fitdp_phases_on_every_device_thread(tmp_path):
    prof = Profiler(tmp_path / "prof", wait=1, warmup=1, active=3)
    model().fit(*data(), batch_size=16, verbose=0, callbacks=[prof], devices=["cpu", "cpu"])
    assert len(prof.traces) == 1 and prof.traces[0].endswith(".pt.trace.json")
    found = events(prof.traces[0])
    steps = sorted(e["name"] for e in found if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # after 1 + 1
    by_thread = collections.defaultdict(collections.Counter)
    for e in found:
        if e.get("name") in PHASE_NAMES:
            by_thread[e["tid"]][e["name"]] += 1
    assert set().union(*by_thread.values()) == PHASE_NAMES
    # both replicas' threads, each with its load, forward, backward and metrics per step
    shares = [c for c in by_thread.values() if c["fitdp.forward"] == 3]
    assert len(shares) == 2
    assert all(c["fitdp.load"] == c["fitdp.backward"] == c["fitdp.metrics"] == 3 for c in shares)
    assert sum(c["fitdp.step"] for c in by_thread.values()) == 3  # one optimizer step a batch


def test_profiler_repeats_its_window_and_writes_a_cut_window_at_the_end(tmp_path):
    prof = Profiler(tmp_path, wait=0, warmup=1, active=2, repeat=0)
    model().fit(*data(), batch_size=16, verbose=0, callbacks=[prof])  # 8 batches: 3 windows
    assert len(prof.traces) == 3
    for path in prof.traces:
        assert any(e.get("name") == "fitdp.step" for e in events(path))


def test_a_profiler_running_around_fit_sees_the_phases_too(tmp_path):
    with torch.profiler.profile() as outer:
        model().fit(*data(), batch_size=32, verbose=0)
    outer.export_chrome_trace(str(tmp_path / "t.json"))
    # (one replica in one process has no gradients to reduce: no fitdp.reduce)
    assert PHASE_NAMES - {"fitdp.reduce"} <= {e.get("name") for e in events(str(tmp_path /
                                                                              "t.json"))}


def test_steps_without_a_profiler_run_no_range_code():
    """The step bound for a call without a profiler runs the plain phase functions and the
    plain update: no record_function, not even a disabled one."""
    torch.manual_seed(0)
    mgr = DataParallelExecutorManager(nn.Linear(4, 2), devices=["cpu", "cpu"])
    opt = torch.optim.SGD(mgr.master_parameters(), lr=0.1)
    plain = mgr.bind_step(True, optimizer=opt)
    named = mgr.bind_step(True, optimizer=opt, named=True)
    assert all(r is PLAIN for r in plain.ranges) and type(plain.update) is Update
    assert isinstance(named.update, NamedUpdate) and len(named.ranges) == 2
    assert all(isinstance(c, torch.profiler.record_function) for r in named.ranges for c in r)
    assert named.ranges[0].forward is not named.ranges[1].forward  # one set per thread
    mgr.close()


@pytest.mark.parametrize("kwargs,error,name", [
    ({"wait": -1}, ValueError, "wait"),
    ({"warmup": -1}, ValueError, "warmup"),
    ({"active": 0}, ValueError, "active"),
    ({"repeat": -2}, ValueError, "repeat"),
    ({"wait": 1.5}, TypeError, "wait"),
    ({"dir": 3}, TypeError, "dir"),
    ({"dir": ""}, TypeError, "dir"),
])
def test_profiler_bad_arguments_name_them(kwargs, error, name):
    with pytest.raises(error, match=f"Profiler\\({name}="):
        Profiler(**kwargs)


def test_stop_ends_a_profile_left_by_a_fit_that_raised(tmp_path):
    prof = Profiler(tmp_path, wait=0, warmup=0, active=50)
    m = model()
    x, y = data()
    y[100] = 7  # out of range for 3 classes: refused on the first batch
    with pytest.raises(ValueError):
        m.fit(x, y, batch_size=16, verbose=0, callbacks=[prof])
    prof.stop()
    assert not torch.autograd._profiler_enabled()


TWO_PROFILERS = """
import sys, torch, fitdp
from torch import nn
from fitdp.callbacks import Profiler
torch.manual_seed(0)
m = fitdp.Model(nn.Linear(4, 2))
m.compile("sgd", "cross_entropy")
x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
before = [p.clone() for p in m.module.parameters()]
try:
    m.fit(x, y, batch_size=8, verbose=0, callbacks=[Profiler(sys.argv[1] + "/a"),
                                                    Profiler(sys.argv[1] + "/b")])
except ValueError as err:
    print(err)
print("unchanged", m.global_step == 0 and all(
    torch.equal(a, b) for a, b in zip(before, m.module.parameters())))
"""


def test_two_profilers_in_one_fit_are_refused_instead_of_a_segfault(tmp_path):
    """Issue 37 item 9: two Profiler callbacks started two torch profiler sessions and the
    process died with SIGSEGV (exit 139). Run in a child process so a crash cannot take
    pytest with it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TWO_PROFILERS, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "callbacks: got 2 Profiler callbacks; expected at most one Profiler" in done.stdout
    assert "unchanged True" in done.stdout
    assert not list(tmp_path.iterdir())  # no trace folder made
