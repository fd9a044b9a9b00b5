"""The GPU checks: the CUDA test tier and what fitdp costs on a GPU, in one run of at most 8
minutes on one GPU. No CUDA path of fitdp had run on a GPU when this was written.

Run: python -m bench --gpu [--json bench-gpu.json] [--device cuda:0]
     python bench/gpu.py --quick     (a dry run: every part on the CPU with tiny sizes)

Parts, each in its own process with its own time limit (a part that crashes, hangs or leaves
the GPU in an error state cannot stop the others; a dry run runs them in this process):

  tier       ``pytest -m requires_cuda tests/`` (counts from its JUnit report), then the
             two-replica tests (``-k 2replicas``) four more times
  speed      ``Model.fit`` against the hand loop, MLPs with the data on the GPU; target: at
             least 0.97 of the loop's speed
  syncs      host syncs per step (``torch.cuda.set_sync_debug_mode("warn")``), from two epoch
             lengths so those once per fit cancel; target 0 for the everyday variants
  replicas   ``devices=["cuda:0", "cuda:0"]``: weights allclose to one device's; speed
  precision  ``bf16-mixed`` and ``16-mixed`` against ``32``: time per step, the loss falls
  compile    ``compile=True`` and ``compile="reduce-overhead"`` with a ``BucketIterator``, on
             one device and on two replicas of it: the mode torch.compile got, recompiles
             after the first epoch (target 0), time per step against eager

It prints one table and writes every row, the GPU, driver and versions to ``--json``. Exit
code 1 when a part or a tier test failed (a MISSed target is a result), 2 when there is no
GPU and no ``--quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from common import ROOT, Results, fitdp_loop, hand_loop, interleave, machine, mlp, ms, synthetic
from torch import nn

import fitdp

# Seconds each part may take on one GPU: 430 in all, 50 left of 8 minutes for start-up.
BUDGET_S = {"tier": 165, "speed": 40, "syncs": 45, "replicas": 35, "precision": 25,
            "compile": 120}


class Part:
    """Where a part runs, until when, and its rows."""

    def __init__(self, name: str, device: str, seconds: float, out: Results) -> None:
        self.name, self.device, self.out = name, device, out
        self.deadline = time.perf_counter() + seconds
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def attempt(self, label: str, fn: Callable[[], None]) -> None:
        """One variant; an exception becomes a FAILED row and the part goes on."""
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - reported as a row
            self.out.row(self.name, f"{label}: FAILED {type(err).__name__}: {err}"[:200],
                         "-", 0.0, 0.0, "-", note="FAILED")

    def check(self, case: str, ok: bool, value: str) -> None:
        """A yes/no row: ratio 1 when it holds."""
        self.out.row(self.name, f"{case}: {value}", "expected", 1.0, float(ok), "ok",
                     float(ok), ">=", 1.0)


def pytest_counts(args: list[str], timeout: float) -> dict[str, Any]:
    """Run pytest with a JUnit report; passed, failed, skipped and the failed tests' names."""
    with tempfile.TemporaryDirectory() as folder:
        xml = Path(folder) / "junit.xml"
        child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  f"--junitxml={xml}", *args], cwd=ROOT, start_new_session=True)
        try:
            child.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        if not xml.exists():
            return {"passed": 0, "failed": 1, "skipped": 0, "failed_tests": ["(no report)"]}
        cases = list(ET.parse(xml).getroot().iter("testcase"))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = sum(c.find("skipped") is not None for c in cases)
    return {"passed": len(cases) - len(failed) - skipped, "failed": len(failed),
            "skipped": skipped, "failed_tests": failed}


def tier(p: Part) -> None:
    runs = [("the CUDA tier", ["-m", "requires_cuda", "tests" if p.cuda else "tests/cuda"])]
    if p.cuda:  # a dry run's tier skips every test: once is enough to check the counting
        runs.append(("2-replica tests x4 more", ["-m", "requires_cuda", "-k", "2replicas",
                                                 "--keep-duplicates", *["tests/cuda"] * 4]))
    for label, args in runs:
        got = pytest_counts(["--continue-on-collection-errors", *args],
                            p.deadline - time.perf_counter() - 5)
        p.out.extra[label] = got
        p.out.row("tier", f"{label}: {got['passed']} passed, {got['failed']} failed, "
                  f"{got['skipped']} skipped", "failed", 0.0, float(got["failed"]), "tests",
                  float(got["failed"]), "<=", 0.0, ", ".join(got["failed_tests"][:10]))


