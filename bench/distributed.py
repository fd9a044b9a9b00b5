"""fitdp under torchrun against a hand-written DistributedDataParallel loop, on the CPU.

Run: python bench/distributed.py [--quick] [--rounds 10] [--epochs 4] [--json out.json]

One run of this script launches every case as a subprocess, ``--rounds`` times, interleaved
(a b c d, d c b a, ...), so that load from other processes drifting over the run hits every
case alike:

  (a) fitdp, 2 ranks under torchrun (gloo on 127.0.0.1), ``fit(batch_size=128)`` per rank;
  (b) a hand-written ``DistributedDataParallel`` loop, 2 ranks, each rank taking its half of
      every pre-shuffled global batch of 256 (no DistributedSampler);
  (c) Lightning ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` (skipped when
      Lightning is not installed), logging, progress bar and checkpointing off;
  (d) fitdp in one process, ``devices=["cpu", "cpu"]`` (two replica threads), batch 256.

Every case trains the same MLP 784-512-512-10 from the same initial weights with Adam on the
same synthetic data in the same order, one thread per process. Each process times every epoch
and prints one JSON line; rank 0's median over the epochs after warm-up gives samples/s. The
final-epoch training loss is printed too: equal losses show the cases did the same work.
The ratio of (a) to (b) is also taken per round, of the two launches that ran back to back
(their order alternating), and its median and interquartile range printed: the least exposed
to load drifting over the run, so the target is checked on that median.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp (children too)
from bench.launcher import free_port  # noqa: E402 (bench/hybrid.py imports it from here)

SIZES = [784, 512, 512, 10]
GLOBAL_BATCH = 256
WORLD = 2
LR = 1e-3
SEED = 0
TAG = "BENCH_JSON "  # prefix of the one line each worker prints
TARGET = 1.0  # (a) fitdp "ddp" / (b) the hand DDP loop, samples/s, at least (issue 20.5)
CASES = {
    "a": "fitdp, torchrun 2 ranks",
    "b": "hand DDP loop, torchrun 2 ranks",
    "c": "Lightning DDP, torchrun 2 ranks",
    "d": "fitdp, 1 process, devices=[cpu,cpu]",
}


# -- what every case shares -------------------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every case (both broadcast rank 0's)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic, learnable: the label is the largest of the first 10 features."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH * steps, SIZES[0], generator=g)
    return x, x[:, : SIZES[-1]].argmax(1)


def epoch_order(n: int, epoch: int) -> torch.Tensor:
    """The permutation fitdp's TensorSource draws for ``seed=SEED`` (same order in every case)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))


def rank_rows(step: int, rank: int) -> slice:
    """This rank's half of global batch ``step``."""
    per = GLOBAL_BATCH // WORLD
    start = step * GLOBAL_BATCH + rank * per
    return slice(start, start + per)


def report(case: str, rank: int, epoch_s: list[float], warmup: int, samples: int, loss: float,
           total_s: float) -> None:
    timed = epoch_s[warmup:]
    median = statistics.median(timed)
    line = {"case": case, "rank": rank, "epoch_s": [round(t, 5) for t in epoch_s],
            "median_s": median, "samples_per_s": samples / median, "loss": loss,
            "total_s": total_s}
    # One write call: ranks share the launcher's pipe, and a single write of under 4 KiB to a
    # pipe is never interleaved with another process's (print writes the newline apart).
    os.write(sys.stdout.fileno(), f"\n{TAG}{json.dumps(line)}\n".encode())


# -- the workers (one process each; a, b, c under torchrun) -----------------------------------


