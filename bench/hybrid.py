"""The hybrid case under torchrun: 2 ranks, each with 2 CPU replicas (DDP cannot wrap it).

Run: python bench/hybrid.py [--quick] [--rounds 7] [--steps 3] [--width 2048] [--depth 4]
     [--batch 64] [--bucket-mb 25]

One torchrun launch of 2 ranks (gloo on 127.0.0.1, one thread per process). Each rank builds
two managers of the same MLP from the same weights, ``devices=["cpu", "cpu"]``, Adam: one
whose cross-rank all-reduces start during backward, bucket by bucket (``BucketOverlap``), and
one that all-reduces every bucket after backward (``fitdp.executor.overlap.OVERLAP = False``,
the path before the overlap). Rounds alternate the order (a b, b a, ...), ``--steps`` whole
steps each after a barrier; the median step time of each and their ratio are printed, with
what the reduction after backward costs alone: the forward and backward of a step without
its update, and the all-reduce of every bucket alone; and the median of the rounds' own
ratios (a round's two steps run next to each other, so a change of load hits both). Both
managers end bit for bit equal (they took the same steps): the last line says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp (children too)
from distributed import free_port  # noqa: E402 - bench/ scripts import each other by name

VARIANTS = ("overlapped", "after backward")


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)  # the same weights in both managers
    layers: list[nn.Module] = [nn.Linear(1024, width)]
    for _ in range(depth - 1):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, 10))


def median_ms(run: object, steps: int, rounds: list[float]) -> None:
    import torch.distributed as dist

    dist.barrier()  # the ranks start each timed segment together
    start = time.perf_counter()
    for _ in range(steps):
        run()  # type: ignore[operator]
    rounds.append((time.perf_counter() - start) / steps * 1e3)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from fitdp.data.batch import DataBatch
    from fitdp.executor import DataParallelExecutorManager, flat_buckets, overlap

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    flat_buckets.BUCKET_BYTES = int(args.bucket_mb * (1 << 20))
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, 1024, generator=g)
    batch = DataBatch(x, x[:, :10].argmax(1))
    managers, steps = {}, {}
    for name in VARIANTS:
        overlap.OVERLAP = name == "overlapped"
        mgr = DataParallelExecutorManager(mlp(args.width, args.depth), ["cpu", "cpu"],
                                          loss=F.cross_entropy, distributed=True)
        mgr._speed_check = None  # no serial probe batches: both time the threaded step
        opt = torch.optim.Adam(mgr.master_parameters(), lr=1e-4)
        managers[name] = mgr
        steps[name] = mgr.bind_step(True, optimizer=opt)
    times: dict[str, list[float]] = {name: [] for name in (*VARIANTS, "backward", "reduce")}
    after = managers["after backward"]
    backward = after.bind_step(True)  # forward and backward, no update
    for name in VARIANTS:  # warm-up
        steps[name](batch, zero_grad=True, step=True)
    for r in range(args.rounds):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            median_ms(lambda s=steps[name]: s(batch, zero_grad=True, step=True), args.steps,
                      times[name])
        median_ms(lambda: backward(batch, zero_grad=True), args.steps, times["backward"])
        assert after.flat is not None  # noqa: S101 - two replicas: flat buckets
        median_ms(after.flat.reduce_global, args.steps, times["reduce"])
    med = {k: statistics.median(v) for k, v in times.items()}
    same = all(torch.equal(a, b) for a, b in zip(
        *(m.master_parameters() for m in managers.values())))
    early = managers["overlapped"].cross_rank.early  # type: ignore[union-attr]
    if rank == 0:
        params = sum(p.numel() for p in managers["overlapped"].master_parameters())
        buckets = len(after.flat.plan)
        print(f"MLP 1024-{args.width}x{args.depth}-10: {params / 1e6:.1f}M parameters, "
              f"{buckets} bucket(s) of <= {args.bucket_mb:g} MB; batch {args.batch} per rank "
              f"({args.batch // 2} per replica); median of {args.rounds} rounds x "
              f"{args.steps} steps; load average {os.getloadavg()[0]:.2f}")
        for k in (*VARIANTS, "backward", "reduce"):
            label = {"backward": "forward + backward alone (no update)",
                     "reduce": "all-reduce of every bucket alone"}.get(k, f"whole step, {k}")
            print(f"  {label:44s} {med[k]:9.2f} ms   {[round(t, 1) for t in times[k]]}")
        print(f"all-reduce after backward: {med['reduce'] / med['after backward']:.2f} of its "
              f"step ({med['reduce'] / med['backward']:.2f}x forward + backward)")
        paired = statistics.median(a / b for a, b in zip(*(times[k] for k in VARIANTS)))
        print(f"step ratio (overlapped / after backward): "
              f"{med['overlapped'] / med['after backward']:.3f} (median of the rounds' "
              f"ratios, each pair next to each other in time: {paired:.3f})")
        print(f"buckets started during backward: {early}; bit for bit equal: {same}")
    dist.barrier()
    for mgr in managers.values():
        mgr.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model, 2 rounds")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="rows per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.width, args.depth, args.bucket_mb = 2, 1, 256, 2, 0.25
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__, "--worker",
           *sys.argv[1:]]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(cmd, env=env, timeout=1800, check=False).returncode)


if __name__ == "__main__":
    main()