def speed(p: Part) -> None:
    cases = ([([784, 512, 512, 10], 256, 400), ([784, 4096, 4096, 10], 1024, 100)] if p.cuda
             else [([32, 64, 10], 32, 8)])
    for sizes, bs, steps in cases:
        def one(sizes: list[int] = sizes, bs: int = bs, steps: int = steps) -> None:
            x, y = synthetic(bs * steps, sizes[0], sizes[-1])
            net = mlp(sizes)
            times = interleave({"fitdp": fitdp_loop(copy.deepcopy(net).to(p.device), x, y, bs,
                                                    [p.device]),
                                "hand": hand_loop(copy.deepcopy(net), x, y, bs, p.device)},
                               steps, 7 if p.cuda else 1, "wall", p.cuda)
            p.out.row("speed", f"MLP {'-'.join(map(str, sizes))}, batch {bs}: speed",
                      "hand loop", ms(times["hand"]), ms(times["fitdp"]), "ms/step",
                      ms(times["hand"]) / ms(times["fitdp"]), ">=", 0.97 if p.cuda else None,
                      "ratio: speed")

        p.attempt(f"speed {sizes}", one)


def count_syncs(p: Part, steps: int, devices: list[str], on_device: bool,
                compile_args: dict[str, Any], fit_args: dict[str, Any]) -> int:
    """Host syncs in one fit of ``steps`` steps (after a warm-up fit), no log point inside."""
    sizes, bs = ([784, 512, 512, 10], 256) if p.cuda else ([16, 32, 4], 8)
    x, y = synthetic(bs * steps, sizes[0], sizes[-1])
    if on_device:
        x, y = x.to(p.device), y.to(p.device)
    model = fitdp.Model(mlp(sizes).to(p.device))
    model.compile(**{"optimizer": "adam", "loss": "cross_entropy", **compile_args})
    model.fit(x, y, batch_size=bs, devices=devices, verbose=0, **fit_args)
    with warnings.catch_warnings(record=True) as seen:  # every thread's warnings
        warnings.simplefilter("always")
        if p.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            model.fit(x, y, batch_size=bs, devices=devices, verbose=0, log_every=10**9,
                      **fit_args)
        finally:
            if p.cuda:
                torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen)


def syncs(p: Part) -> None:
    from torchmetrics.classification import MulticlassAccuracy  # noqa: PLC0415

    d, classes = p.device, 10 if p.cuda else 4
    micro = MulticlassAccuracy(classes, average="micro", validate_args=False)
    # label, devices, data on the device, compile's and fit's arguments, target (None: none)
    variants: list[tuple[str, list[str], bool, dict[str, Any], dict[str, Any], float | None]] = [
        ("1 device", [d], True, {}, {}, 0.0),
        ("1 device, data on the host", [d], False, {}, {}, 0.0),
        ("2 replicas on one device", [d, d], True, {}, {}, 0.0),
        ("2 replicas, work_load_list='auto'", [d, d], True, {}, {"work_load_list": "auto"}, 0.0),
        ("bf16-mixed", [d], True, {"precision": "bf16-mixed"}, {}, 0.0),
        ("micro accuracy, validate_args=False", [d], True, {"metrics": [micro]}, {}, 0.0),
        ("MulticlassAccuracy(n), its defaults", [d], True,
         {"metrics": [MulticlassAccuracy(classes)]}, {}, None),
    ]
    if p.cuda:
        variants += [("16-mixed, fused Adam", [d], True, {"precision": "16-mixed"}, {}, 0.0),
                     ("16-mixed, a user's unfused Adam", [d], True, {
                         "precision": "16-mixed",
                         "optimizer": lambda ps: torch.optim.Adam(ps, lr=1e-3)}, {}, None)]
    if not p.cuda:  # nothing to count on the CPU: a dry run checks that the counting runs
        variants = [variants[0], variants[3], variants[-1]]
    for label, devices, on_device, args, fit_args, target in variants:
        def one(label: str = label, devices: list[str] = devices, on_device: bool = on_device,
                args: dict[str, Any] = args, fit_args: dict[str, Any] = fit_args,
                target: float | None = target) -> None:
            n1, n2 = (20, 60) if p.cuda else (3, 6)
            per_step = (count_syncs(p, n2, devices, on_device, args, fit_args)
                        - count_syncs(p, n1, devices, on_device, args, fit_args)) / (n2 - n1)
            p.out.row("syncs", f"host syncs per step, {label}", "none", 0.0, per_step,
                      "syncs", per_step, "<=", target if p.cuda else None,
                      "" if p.cuda else "n/a on the CPU")

        p.attempt(label, one)


