"""fitdp's checkpoint save against a bare torch.save, and copy_to against memcpy.

Run: python bench/checkpoint.py [--repeats 7] [--dir DIR] [--json out.json] [--quick]

1. ``Model.save`` of an MLP (~25M parameters, Adam state after one real step, one device)
   against a bare ``torch.save`` of the same model and optimizer state dicts, and against
   ``torch.save`` + ``fsync`` of the file. ``Model.save`` fsyncs the file and its folder
   (durability), so the bare ``torch.save`` only measures the write into the page cache.
   Cases are interleaved, each save writes a new file (deleted afterwards, untimed) and
   ``os.sync()`` runs before each timed save so no earlier write-back lands in its time.
2. ``DataParallelExecutorManager(module, ["cpu", "cpu"]).copy_to`` into preallocated host
   tensors, against a large ``dst.copy_(src)``. Bandwidth = bytes read + bytes written:
   copy_to reads both replicas and writes one host copy (3 x the weights' bytes); the
   memcpy reads and writes its buffer once (2 x its bytes).

Medians of ``--repeats``, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from fitdp.resume import training_state
from torch import nn

import fitdp
from fitdp.executor.manager import DataParallelExecutorManager

SAVE_TARGET = 1.10  # Model.save / bare torch.save, at most
COPY_TARGET = 0.5  # copy_to bandwidth / memcpy bandwidth, at least


def mlp(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def trained_model(sizes: list[int]) -> fitdp.Model:
    """A Model compiled with Adam that took one optimizer step on ["cpu"]."""
    model = fitdp.Model(mlp(sizes))
    model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy")
    x, y = torch.randn(8, sizes[0]), torch.randint(0, sizes[-1], (8,))
    model.fit(x, y, batch_size=8, epochs=1, devices=["cpu"], verbose=0, seed=0)
    if model.global_step < 1 or not model.optimizer.state:  # type: ignore[union-attr]
        raise RuntimeError("the model did not take an optimizer step; nothing to benchmark")
    return model


def bare_state(model: fitdp.Model) -> dict[str, object]:
    return {"module": model.module.state_dict(),
            "optimizer": model.optimizer.state_dict()}  # type: ignore[union-attr]


def bare_save(model: fitdp.Model, path: str) -> None:
    torch.save(bare_state(model), path)


def bare_save_fsync(model: fitdp.Model, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(bare_state(model), f)
        f.flush()
        os.fsync(f.fileno())


def bench_saves(model: fitdp.Model, folder: str, repeats: int) -> dict[str, float]:
    """Median seconds per save of each case, interleaved, rotating which goes first."""
    cases: dict[str, Callable[[fitdp.Model, str], None]] = {
        "fitdp Model.save": lambda m, p: m.save(p),
        "bare torch.save": bare_save,
        "torch.save + fsync": bare_save_fsync,
        # Not a save: the part of Model.save before any I/O (averaging, 1 host clone, RNG).
        "  of which training_state()": lambda m, p: training_state(m),
    }
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    sizes: dict[str, int] = {}
    for r in range(repeats + 1):  # round 0 warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            path = os.path.join(folder, f"bench-{names.index(name)}.ckpt")
            os.sync()  # flush the previous save's dirty pages (and the unlink) outside the timing
            t = time.perf_counter()
            cases[name](model, path)
            dt = time.perf_counter() - t
            if os.path.exists(path):
                sizes[name] = os.path.getsize(path)
                os.remove(path)  # every save writes a new file
            if r:
                times[name].append(dt)
    os.sync()
    return {n: statistics.median(times[n]) for n in names} | {
        f"{n} bytes": float(sizes[n]) for n in sizes
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None,
                        help="folder for the checkpoint files (default: a new temp folder)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="small model, 2 repeats: a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.quick:
        sizes, memcpy_bytes, repeats = [256, 256, 64], 8 << 20, 2
    else:  # 4096*4096 + 4096*2048 weights: 25.2M parameters, ~100 MB; Adam adds 2x that
        sizes, memcpy_bytes, repeats = [4096, 4096, 2048], 400 << 20, args.repeats
    n_params = sum(p.numel() for p in mlp(sizes).parameters())
    load = os.getloadavg()
    print(f"MLP {'-'.join(map(str, sizes))}: {n_params / 1e6:.2f}M parameters; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}, 1 thread; {repeats} repeats")

    folder = tempfile.mkdtemp(prefix="fitdp-bench-", dir=args.dir)
    try:
        saves = bench_saves(trained_model(sizes), folder, repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    copies = bench_copy_to(sizes, memcpy_bytes, repeats)

    base = saves["bare torch.save"]
    print(f"\ncheckpoint folder: {folder} (removed)")
    print(f"{'case':<34} {'median':>10} {'MB':>8} {'vs bare save':>13}")
    for name in ("fitdp Model.save", "  of which training_state()", "bare torch.save",
                 "torch.save + fsync"):
        mb = f"{saves[name + ' bytes'] / 1e6:8.1f}" if name + " bytes" in saves else " " * 8
        print(f"{name:<34} {saves[name] * 1e3:8.1f} ms {mb} {saves[name] / base:12.3f}x")
    print(f"\n{'case':<34} {'median':>10} {'MB r+w':>8} {'GB/s':>8}")
    for name, key in (("copy_to, 2 CPU replicas -> host", "copy_to"),
                      ("memcpy dst.copy_(src)", "memcpy")):
        print(f"{name:<34} {copies[key + ' s'] * 1e3:8.2f} ms {copies[key + ' bytes'] / 1e6:8.1f} "
              f"{copies[key + ' GB/s']:8.2f}")

    save_ratio = saves["fitdp Model.save"] / base
    fsync_ratio = saves["fitdp Model.save"] / saves["torch.save + fsync"]
    copy_ratio = copies["copy_to GB/s"] / copies["memcpy GB/s"]
    print(f"\nsave ratio (fitdp / bare torch.save):          {save_ratio:.3f}x (target <= "
          f"{SAVE_TARGET:.2f}) {'met' if save_ratio <= SAVE_TARGET else 'MISSED'}")
    print(f"save ratio (fitdp / torch.save + fsync):        {fsync_ratio:.3f}x (reference; "
          f"fitdp fsyncs file and folder)")
    print(f"copy_to bandwidth ratio (copy_to / memcpy):     {copy_ratio:.3f}x (target >= "
          f"{COPY_TARGET:.2f}) {'met' if copy_ratio >= COPY_TARGET else 'MISSED'}")
    if args.quick:
        print("(quick smoke run: the model is tiny and the memcpy fits in cache, so the "
              "targets apply to the full run only)")
    if args.json:
        out = {"sizes": sizes, "params": n_params, "repeats": repeats, "loadavg": list(load),
               "torch": torch.__version__, "save_s": saves, "copy": copies,
               "save_ratio": save_ratio, "save_fsync_ratio": fsync_ratio,
               "copy_bandwidth_ratio": copy_ratio}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