def run_fitdp(args: argparse.Namespace, devices: Any, batch_size: int) -> None:
    import fitdp
    from fitdp.callbacks import Callback

    class EpochTimer(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []
            self.loss = float("nan")

        def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
            self.times.append(time.perf_counter() - self.t0)
            self.loss = (logs or {}).get("loss", float("nan"))

    x, y = data(args.steps)
    start = time.perf_counter()
    model = fitdp.Model(mlp())
    model.compile(optimizer="adam", lr=LR, loss="cross_entropy")
    timer = EpochTimer()
    model.fit(x, y, batch_size=batch_size, epochs=args.epochs, devices=devices, seed=SEED,
              verbose=0, callbacks=[timer])
    rank = int(os.environ.get("RANK", "0"))
    report(args.worker, rank, timer.times, args.warmup, len(x), timer.loss,
           time.perf_counter() - start)


def run_ddp(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    x, y = data(args.steps)
    start = time.perf_counter()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = DistributedDataParallel(mlp())
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    times, loss_mean = [], float("nan")
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        order = epoch_order(len(x), epoch)
        xs, ys = x[order], y[order]  # one gather per epoch, then views (as fitdp does)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for step in range(args.steps):
            rows = rank_rows(step, rank)
            opt.zero_grad()
            loss = F.cross_entropy(net(xs[rows]), ys[rows])
            loss.backward()
            opt.step()
            loss_sum += loss.detach() * (rows.stop - rows.start)
        dist.all_reduce(loss_sum)  # the epoch's mean loss, as fitdp reads it once per epoch
        loss_mean = float(loss_sum) / len(x)
        times.append(time.perf_counter() - t0)
    report("b", rank, times, args.warmup, len(x), loss_mean, time.perf_counter() - start)
    # DDP's reducer holds the gloo group: freed at interpreter exit while the peer still tears
    # down, it aborted a rank now and then ("terminate called without an active exception").
    del net, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_lightning(args: argparse.Namespace) -> None:
    import warnings

    import torch.distributed as dist
    from torch.utils.data import DataLoader, IterableDataset

    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    x, y = data(args.steps)
    rank = int(os.environ["RANK"])

    class RankBatches(IterableDataset):
        """This rank's half of every global batch, in the shared epoch order (no collate)."""

        def __init__(self) -> None:
            self.epoch = 0

        def __len__(self) -> int:
            return args.steps

        def __iter__(self):  # type: ignore[no-untyped-def]
            order = epoch_order(len(x), self.epoch)
            xs, ys = x[order], y[order]
            self.epoch += 1
            for step in range(args.steps):
                rows = rank_rows(step, rank)
                yield xs[rows], ys[rows]

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()
            self.loss_sum = torch.zeros((), dtype=torch.float64)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            xb, yb = batch
            loss = F.cross_entropy(self.net(xb), yb)
            self.loss_sum += loss.detach() * len(xb)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=LR)

    class EpochTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.loss = float("nan")

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            module.loss_sum.zero_()
            self.t0 = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            total = module.loss_sum.clone()
            dist.all_reduce(total)
            self.loss = float(total) / len(x)
            self.times.append(time.perf_counter() - self.t0)

    start = time.perf_counter()
    timer = EpochTimer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp", max_epochs=args.epochs,
        logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[timer],
    )
    trainer.fit(Lit(), DataLoader(RankBatches(), batch_size=None))
    report("c", rank, timer.times, args.warmup, len(x), timer.loss, time.perf_counter() - start)
    # Lightning leaves the process group up; gloo torn down at interpreter exit while the peer
    # still talks aborts the process (SIGABRT, "terminate called without an active exception").
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------------------