class HostClock(fitdp.callbacks.Callback):
    """Host seconds from each training batch's begin hook to its end hook."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self.seconds.append(time.perf_counter() - self.t0)


def replicas(p: Part) -> None:
    d = p.device
    sizes, bs, steps = ([784, 1024, 1024, 10], 512, 50) if p.cuda else ([16, 32, 4], 8, 6)
    x, y = synthetic(bs * steps, sizes[0], sizes[-1])

    def agree() -> None:
        weights = []
        for devices in ([d], [d, d]):
            model = fitdp.Model(mlp(sizes))
            model.compile(optimizer="sgd", lr=0.05, loss="cross_entropy")
            model.fit(x, y, batch_size=bs, devices=devices, shuffle=False, verbose=0)
            weights.append(model.get_weights())
        diff = max(float((a - weights[1][k]).abs().max()) for k, a in weights[0].items())
        p.check("2 replicas vs 1: weights allclose after an epoch", all(
            torch.allclose(a, weights[1][k], rtol=1e-4, atol=1e-5)
            for k, a in weights[0].items()), f"max |diff| {diff:.2e}")

    def timing() -> None:
        net = mlp(sizes)
        times = interleave({"two": fitdp_loop(copy.deepcopy(net).to(d), x, y, bs, [d, d]),
                            "one": fitdp_loop(copy.deepcopy(net).to(d), x, y, bs, [d])},
                           steps, 5 if p.cuda else 1, "wall", p.cuda)
        p.out.row("replicas", "2 replicas on one device: speed", "1 replica", ms(times["one"]),
                  ms(times["two"]), "ms/step", ms(times["one"]) / ms(times["two"]),
                  note="ratio: speed")

    def host_time() -> None:
        """Host time from each batch's begin hook to its end hook (nothing waits for the GPU
        between log points) against the step's wall time: near it, the GPU waits for the
        host, and streams of their own per replica could not make two replicas faster."""
        for devices in ([d], [d, d]):
            model = fitdp.Model(mlp([128, 256, 256, 10]).to(d))
            model.compile(optimizer="adam", loss="cross_entropy")
            xs, ys = synthetic(64 * steps, 128, 10)
            xs, ys = xs.to(d), ys.to(d)
            model.fit(xs, ys, batch_size=64, devices=devices, verbose=0)  # warm-up
            clock = HostClock()
            p.sync()
            t = time.perf_counter()
            model.fit(xs, ys, batch_size=64, devices=devices, verbose=0, log_every=10**9,
                      callbacks=[clock])
            p.sync()
            wall = (time.perf_counter() - t) / steps * 1e3
            p.out.row("replicas", f"host time per step, {len(devices)} replica(s), small MLP",
                      "the step's wall time", wall, ms(clock.seconds[1:-1] or clock.seconds),
                      "ms")

    p.attempt("replicas agree", agree)
    p.attempt("replicas timing", timing)
    p.attempt("replicas host time", host_time)


def precision(p: Part) -> None:
    d = p.device
    sizes, bs, steps = ([784, 4096, 4096, 10], 1024, 40) if p.cuda else ([16, 32, 4], 8, 6)
    x, y = synthetic(bs * steps, sizes[0], sizes[-1])
    x, y = x.to(d), y.to(d)
    base: dict[str, float] = {}
    for name in ("32", "bf16-mixed", "16-mixed"):
        def one(name: str = name) -> None:
            model = fitdp.Model(mlp(sizes).to(d))
            model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy", precision=name)
            if name == "16-mixed" and not p.cuda:  # CUDA only: refused, as documented
                try:
                    model.fit(x, y, batch_size=bs, devices=[d], verbose=0)
                except ValueError:
                    p.check("16-mixed on the CPU", True, "refused")
                else:
                    p.check("16-mixed on the CPU", False, "accepted")
                return
            seconds, losses = [], []
            for _ in range(4):
                p.sync()
                t = time.perf_counter()
                losses.append(model.fit(x, y, batch_size=bs, devices=[d],
                                        verbose=0).history["loss"][0])
                p.sync()
                seconds.append((time.perf_counter() - t) / steps * 1e3)
            base.setdefault("32", min(seconds[1:]))
            p.out.row("precision", f"{name}: time per step", "32", base["32"],
                      min(seconds[1:]), "ms/step")
            p.check(f"{name}: the loss falls", losses[-1] < losses[0],
                    f"{losses[0]:.3f} -> {losses[-1]:.3f}")

        p.attempt(f"precision {name}", one)


class SeqNet(nn.Module):
    """Embedding, a position-wise MLP, the mean over time, a head: one graph per shape."""

    def __init__(self, vocab: int, width: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.emb(tokens)).mean(1))


@contextlib.contextmanager
def modes_seen(modes: list[str | None], eager: bool) -> Iterator[None]:
    """Record the mode of every torch.compile call; ``eager``: the dry run's backend (no
    C++ toolchain needed, seconds to compile)."""
    original = torch.compile

    def patched(*args: Any, mode: str | None = None, **kwargs: Any) -> Any:
        modes.append(mode)
        if eager:
            return original(*args, **{**kwargs, "backend": "eager"})
        return original(*args, mode=mode, **kwargs)

    torch.compile = patched  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


def compile_part(p: Part) -> None:
    import torch._dynamo  # noqa: PLC0415
    from torch._dynamo.utils import counters  # noqa: PLC0415

    d = p.device
    vocab, width, classes, bs, buckets = ((2000, 256, 8, 64, [16, 32, 64]) if p.cuda
                                          else (50, 16, 3, 8, [6, 12]))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, vocab, (int(n),), generator=g)
            for low, high in zip([1, *buckets[:-1]], buckets)
            for n in torch.randint(low + 1, high + 1, (bs * 4,), generator=g)]
    labels = torch.tensor([int(s[0]) % classes for s in seqs])

    def epochs(mode: bool | str, devices: list[str]) -> tuple[float, int, list[str | None]]:
        """ms per step after the first epoch, graphs compiled after it, modes seen."""
        torch._dynamo.reset()
        modes: list[str | None] = []
        with modes_seen(modes, eager=not p.cuda):
            model = fitdp.Model(SeqNet(vocab, width, classes))
            model.compile(optimizer="adam", loss="cross_entropy", compile=mode)
            it = fitdp.BucketIterator(seqs, labels, batch_size=bs, buckets=buckets, seed=0)
            graphs, seconds = [], []
            for _ in range(3):
                p.sync()
                t = time.perf_counter()
                model.fit(it, devices=devices, verbose=0)
                p.sync()
                seconds.append((time.perf_counter() - t) / len(it) * 1e3)
                graphs.append(int(counters["stats"]["unique_graphs"]))
        return min(seconds[1:]), graphs[-1] - graphs[0], modes

    eager: dict[str, float] = {}
    p.attempt("eager", lambda: eager.update(ms=epochs(False, [d])[0]))
    for mode in (True, "reduce-overhead"):
        for devices in ([d], [d, d]):
            label = f"compile={mode!r}, {len(devices)} replica(s)"
            if p.deadline - time.perf_counter() < 25:  # a variant needs about this
                p.out.row("compile", f"{label}: not run, out of time", "-", 0.0, 0.0, "-")
                continue

            def one(mode: bool | str = mode, devices: list[str] = devices,
                    label: str = label) -> None:
                step_ms, recompiles, modes = epochs(mode, devices)
                want = None if mode is True else mode
                p.check(f"{label}: mode torch.compile got", set(modes) == {want},
                        str(sorted(set(map(str, modes)))))
                p.out.row("compile", f"{label}: recompiles after epoch 1", "none", 0.0,
                          float(recompiles), "graphs", float(recompiles), "<=", 0.0)
                p.out.row("compile", f"{label}: time per step", "eager",
                          eager.get("ms", float("nan")), step_ms, "ms/step")

            p.attempt(label, one)


PARTS: dict[str, Callable[[Part], None]] = {
    "tier": tier, "speed": speed, "syncs": syncs, "replicas": replicas, "precision": precision,
    "compile": compile_part}


def run_child(name: str, device: str, folder: str) -> dict[str, Any]:
    """A part in a process of its own, killed with everything it started at its limit."""
    path = os.path.join(folder, f"{name}.json")
    child = subprocess.Popen([sys.executable, __file__, "--part", name, "--device", device,
                              "--json", path], cwd=ROOT, start_new_session=True)
    status = "ok"
    try:
        if child.wait(timeout=BUDGET_S[name]) != 0:
            status = f"exit code {child.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timed out after {BUDGET_S[name]} s"
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError):
        rows = []  # a part killed before its end wrote nothing
    return {"status": status, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--quick", "--dry-run", action="store_true",
                   help="every part on the CPU with tiny sizes (no GPU needed)")
    p.add_argument("--json", default="bench-gpu.json", help="where the numbers go")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = "cpu" if args.quick else args.device
    if not device.startswith("cuda"):
        torch.set_num_threads(1)
    if args.part:  # one part, in the process main() started for it
        out = Results(args.part, args)
        PARTS[args.part](Part(args.part, device, BUDGET_S[args.part], out))
        out.finish()
        return 0
    if not args.quick and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA GPU here (torch.cuda.is_available() is False). Fix: run "
              "it on a GPU machine, or check the script on the CPU with --quick.")
        return 2
    info = machine()
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["triton"] = importlib.metadata.version("triton")
    info["c compiler (Triton's launcher)"] = shutil.which(os.environ.get("CC", "cc")) or "none"
    if not args.quick:
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, cuda=torch.version.cuda,
                    memory_gib=round(props.total_memory / 2**30, 1))
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
    print(f"machine: {info}", flush=True)
    parts: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fitdp-gpu-") as folder:
        for name in PARTS:
            print(f"\n== {name}", flush=True)
            if args.quick:
                out = Results(name, args)
                try:
                    PARTS[name](Part(name, device, BUDGET_S[name], out))
                    parts[name] = {"status": "ok", "rows": out.rows}
                except Exception as err:  # noqa: BLE001 - one part must not stop the others
                    parts[name] = {"status": f"{type(err).__name__}: {err}", "rows": out.rows}
            else:
                parts[name] = run_child(name, device, folder)
    Path(args.json).write_text(json.dumps({"machine": info, "parts": parts}, indent=1,
                                          default=str))
    print(f"\n{'part':<9} {'case':<64} {'value':>16} {'ratio':>7} {'target':>7} verdict")
    for name, part in parts.items():
        if part["status"] != "ok":
            print(f"{name:<9} {'(the part) ' + part['status']:<64} {'FAILED':>40}")
        for r in part["rows"]:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            target = "" if r["target"] is None else f"{r['op']} {r['target']:g}"
            print(f"{name:<9} {r['case'][:64]:<64} {r['value']:>9.4g} {r['unit'][:6]:<6} "
                  f"{ratio:>7} {target:>7} {r['verdict']}")
    print(f"numbers in {args.json}")
    failed = any(part["status"] != "ok" or any(r["note"] == "FAILED" for r in part["rows"])
                 or (name == "tier" and any(r["value"] for r in part["rows"]))
                 for name, part in parts.items())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
