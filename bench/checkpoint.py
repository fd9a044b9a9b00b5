"""Checkpoint saves: synchronous against torch.save, asynchronous against training alone.

Run: python bench/checkpoint.py [--repeats 7] [--rounds 8] [--stall-paths one,ddp,fsdp]
     [--dir DIR] [--json out.json] [--quick] [--no-pin]

The state is an MLP 4096-4096-2048 (25.2M parameters) and its Adam state after one real step:
``{"module": net.state_dict(), "optimizer": opt.state_dict()}``, about 302 MB.

(b) Synchronous: ``saving.checkpoint.save_checkpoint`` against a bare ``torch.save`` and against
    ``torch.save`` + ``fsync`` of the file, interleaved (the first case rotates), each save to a
    new file (deleted afterwards, untimed), ``os.sync()`` before each timed save so no earlier
    write-back lands in its time. Target: save_checkpoint <= 1.05x torch.save + fsync (median
    of the per-round ratios).
(a) Asynchronous: the training time lost per ``model.save(path, async_save=True)`` against the
    time a synchronous ``model.save(path)`` costs, inside one ``Model.fit`` (rounds of K steps
    alone, K steps after an async save, a sync save and K steps, paired per round): in one
    process and, in a full run, under torchrun with ``"ddp"`` and ``"fsdp"`` (2 ranks).
    ``bench/save_stall.py`` measures it and says how. Target: median lost / median sync cost
    <= 0.10 on every path.
Also ``DataParallelExecutorManager(module, ["cpu", "cpu"]).copy_to`` into preallocated host
tensors against a large ``dst.copy_(src)`` (bandwidth = bytes read + written).

One torch thread (intra- and inter-op). Unless ``--no-pin``, the timing thread of (b) runs on
the first CPU of the process's set. The output records the CPU, the folder's file system and
the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench this checkout's fitdp
from bench import save_stall  # noqa: E402
from fitdp.executor.manager import DataParallelExecutorManager  # noqa: E402
from fitdp.saving.checkpoint import save_checkpoint  # noqa: E402

SYNC_TARGET = 1.05  # save_checkpoint / (torch.save + fsync), at most
COPY_TARGET = 0.5  # copy_to bandwidth / memcpy bandwidth, at least
State = dict[str, object]


def mlp(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Trainer:
    """An MLP with Adam; ``step()`` is one training step on a fixed batch."""

    def __init__(self, sizes: list[int], batch: int) -> None:
        self.net = mlp(sizes)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-4)
        self.x = torch.randn(batch, sizes[0])
        self.y = torch.randint(0, sizes[-1], (batch,))
        self.step()  # Adam's state exists after the first step

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(self.net(self.x), self.y).backward()
        self.opt.step()

    def state(self) -> State:
        return {"module": self.net.state_dict(), "optimizer": self.opt.state_dict()}


@contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Run the calling thread (only) on ``cpu``; threads it starts inherit that."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # pid 0: this thread, on Linux
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def torch_save(path: str, state: State) -> None:
    torch.save(state, path)


def torch_save_fsync(path: str, state: State) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


SYNC_CASES: dict[str, Callable[[str, State], None]] = {
    "fitdp save_checkpoint": save_checkpoint,
    "bare torch.save": torch_save,
    "torch.save + fsync": torch_save_fsync,
}


def bench_sync(state: State, folder: str, repeats: int, cpu: int | None) -> dict[str, object]:
    """Median seconds per save of each case, and the median per-round ratio to fsync."""
    names = list(SYNC_CASES)
    times: dict[str, list[float]] = {n: [] for n in names}
    size = 0
    for r in range(repeats + 1):  # round 0 warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            path = os.path.join(folder, f"sync-{names.index(name)}.ckpt")
            os.sync()
            with pinned(cpu):
                t = time.perf_counter()
                SYNC_CASES[name](path, state)
                dt = time.perf_counter() - t
            size = os.path.getsize(path)
            os.remove(path)  # every save writes a new file
            if r:
                times[name].append(dt)
    os.sync()
    fitdp, fsync = times["fitdp save_checkpoint"], times["torch.save + fsync"]
    return {"median_s": {n: statistics.median(times[n]) for n in names}, "runs_s": times,
            "bytes": size,
            "fsync_ratio": statistics.median(a / b for a, b in zip(fitdp, fsync)),
            "bare_ratio": statistics.median(
                a / b for a, b in zip(fitdp, times["bare torch.save"]))}


def timed_median(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up: touches every page of the destination
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_copy_to(sizes: list[int], memcpy_bytes: int, repeats: int) -> dict[str, float]:
    """copy_to from 2 CPU replicas and a memcpy, interleaved: seconds and GB/s (read+write)."""
    module = mlp(sizes)
    mgr = DataParallelExecutorManager(module, ["cpu", "cpu"])
    try:
        arg = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
        aux = {n: torch.zeros_like(b) for n, b in module.named_buffers()}
        weight_bytes = sum(t.numel() * t.element_size() for t in [*arg.values(), *aux.values()])
        src = torch.ones(memcpy_bytes // 4)
        dst = torch.zeros_like(src)
        copy_t, mem_t = [], []
        for _ in range(max(1, repeats // 3)):  # a few interleaved rounds of medians
            copy_t.append(timed_median(lambda: mgr.copy_to(arg, aux), 3))
            mem_t.append(timed_median(lambda: dst.copy_(src), 3))
        for name, replicas in zip(mgr.param_names, mgr.param_arrays):  # sanity: it averaged
            torch.testing.assert_close(arg[name], (replicas[0] + replicas[1]) / 2)
    finally:
        mgr.close()
    ct, mt = statistics.median(copy_t), statistics.median(mem_t)
    copy_bytes = 3 * weight_bytes  # reads 2 replicas, writes 1 host copy
    return {
        "copy_to s": ct, "copy_to bytes": float(copy_bytes), "copy_to GB/s": copy_bytes / ct / 1e9,
        "memcpy s": mt, "memcpy bytes": float(2 * src.nbytes),
        "memcpy GB/s": 2 * src.nbytes / mt / 1e9,
    }


def machine(folder: str) -> dict[str, object]:
    """The CPU, the CPUs this process may use, and the file system holding ``folder``."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    fs, best = "?", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, kind = line.split()[:3]
                if os.path.realpath(folder).startswith(mount) and len(mount) > len(best):
                    fs, best = kind, mount
    except OSError:
        pass
    return {"cpu": cpu, "cpus": sorted(os.sched_getaffinity(0)), "fs": f"{fs} on {best}",
            "loadavg": list(os.getloadavg()), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None,
                        help="folder for the checkpoint files (default: a new temp folder)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="small model, 2 repeats: a smoke run")
    parser.add_argument("--no-pin", action="store_true", help="leave threads to the OS")
    parser.add_argument("--rounds", type=int, default=8,
                        help="rounds of the async-save stall (bench/save_stall.py)")
    parser.add_argument("--stall-paths", default=None,
                        help="its paths: one, ddp, fsdp (default: all; one under --quick)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    if args.quick:
        sizes, batch, memcpy_bytes, repeats = [256, 256, 64], 8, 8 << 20, 2
        stall_config, rounds, paths = save_stall.QUICK, 2, args.stall_paths or "one"
    else:  # 4096*4096 + 4096*2048 weights: 25.2M parameters, ~100 MB; Adam adds 2x that
        sizes, batch, memcpy_bytes, repeats = [4096, 4096, 2048], 32, 400 << 20, args.repeats
        stall_config, rounds = save_stall.FULL, args.rounds
        paths = args.stall_paths or "one,ddp,fsdp"
    cpu = None if args.no_pin else min(os.sched_getaffinity(0))
    folder = tempfile.mkdtemp(prefix="fitdp-bench-", dir=args.dir)
    info = machine(folder)
    trainer = Trainer(sizes, batch)
    n_params = sum(p.numel() for p in trainer.net.parameters())
    print(f"CPU {info['cpu']}, CPUs {info['cpus']}; {info['fs']}; load average "
          f"{' '.join(f'{x:.2f}' for x in info['loadavg'])}; torch {info['torch']}, 1 thread"
          f"{'' if cpu is None else f', timing thread pinned to CPU {cpu}'}")
    print(f"MLP {'-'.join(map(str, sizes))}: {n_params / 1e6:.2f}M parameters + Adam; "
          f"{repeats} repeats")
    try:
        sync = bench_sync(trainer.state(), folder, repeats, cpu)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    del trainer  # its 300 MB are not needed by the fits below
    copies = bench_copy_to(sizes, memcpy_bytes, repeats)
    print(f"\n(a) async saves inside Model.fit: blocks of {stall_config['steps']} steps, "
          f"{rounds} rounds (bench/save_stall.py); load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    stall = {}
    for path in paths.split(","):
        stall[path] = save_stall.run_path(path, stall_config, rounds, 600.0)
        print(save_stall.line(save_stall.NAMES[path], stall[path]), flush=True)

    med = sync["median_s"]
    assert isinstance(med, dict)
    print(f"\n(b) synchronous saves, {sync['bytes'] / 1e6:.1f} MB, medians (every run in ms)")
    for name, runs in sync["runs_s"].items():  # type: ignore[attr-defined]
        print(f"  {name:<24} {med[name] * 1e3:8.1f} ms   "
              f"[{', '.join(f'{t * 1e3:.0f}' for t in runs)}]")
    print(f"\n{'case':<34} {'median':>10} {'MB r+w':>8} {'GB/s':>8}")
    for name, key in (("copy_to, 2 CPU replicas -> host", "copy_to"),
                      ("memcpy dst.copy_(src)", "memcpy")):
        print(f"{name:<34} {copies[key + ' s'] * 1e3:8.2f} ms {copies[key + ' bytes'] / 1e6:8.1f} "
              f"{copies[key + ' GB/s']:8.2f}")

    fsync_ratio, bare_ratio = float(sync["fsync_ratio"]), float(sync["bare_ratio"])  # type: ignore[arg-type]
    copy_ratio = copies["copy_to GB/s"] / copies["memcpy GB/s"]
    print(f"\nsave ratio (fitdp / torch.save + fsync):        {fsync_ratio:.3f}x (target <= "
          f"{SYNC_TARGET:.2f}) {'met' if fsync_ratio <= SYNC_TARGET else 'MISSED'}")
    for path, res in stall.items():
        print(f"async lost per save / sync save, {path:<4}:        {res['ratio']:.3f} (target <= "
              f"{save_stall.TARGET:.2f}) {'met' if res['ratio'] <= save_stall.TARGET else 'MISSED'}"
              f"; per round IQR {res['round_ratio_quartiles'][0]:.3f} to "
              f"{res['round_ratio_quartiles'][2]:.3f}")
    print(f"save ratio (fitdp / bare torch.save):          {bare_ratio:.3f}x (reference: fitdp "
          f"fsyncs file and folder, bare torch.save leaves the data in the page cache)")
    print(f"copy_to bandwidth ratio (copy_to / memcpy):     {copy_ratio:.3f}x (target >= "
          f"{COPY_TARGET:.2f}) {'met' if copy_ratio >= COPY_TARGET else 'MISSED'}")
    if args.quick:
        print("(quick smoke run: the model is tiny and the memcpy fits in cache, so the "
              "targets apply to the full run only)")
    if args.json:
        out = {**info, "sizes": sizes, "params": n_params, "repeats": repeats, "batch": batch,
               "sync": sync, "stall": stall, "stall_rounds": rounds, "copy": copies,
               "save_ratio": bare_ratio, "save_fsync_ratio": fsync_ratio,
               "async_lost_ratio": {p: r["ratio"] for p, r in stall.items()},
               "copy_bandwidth_ratio": copy_ratio, "loadavg_after": list(os.getloadavg())}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