def launch(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one case; rank 0's JSON line, or ``{"error": ...}``. Kills the process group on
    timeout so no rank is left behind."""
    worker = [os.path.abspath(__file__), "--worker", case, "--steps", str(args.steps),
              "--epochs", str(args.epochs), "--warmup", str(args.warmup)]
    if case == "d":
        cmd = [sys.executable, *worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *worker]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return {"error": f"timed out after {args.timeout:.0f} s", "output": output}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rank0 = [line for line in parse(output) if line["rank"] == 0]
    if proc.returncode != 0 or not rank0:
        return {"error": f"exit code {proc.returncode}", "output": output}
    return rank0[0]


def parse(output: str) -> list[dict[str, Any]]:
    """Every worker's JSON line in ``output``."""
    found = []
    for line in output.splitlines():
        if line.startswith(TAG):
            try:
                found.append(json.loads(line[len(TAG):]))
            except ValueError:
                pass  # a torn line; the launch then counts as failed if it was rank 0's
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, one round")
    parser.add_argument("--rounds", type=int, default=10, help="launches of every case")
    parser.add_argument("--steps", type=int, default=40, help="global batches per epoch")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per launch")
    parser.add_argument("--warmup", type=int, default=1, help="epochs left out of the timing")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per launch")
    parser.add_argument("--cases", default="abcd", help="which of a, b, c, d to run")
    parser.add_argument("--json", default=None, help="write the numbers here")
    parser.add_argument("--worker", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.epochs = 1, 8, 3
    if args.warmup >= args.epochs:
        parser.error(f"--warmup {args.warmup} leaves no timed epoch of --epochs {args.epochs}")
    torch.set_num_threads(1)

    if args.worker is not None:
        workers: dict[str, Callable[[], None]] = {
            "a": lambda: run_fitdp(args, "auto", GLOBAL_BATCH // WORLD),
            "b": lambda: run_ddp(args),
            "c": lambda: run_lightning(args),
            "d": lambda: run_fitdp(args, ["cpu", "cpu"], GLOBAL_BATCH),
        }
        workers[args.worker]()
        return 0

    cases = [c for c in sorted(CASES) if c in args.cases]
    has_lightning = any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning"))
    if "c" in cases and not has_lightning:
        print("lightning not installed: skipping (c)")
        cases.remove("c")
    print(f"MLP {'-'.join(map(str, SIZES))}, global batch {GLOBAL_BATCH}, {args.steps} steps x "
          f"{args.epochs} epochs ({args.warmup} warm-up), {args.rounds} round(s), 1 thread/process")
    load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"load average before: {load_before}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    for r in range(args.rounds):
        # a b c d, then d c b a, ...: no case always runs first, and (a), (b) stay adjacent.
        for c in cases if r % 2 == 0 else cases[::-1]:
            t = time.perf_counter()
            res = launch(c, args)
            runs[c].append(res)
            status = res.get("error") or f"{res['samples_per_s']:.0f} samples/s"
            print(f"  round {r + 1} ({c}) {CASES[c]}: {status} [{time.perf_counter() - t:.1f} s]",
                  flush=True)
            if "error" in res:
                print(res["output"][-3000:], file=sys.stderr)
    load_after = " ".join(f"{v:.2f}" for v in os.getloadavg())

    rows: dict[str, dict[str, Any]] = {}
    for c in cases:
        ok = [r for r in runs[c] if "error" not in r]
        if ok:
            per_run = [r["samples_per_s"] for r in ok]
            rows[c] = {"name": CASES[c], "samples_per_s": statistics.median(per_run),
                       "runs_samples_per_s": per_run, "loss": ok[-1]["loss"],
                       "total_s": statistics.median(r["total_s"] for r in ok)}
    ref = rows.get("b", {}).get("samples_per_s")
    print(f"\n{'case':<42} {'samples/s':>10} {'vs (b)':>7} {'ms/step':>8} {'final loss':>11} "
          f"{'rounds min-max':>15}")
    for c in cases:
        if c not in rows:
            print(f"({c}) {CASES[c]:<38} {'FAILED':>10}")
            continue
        row = rows[c]
        row["ratio_vs_b"] = row["samples_per_s"] / ref if ref else None
        ratio = f"{row['ratio_vs_b']:.3f}" if ref else "-"
        ms = GLOBAL_BATCH / row["samples_per_s"] * 1e3
        spread = f"{min(row['runs_samples_per_s']):.0f}-{max(row['runs_samples_per_s']):.0f}"
        print(f"({c}) {CASES[c]:<38} {row['samples_per_s']:>10.0f} {ratio:>7} {ms:>8.2f} "
              f"{row['loss']:>11.5f} {spread:>15}")
    print(f"load average after: {load_after}")
    target = None
    if "a" in rows and ref:
        # (a) and (b) of one round ran back to back: their ratio is the least exposed to load
        # from other processes drifting between rounds.
        paired = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs["a"], runs["b"])
                  if "error" not in a and "error" not in b]
        q = statistics.quantiles(paired, n=4, method="inclusive") if len(paired) > 1 \
            else paired * 3
        rows["a"].update(paired_ratios_vs_b=paired, paired_ratio_quartiles=q)
        target = q[1] >= TARGET
        print(f"(a)/(b) per round, back to back: {', '.join(f'{r:.3f}' for r in paired)}")
        print(f"target (a) >= {TARGET}x (b), median of the rounds' ratios: {q[1]:.3f}x (IQR "
              f"{q[0]:.3f} to {q[2]:.3f}; ratio of the medians {rows['a']['ratio_vs_b']:.3f}x) "
              f"{'met' if target else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: getattr(args, k) for k in ("steps", "epochs", "warmup",
                                                                  "rounds", "quick")},
                       "loadavg_before": load_before, "loadavg_after": load_after,
                       "rows": rows, "target_met": target}, f, indent=2)
    return 0 if len(rows) == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
