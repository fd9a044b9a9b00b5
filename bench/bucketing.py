"""Variable-length training: speed, padding and memory of four ways to batch, and bucket memory.

Run: python bench/bucketing.py [--epochs 5] [--memory-epochs 2] [--json out.json] [--quick]
     python bench/bucketing.py --no-memory     (the speed comparison only)
     python bench/bucketing.py --fit-cost      (fit the step-time model of automatic buckets)

Workload: a GRU classifier (Embedding 1000x64, GRU 64 hidden, linear head on the last valid
step) on 4,000 sequences with log-normal lengths in [4, 256] (mean about 40), batch 32, Adam,
one thread (torch.set_num_threads(1)), the same epochs for every strategy:

  (a) pad everything to the maximum length (256), random batches      hand loop
  (b) random batches, each padded to its own longest sequence          hand loop
  (c) length-grouped sampler: shuffle, sort inside mega-batches of 50   hand loop
      batches, pad each batch to its longest (the usual PyTorch recipe)
  (d) fitdp.BucketIterator (automatic buckets) through Model.fit       fitdp, devices=["cpu"]

Speed: the four strategies train in one process, their epochs interleaved (a b c d, then
b c d a, ...). Batches are built inside the timed loop for every strategy. "real tokens/s"
counts the tokens of the sequences (padding excluded) per second of the process's CPU time
(``time.process_time``, all threads) in the fastest epoch: with one compute thread, CPU time is
what the training costs, and unlike the wall clock it does not grow when other processes take
the CPU (caches and memory bandwidth are still shared). The wall-clock rate of the fastest
epoch is printed next to it, and the (d)/(c) ratio of median epochs below the table. fitdp's
epochs are ``Model.fit(..., initial_epoch=e, epochs=e + 1)`` calls, each with its own
begin/end, which one long fit would not pay.

Memory: peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) counts everything the process ever held
(torch's own ~200+ MB included), so it makes every ratio look close to 1. We also report the
training increment: peak RSS minus the RSS just before training starts (model and data built,
nothing trained): the memory that training itself added (activations, gradients, optimizer
state, input buffers, executor groups). The bucket-memory target compares two fitdp runs with
``bucket_module`` (one executor group per bucket): 20 buckets over all the data against the
largest bucket alone (its samples only), on both measures. Each memory run is a fresh process
per strategy (``--memory-epochs`` epochs); the two bucket-memory runs (m20, m1) take the median
of ``MEMORY_REPEATS`` fresh processes by training RSS, which moved by up to 6 MB between identical
runs here. tracemalloc would not see tensor memory at all
(torch allocates outside Python's allocator), so it is not used.

Targets: (d) >= 2x real tokens/s of (a) and >= 0.97x of (c); (d) padding <= 5%; peak memory with
20 buckets <= 1.05x the largest bucket alone.

Step-time model (``--fit-cost``): automatic buckets minimise the modelled time of an epoch,
``fitdp.data.bucketing.StepCost``: a step on ``rows`` sequences padded to ``width`` takes ``fixed +
per_timestep * width + per_token * rows * width``. ``--fit-cost`` times one training step of
this GRU (one thread, process CPU time, median of 7 interleaved rounds) on rows 1..32 x widths
4..256 and fits that model and the two-constant ``fixed + per_token * rows * width`` by least
squares on the relative error; ``fitdp.data.bucketing.GRU_CPU_STEP_COST`` holds the result.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# torch's optimizers import torch._dynamo when first built (~1 s, ~60 MB of RSS). Imported here,
# before anything is measured, it is billed to no strategy.
import torch._dynamo  # noqa: F401
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp (children too)

N, VOCAB, DIM, BATCH, MEGA = 4000, 1000, 64, 32, 50
MEMORY_REPEATS = 5
STRATEGIES = {
    "a": "(a) pad all to 256",
    "b": "(b) random, pad to batch max",
    "c": "(c) length-grouped sampler",
    "d": "(d) fitdp BucketIterator",
    "m20": "fitdp, 20 buckets",
    "m1": "fitdp, largest bucket alone",
}


class GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)
        self.head = nn.Linear(DIM, 2)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(tokens))
        return self.head(h[torch.arange(len(tokens)), lengths - 1])


def make_data(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Log-normal lengths clipped to [4, 256], mean ~40; label: token 1 occurs (half do)."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    lengths = np.clip(np.round(rng.lognormal(np.log(40.0) - sigma**2 / 2, sigma, N)), 4, 256)
    labels = rng.integers(0, 2, N)
    seqs = []
    for n, label in zip(lengths.astype(int), labels):
        s = rng.integers(2, VOCAB, n)
        if label:
            s[rng.integers(0, n)] = 1
        seqs.append(torch.from_numpy(s))
    return seqs, torch.from_numpy(labels)


def pad(seqs: list[torch.Tensor], index: list[int], width: int | None) -> tuple[torch.Tensor, ...]:
    """Pad ``seqs[index]`` to ``width`` (None: the batch's longest); returns tokens, lengths."""
    lengths = torch.tensor([len(seqs[i]) for i in index])
    out = torch.zeros(len(index), int(lengths.max()) if width is None else width, dtype=torch.long)
    for row, i in enumerate(index):
        out[row, : len(seqs[i])] = seqs[i]
    return out, lengths


def plan(strategy: str, lengths: np.ndarray, epoch: int) -> list[list[int]]:
    """The batches (sample indices) of one epoch of a hand-loop strategy."""
    g = np.random.default_rng(1000 + epoch)
    order = g.permutation(len(lengths))
    if strategy == "c":  # sort by length inside each mega-batch, then shuffle the batches
        mega = BATCH * MEGA
        order = np.concatenate([
            chunk[np.argsort(lengths[chunk], kind="stable")]
            for chunk in np.split(order, range(mega, len(order), mega))
        ])
    batches = [order[i:i + BATCH].tolist() for i in range(0, len(order), BATCH)]
    if strategy == "c":
        batches = [batches[i] for i in g.permutation(len(batches))]
    return batches


def rss_now_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


class Strategy:
    """One way to batch, trained one epoch at a time: ``epoch(e)`` -> (real, padded) tokens."""

    def __init__(self, key: str) -> None:
        seqs, labels = make_data()
        lengths = np.array([len(s) for s in seqs])
        torch.manual_seed(0)
        self.key, self.net = key, GRUClassifier()
        self.seqs, self.labels, self.lengths = seqs, labels, lengths
        self.opt: torch.optim.Optimizer | None = None
        if key in ("a", "b", "c"):
            return
        import fitdp  # noqa: PLC0415 - the hand-loop children never import it

        if key == "d":
            buckets = None  # automatic
        else:  # 20 buckets at length quantiles; the largest is the longest sample
            buckets = sorted({int(q) for q in np.quantile(lengths, np.linspace(0.05, 1, 20))})
        if key == "m1":  # the samples of the largest bucket only
            keep = [i for i in range(N) if lengths[i] > buckets[-2]]
            seqs, labels, buckets = [seqs[i] for i in keep], labels[keep], [buckets[-1]]
        self.it = fitdp.BucketIterator(seqs, labels, batch_size=BATCH, buckets=buckets,
                                       include_lengths=True, seed=0)
        # (d) is plain Model.fit on a BucketIterator; m20/m1 give every bucket its own group.
        bucket_module = None if key == "d" else (lambda k: GRUClassifier())
        self.model = fitdp.Model(self.net, bucket_module=bucket_module)
        self.model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy")

    def epoch(self, e: int) -> tuple[int, int]:
        if self.key not in ("a", "b", "c"):
            self.model.fit(self.it, epochs=e + 1, initial_epoch=e, devices=["cpu"], verbose=0)
            if self.key == "m20":
                assert len(self.model._replicas.manager.groups) == len(self.it.buckets) == 20
            real = self.it.num_tokens
            return real, round(real / (1 - self.it.padding_fraction))
        if self.opt is None:  # built in the first epoch, as fit builds its own
            self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        real = padded = 0
        for index in plan(self.key, self.lengths, e):
            x, n = pad(self.seqs, index, 256 if self.key == "a" else None)
            self.opt.zero_grad()
            F.cross_entropy(self.net(x, n), self.labels[index]).backward()
            self.opt.step()
            real, padded = real + int(n.sum()), padded + x.numel()
        return real, padded


def memory(key: str, epochs: int) -> dict[str, Any]:
    """Peak RSS of ``epochs`` epochs of one strategy, and the part training added."""
    torch.set_num_threads(1)
    strategy = Strategy(key)
    before = rss_now_kb()
    for e in range(epochs):
        real, padded = strategy.epoch(e)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    return {"padding": 1 - real / padded, "peak_rss_mb": peak / 1024,
            "train_rss_mb": (peak - before) / 1024}


def memory_child(key: str, epochs: int) -> dict[str, Any]:
    """``memory(key, epochs)`` in a fresh process (no RSS left over from other strategies)."""
    proc = subprocess.run(
        [sys.executable, __file__, "--run", key, "--memory-epochs", str(epochs)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def speed(keys: list[str], epochs: int) -> dict[str, dict[str, Any]]:
    """Real tokens/s of each strategy, epochs interleaved (a b c d, b c d a, ...) in one
    process, timed by the process's CPU time and by the wall clock."""
    torch.set_num_threads(1)
    strategies = [Strategy(k) for k in keys]
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    wall: dict[str, list[float]] = {k: [] for k in keys}
    tokens: dict[str, tuple[int, int]] = {}
    for e in range(epochs):
        for s in strategies[e % len(keys):] + strategies[:e % len(keys)]:
            tic, tic_cpu = time.perf_counter(), time.process_time()
            tokens[s.key] = s.epoch(e)
            cpu[s.key].append(time.process_time() - tic_cpu)
            wall[s.key].append(time.perf_counter() - tic)
    # The fastest epoch, as timeit keeps the fastest run: other processes only slow runs down.
    return {k: {"tokens_per_s": tokens[k][0] / min(cpu[k]),
                "wall_tokens_per_s": tokens[k][0] / min(wall[k]), "real": tokens[k][0],
                "padded": tokens[k][1], "cpu_seconds": cpu[k], "wall_seconds": wall[k]}
            for k in keys}


def fit_cost(rounds: int = 7) -> None:
    """Time one training step of the GRU over rows x widths; fit and print the step models."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = GRUClassifier()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)

    def step(x: torch.Tensor, n: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(net(x, n), y).backward()
        opt.step()

    grid = [(r, w) for r in (1, 2, 4, 8, 16, 24, 32) for w in (4, 8, 16, 32, 64, 128, 256)]
    ms: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
    for _ in range(rounds):  # interleaved: a busy moment of the machine hits every point alike
        for rows, width in grid:
            x, n = torch.randint(2, VOCAB, (rows, width)), torch.full((rows,), width)
            y, steps = torch.randint(0, 2, (rows,)), max(1, 2000 // (rows * width))
            step(x, n, y)  # warm-up, untimed
            tic = time.process_time()
            for _ in range(steps):
                step(x, n, y)
            ms[(rows, width)].append((time.process_time() - tic) / steps * 1e3)
    t = np.array([np.median(ms[g]) for g in grid])
    r, w = np.array(grid, dtype=np.float64).T
    models = {"fixed, per_timestep, per_token": [np.ones_like(r), w, r * w],
              "fixed, per_token (two constants)": [np.ones_like(r), r * w]}
    for name, cols in models.items():
        a = np.stack(cols, 1) / t[:, None]  # least squares on the relative error
        coef = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
        err = np.abs(a @ coef - 1)
        print(f"{name}: {', '.join(f'{c:.4g}' for c in coef)} ms; error: median "
              f"{np.median(err):.1%}, worst {err.max():.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5, help="epochs timed per strategy")
    parser.add_argument("--memory-epochs", type=int, default=2,
                        help="epochs of each memory run (one process per strategy)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 800 sequences, 1 epoch each; the targets do not apply")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument("--fit-cost", action="store_true",
                        help="fit the bucketing step-time model on this machine, then exit")
    parser.add_argument("--run", choices=list(STRATEGIES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit_cost:
        fit_cost()
        return
    if args.quick:  # 800 still gives 20 distinct quantile buckets for m20
        global N
        N, args.epochs, args.memory_epochs = 800, 1, 1
    if args.run:  # a child: one strategy's memory, one JSON line
        print(json.dumps(memory(args.run, args.memory_epochs)))
        return

    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}; speed: {args.epochs} epochs "
          f"each, memory: {args.memory_epochs} epochs each", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for key in [] if args.no_memory else STRATEGIES:
        if args.quick:  # in this process: no torch start-up per strategy; RSS means little
            results[key] = memory(key, args.memory_epochs)
            continue
        runs = [memory_child(key, args.memory_epochs)
                for _ in range(MEMORY_REPEATS if key in ("m20", "m1") else 1)]
        results[key] = sorted(runs, key=lambda r: r["train_rss_mb"])[len(runs) // 2]
    print("  memory runs done", flush=True)
    for key, r in speed(["a", "b", "c", "d"], args.epochs).items():
        results.setdefault(key, {"padding": 1 - r["real"] / r["padded"]}).update(r)
    load = os.getloadavg()
    print(f"load average after:  {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")

    header = (f"| {'strategy':<30} | {'real tokens/s':>13} | {'(wall clock)':>12} | "
              f"{'padding':>7} | {'peak RSS MB':>11} | {'training RSS MB':>15} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for key, r in results.items():
        timed, rss = "tokens_per_s" in r, "peak_rss_mb" in r
        fast = f"{r['tokens_per_s']:13,.0f}" if timed else f"{'-':>13}"
        wall = f"{r['wall_tokens_per_s']:12,.0f}" if timed else f"{'-':>12}"
        peak = f"{r['peak_rss_mb']:11.0f}" if rss else f"{'-':>11}"
        train = f"{r['train_rss_mb']:15.1f}" if rss else f"{'-':>15}"
        print(f"| {STRATEGIES[key]:<30} | {fast} | {wall} | {r['padding']:7.1%} | {peak} | "
              f"{train} |")
    print("real tokens/s: tokens of the sequences (padding excluded) per second of CPU time of the"
          "\nfastest epoch; (wall clock): the same per second of wall time.")

    a, c, d = (results[k] for k in ("a", "c", "d"))
    median = np.median(c["cpu_seconds"]) / np.median(d["cpu_seconds"])
    print(f"(d) / (c) real tokens/s of the median epochs: {median:.3f}; per round: "
          + " ".join(f"{x / y:.3f}" for x, y in zip(c["cpu_seconds"], d["cpu_seconds"])))
    checks = [
        ("(d) / (a) real tokens/s", d["tokens_per_s"] / a["tokens_per_s"], ">=", 2.0),
        ("(d) / (c) real tokens/s", d["tokens_per_s"] / c["tokens_per_s"], ">=", 0.97),
        ("(d) padding (automatic buckets)", d["padding"], "<=", 0.05),
    ]
    if not args.no_memory:
        m20, m1 = results["m20"], results["m1"]
        checks += [("peak RSS, 20 buckets / largest alone",
                    m20["peak_rss_mb"] / m1["peak_rss_mb"], "<=", 1.05),
                   ("training RSS, 20 buckets / largest alone",
                    m20["train_rss_mb"] / m1["train_rss_mb"], "<=", 1.05)]
    print()
    for name, value, op, target in checks:
        ok = value >= target if op == ">=" else value <= target
        print(f"{name:<42} {value:7.3f}  (target {op} {target})  {'ok' if ok else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "checks": {n: v for n, v, _, _ in checks}}, f, indent=2)


if __name__ == "__main__":
    main()
