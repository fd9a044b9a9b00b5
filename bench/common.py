"""What every benchmark shares: the models, the hand-written reference loops, the timing, the
machine's description, the result rows (printed and written as JSON) and torchrun launches.

Timing: one torch thread per process (``pin_threads``), every loop warmed up once, then rounds
that run every loop in turn (the order rotating from round to round, so a change of load hits
all alike), seconds per step per round; a case's numbers are the medians, and its ratio the
median of the rounds' own ratios (two loops of one round ran next to each other in time).
Single-threaded cases read this process's CPU time (on a shared machine, time spent waiting
for a core does not count); multi-threaded ones the wall clock.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's fitdp, in this process and the ones it starts
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

Loop = Callable[[], None]
TAG = "BENCH_JSON "  # prefix of the one JSON line a torchrun worker prints


# -- models and data ----------------------------------------------------------------------


def mlp(sizes: list[int], seed: int = 0) -> nn.Module:
    """Linear layers of ``sizes`` with ReLU between them, seeded."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def synthetic(rows: int, width: int, classes: int, seed: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable data: the label is the largest of the first ``classes`` features."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    return x, x[:, :classes].argmax(1)


# -- the loops ------------------------------------------------------------------------------


def hand_loop(net: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int,
              device: str = "cpu") -> Loop:
    """The floor loop: one epoch per call over pre-shuffled tensor slices, Adam 1e-3."""
    net.to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = x.to(device), y.to(device)

    def epoch() -> None:
        perm = torch.randperm(len(x), device=device)
        xs, ys = x[perm], y[perm]
        for i in range(0, len(x), bs):
            opt.zero_grad()
            F.cross_entropy(net(xs[i:i + bs]), ys[i:i + bs]).backward()
            opt.step()

    return epoch


def hand_two_threads(net: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int) -> Loop:
    """The hand-written limit of two CPU replicas: two persistent copies, the halves of each
    batch on two threads, the gradients added, one Adam step, the weights copied back."""
    nets = [net, copy.deepcopy(net)]
    params = [list(n.parameters()) for n in nets]
    opt = torch.optim.Adam(params[0], lr=1e-3)
    pool = ThreadPoolExecutor(1)

    def half(k: int, xb: torch.Tensor, yb: torch.Tensor, weight: float) -> None:
        (F.cross_entropy(nets[k](xb), yb) * weight).backward()

    def epoch() -> None:
        perm = torch.randperm(len(x))
        xs, ys = x[perm], y[perm]
        for i in range(0, len(x), bs):
            xb, yb = xs[i:i + bs], ys[i:i + bs]
            h = len(xb) // 2
            for p in params[0] + params[1]:
                p.grad = None
            other = pool.submit(half, 1, xb[h:], yb[h:], (len(xb) - h) / len(xb))
            half(0, xb[:h], yb[:h], h / len(xb))
            other.result()
            for a, b in zip(*params):
                a.grad.add_(b.grad)  # type: ignore[union-attr]
            opt.step()
            with torch.no_grad():
                for a, b in zip(*params):
                    b.copy_(a)

    return epoch


def fitdp_loop(net: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int,
               devices: list[str], cls: type | None = None, **fit: Any) -> Loop:
    """One ``Model.fit`` epoch per call (of ``cls``, a ``fitdp.Model`` by default): Adam
    1e-3, cross entropy, as the hand loops."""
    import fitdp  # noqa: PLC0415 - a launcher of torchrun jobs need not pay for it

    model = (cls or fitdp.Model)(net)
    model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy")
    if devices[0].startswith("cuda"):
        x, y = x.to(devices[0]), y.to(devices[0])

    def epoch() -> None:
        model.fit(x, y, batch_size=bs, epochs=1, devices=devices, verbose=0, **fit)

    return epoch


# -- timing -----------------------------------------------------------------------------------


