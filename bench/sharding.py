"""``strategy="fsdp"`` against ``strategy="ddp"`` under ``fitdp.Model.fit``, torchrun 2 ranks on
the CPU (gloo): per-rank memory of parameters + gradients + optimizer state, and step time.

Run: python bench/sharding.py [--quick] [--steps 8] [--rounds 2] [--json out.json]

A 25M-parameter MLP (6 layers 2048x2048 and a head) with Adam, ``fit(batch_size=32)`` per rank,
launched once per strategy per round, the strategies alternating (ddp fsdp, fsdp ddp, ...).
A callback reads, after each training step, the tensors the rank's optimizer steps (its
parameter shards: ``p.to_local()`` of FSDP2's DTensors), their gradients and Adam's two moments,
and keeps the largest sum: the quantity FSDP shards (activations are the same for both and left
out). Also each rank's peak RSS growth over the fit (``ru_maxrss`` after it less before the
model was built): that includes what ``fit`` keeps on the host besides the device's holdings
(the host module, whole, under both) and what the allocator keeps of freed memory, read at
the last step's end and after ``fit`` (whose end gathers FSDP2's shards into the host
module on every rank). Step time: the median gap between consecutive step ends after the
first, rank 0's; the median over the rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp (children too)
from bench.launcher import torchrun  # noqa: E402

WIDTH, DEPTH, BATCH = 2048, 6, 32
TAG = "BENCH_JSON "
TARGET = 0.6  # fsdp / ddp bytes per rank, at most


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def held(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters (shards), their gradients and the optimizer state."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params),
        "optimizer": sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
    }


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def resident_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(kind: str, steps: int) -> None:
    import time

    import torch.distributed as dist

    import fitdp
    from fitdp.callbacks import Callback

    class Probe(Callback):
        """After each step: its end time, and the largest bytes held so far."""

        def __init__(self) -> None:
            super().__init__()
            self.ends: list[float] = []
            self.most: dict[str, int] = {}
            self.rss = self.resident = 0

        def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
            self.ends.append(time.perf_counter())
            self.rss = peak_rss_bytes()  # the high-water mark up to this step's end
            self.resident = max(self.resident, resident_bytes())
            now = held(self.model.optimizer)
            if sum(now.values()) > sum(self.most.values()):
                self.most = now

    rss_before, resident_before = peak_rss_bytes(), resident_bytes()
    module = mlp()
    params = sum(p.numel() for p in module.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * BATCH * steps, WIDTH, generator=g)
    y = torch.randint(0, 10, (len(x),), generator=g)
    model = fitdp.Model(module)
    model.compile(optimizer="adam", lr=1e-4, loss="cross_entropy", strategy=kind)
    probe = Probe()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[probe])
    gaps = [b - a for a, b in zip(probe.ends[:-1], probe.ends[1:])]
    line = {"kind": kind, "rank": dist.get_rank(), "params": params, "bytes": probe.most,
            "rss_growth": peak_rss_bytes() - rss_before,
            "rss_growth_steps": probe.rss - rss_before,
            "resident_growth_steps": probe.resident - resident_before,
            "step_s": statistics.median(gaps), "steps": len(probe.ends)}
    os.write(sys.stdout.fileno(), f"\n{TAG}{json.dumps(line)}\n".encode())  # one write: no
    model.close()  # interleaving with the other rank's line


def launch(kind: str, steps: int, timeout: float) -> dict[str, Any]:
    """Both ranks' lines of one launch of ``kind``: rank 0's, with rank 1's RSS added."""
    run = torchrun([os.path.abspath(__file__), "--worker", kind, "--steps", str(steps)],
                   timeout=timeout)
    lines = [json.loads(line[len(TAG):]) for line in run.output.splitlines()
             if line.startswith(TAG)]
    ranks = {r["rank"]: r for r in lines}
    if run.code != 0 or sorted(ranks) != [0, 1]:
        raise SystemExit(f"{kind}: exit code {run.code}"
                         f"{' (timed out)' if run.timed_out else ''}\n{run.output[-3000:]}")
    return {**ranks[0], **{f"{key}_per_rank": [ranks[0][key], ranks[1][key]]
                           for key in ("rss_growth", "rss_growth_steps", "resident_growth_steps",
                                       "bytes")}}


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                    "unknown")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 steps, 1 round")
    parser.add_argument("--steps", type=int, default=8, help="training steps per launch")
    parser.add_argument("--rounds", type=int, default=2, help="launches of each strategy")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps, rounds = (3, 1) if args.quick else (args.steps, args.rounds)
    if args.worker:
        torch.set_num_threads(1)
        worker(args.worker, steps)
        return 0
    load_before = os.getloadavg()
    print(f"CPU {cpu_model()}, {os.cpu_count()} cores; load average "
          f"{' '.join(f'{v:.2f}' for v in load_before)}; {steps} steps x {rounds} round(s)",
          flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"ddp": [], "fsdp": []}
    for r in range(rounds):  # ddp fsdp, fsdp ddp, ...: drifting load hits both alike
        for kind in ("ddp", "fsdp") if r % 2 == 0 else ("fsdp", "ddp"):
            runs[kind].append(launch(kind, steps, args.timeout))
            print(f"  round {r + 1} {kind}: step {runs[kind][-1]['step_s'] * 1e3:.0f} ms",
                  flush=True)
    rows = {}
    for kind, got in runs.items():
        rows[kind] = {**got[-1], "step_s": statistics.median(g["step_s"] for g in got),
                      "runs_step_s": [g["step_s"] for g in got],
                      **{key: statistics.median(max(g[f"{key}_per_rank"]) for g in got)
                         for key in ("rss_growth", "rss_growth_steps",
                                     "resident_growth_steps")}}
    total = {k: sum(r["bytes"].values()) for k, r in rows.items()}
    ratio = total["fsdp"] / total["ddp"]
    speed = rows["fsdp"]["step_s"] / rows["ddp"]["step_s"]
    rss_ratio = rows["fsdp"]["rss_growth_steps"] / rows["ddp"]["rss_growth_steps"]
    print(f"{rows['ddp']['params'] / 1e6:.1f}M parameters, Adam, Model.fit under torchrun "
          f"2 ranks (gloo, CPU)")
    for kind, r in rows.items():
        parts = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["bytes"].items())
        runs_ms = ", ".join(f"{t * 1e3:.0f}" for t in r["runs_step_s"])
        print(f"  {kind:5s} per rank: {total[kind] / 2**20:.0f} MiB ({parts}); peak RSS growth "
              f"{r['rss_growth_steps'] / 2**20:.0f} MiB by the last step, "
              f"{r['rss_growth'] / 2**20:.0f} MiB after fit, resident at step ends "
              f"{r['resident_growth_steps'] / 2**20:.0f} MiB; step {r['step_s'] * 1e3:.0f} ms "
              f"(rounds: {runs_ms})")
    print(f"  fsdp / ddp memory per rank: {ratio:.2f}x (target <= {TARGET}x) "
          f"{'met' if ratio <= TARGET else 'MISSED'}; peak RSS growth by the last step "
          f"{rss_ratio:.2f}x; "
          f"step time {speed:.2f}x ddp's")
    load_after = os.getloadavg()
    print(f"load average after: {' '.join(f'{v:.2f}' for v in load_after)}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"rows": rows, "memory_ratio": ratio, "rss_ratio": rss_ratio, "step_ratio": speed,
             "target": TARGET, "steps": steps, "rounds": rounds, "cpu": cpu_model(),
             "loadavg_before": load_before, "loadavg_after": load_after}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
