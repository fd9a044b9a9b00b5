"""FSDP2 against DDP as fitdp wraps them (``fitdp.executor.engines``), torchrun 2 ranks on the
CPU: per-rank memory of parameters + gradients + optimizer state, and step time.

Run: python bench/sharding.py [--quick] [--steps 6] [--json out.json]

A 25M-parameter MLP (6 layers 2048x2048 and a head) with Adam, batch 32 per rank. The memory
row counts the bytes of the tensors each rank holds after a step (its parameter shards, their
gradients, Adam's two moments): the quantity FSDP shards; activations are the same for both
and left out. Step time is the median over the steps after the first, rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp (children too)

WIDTH, DEPTH, BATCH = 2048, 6, 32
TAG = "BENCH_JSON "


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


def worker(kind: str, steps: int) -> None:
    import torch.distributed as dist

    from fitdp.executor.engines import DDP, FSDP, shard_fsdp, wrap_ddp

    dist.init_process_group("gloo")
    module = mlp()
    params = sum(p.numel() for p in module.parameters())
    wrapped = wrap_ddp(module, torch.device("cpu"), DDP()) if kind == "ddp" else module
    if kind == "fsdp":
        shard_fsdp(module, FSDP(blocks=(nn.Linear,)), None)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    held = {
        "params": sum(local_bytes(p) for p in module.parameters()),
        "grads": sum(local_bytes(p.grad) for p in module.parameters()),
        "optimizer": sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
    }
    if dist.get_rank() == 0:
        print(TAG + json.dumps({"kind": kind, "params": params, "bytes": held,
                                "step_s": statistics.median(times[1:])}), flush=True)
    del wrapped
    dist.barrier()
    dist.destroy_process_group()


def launch(kind: str, steps: int, timeout: float) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__),
           "--worker", kind, "--steps", str(steps)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [json.loads(line[len(TAG):]) for line in output.splitlines() if line.startswith(TAG)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind}: exit code {proc.returncode}\n{output[-3000:]}")
    return lines[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 steps")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    if args.worker:
        torch.set_num_threads(1)
        worker(args.worker, steps)
        return 0
    rows = {kind: launch(kind, steps, args.timeout) for kind in ("ddp", "fsdp")}
    total = {k: sum(r["bytes"].values()) for k, r in rows.items()}
    ratio = total["fsdp"] / total["ddp"]
    speed = rows["fsdp"]["step_s"] / rows["ddp"]["step_s"]
    print(f"{rows['ddp']['params'] / 1e6:.1f}M parameters, Adam, torchrun 2 ranks (gloo, CPU)")
    for kind, r in rows.items():
        parts = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["bytes"].items())
        print(f"  {kind:5s} per rank: {total[kind] / 2**20:.0f} MiB ({parts}); "
              f"step {r['step_s'] * 1e3:.0f} ms")
    print(f"  fsdp / ddp memory per rank: {ratio:.2f}x (target <= 0.6x); "
          f"step time {speed:.2f}x ddp's")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "memory_ratio": ratio,
                                               "step_ratio": speed}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