def pin_threads() -> None:
    """One torch thread (intra- and inter-op): what each case's process runs on."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first parallel work; already so
        pass


def interleave(loops: dict[str, Loop], steps: int, repeats: int, clock: str = "cpu",
               sync: bool = False) -> dict[str, list[float]]:
    """Seconds per step of every loop in every round, after one warm-up call of each."""
    tick = time.process_time if clock == "cpu" else time.perf_counter
    for fn in loops.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in loops}
    names = list(loops)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if sync:
                torch.cuda.synchronize()
            t = tick()
            loops[name]()
            if sync:
                torch.cuda.synchronize()
            times[name].append((tick() - t) / steps)
    return times


def paired(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median of the rounds' own ratios a / b."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def machine() -> dict[str, Any]:
    """The CPU, cores, memory, versions and load: what a number was measured on."""
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    with open("/proc/meminfo") as f:
        mem_gib = int(f.readline().split()[1]) / 2**20
    return {"cpu": cpu, "cores": f"{os.cpu_count()} ({len(os.sched_getaffinity(0))} usable)",
            "memory": f"{mem_gib:.1f} GiB", "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load average": loadavg()}


# -- results --------------------------------------------------------------------------------


class Results:
    """The rows of one benchmark run: each prints as it is added; ``finish`` prints the
    summary and writes every row, the extra numbers and the machine to ``--json``."""

    def __init__(self, script: str, args: argparse.Namespace) -> None:
        self.script, self.args = script, args
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.start, self.load_before = time.perf_counter(), loadavg()
        print(f"{script}: {machine()['cpu']}, load average {self.load_before}"
              f"{' (quick: the numbers say it runs, not how fast)' if args.quick else ''}",
              flush=True)

    def row(self, section: str, case: str, reference: str, ref_value: float, value: float,
            unit: str, ratio: float | None = None, op: str = "", target: float | None = None,
            note: str = "") -> None:
        """One comparison: ``value`` (fitdp) against ``ref_value`` (``reference``), in
        ``unit``; ``ratio`` defaults to value / reference; ``op`` and ``target`` hold it."""
        ratio = value / ref_value if ratio is None and ref_value else ratio
        verdict = "-"
        if target is not None and ratio is not None:
            verdict = "PASS" if (ratio <= target if op == "<=" else ratio >= target) else "MISS"
        self.rows.append({"section": section, "case": case, "reference": reference,
                          "ref_value": ref_value, "value": value, "unit": unit, "ratio": ratio,
                          "op": op, "target": target, "verdict": verdict, "note": note})
        shown = "-" if ratio is None else f"{ratio:.3f}"
        goal = f" (target {op} {target})" if target is not None else ""
        print(f"  {case}: fitdp {number(value)} {unit}, {reference} {number(ref_value)}: ratio "
              f"{shown}{goal} {verdict if target is not None else ''}"
              f"{'; ' + note if note else ''}", flush=True)

    def finish(self) -> None:
        took = time.perf_counter() - self.start
        print(f"{self.script}: {len(self.rows)} rows in {took:.0f} s; load average "
              f"{self.load_before} at the start, {loadavg()} at the end")
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(
                {"script": self.script, "quick": self.args.quick, "seconds": took,
                 "machine": machine(), "load": [self.load_before, loadavg()],
                 "rows": self.rows, "extra": self.extra}, indent=1, default=str))


def number(value: float) -> str:
    """A measured value as the tables show it: 3 significant digits, thousands grouped."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def parser(doc: str | None, repeats: int = 7) -> argparse.ArgumentParser:
    """The options every benchmark has: --quick, --repeats, --json."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run of seconds: tiny sizes, one round")
    p.add_argument("--repeats", type=int, default=repeats, help="timed rounds")
    p.add_argument("--json", default=None, help="write the rows and numbers there")
    return p


# -- torchrun -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit(line: dict[str, Any]) -> None:
    """Print one tagged JSON line in one write: ranks share the launcher's pipe, and one
    write of under a pipe's buffer is never interleaved with another process's."""
    os.write(sys.stdout.fileno(), f"\n{TAG}{json.dumps(line)}\n".encode())


def torchrun(args: list[str], timeout: float, nproc: int = 2) -> list[dict[str, Any]]:
    """Run ``python -m torch.distributed.run`` on ``nproc`` ranks (gloo on 127.0.0.1, one
    thread each) and return the tagged lines its ranks printed; the whole process group is
    killed at ``timeout`` (no rank left behind). Raises RuntimeError on a failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RuntimeError(f"timed out after {timeout:.0f} s:\n{output[-3000:]}") from None
    finally:
        if proc.poll() is None:  # interrupted: leave no rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [json.loads(x[len(TAG):]) for x in output.splitlines() if x.startswith(TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit code {proc.returncode}:\n{output[-3000:]}")
    return lines
