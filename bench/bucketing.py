"""Variable-length sequences: real tokens/s of four ways to batch, and what buckets cost in memory.

Run: python bench/bucketing.py [--quick] [--epochs 5] [--no-memory] [--json out]
     python bench/bucketing.py --fit-cost     (fit the step-time model of automatic buckets)
     python bench/bucketing.py --compile      (compile=True with buckets: cold, warm cache)

A GRU classifier (Embedding 1000x64, GRU 64 hidden, a head on the last valid step) on 4,000
sequences with log-normal lengths in [4, 256] (mean about 40), batch 32, Adam, one thread:

  (a) pad everything to 256, random batches                            hand loop
  (b) random batches, each padded to its own longest                   hand loop
  (c) shuffle, sort by length inside mega-batches of 50 batches, pad   hand loop
      each batch to its longest (the usual PyTorch recipe)
  (d) ``fitdp.BucketIterator`` (automatic buckets) through ``Model.fit``
  (e) the rows as a list of dicts, a collate function padding each batch to its longest,
      ``Model.fit(rows, collate_fn=pad, group_by_length="tokens")`` (a Hugging Face user's
      ``group_by_length``: the same automatic buckets, padded per batch by the collator)

Speed: the five train in one process, their epochs interleaved; real tokens/s counts the
sequences' tokens (padding excluded) per second of CPU time of the fastest epoch. Memory: 20
buckets (``bucket_module``: one executor group each) over all the data against the largest
bucket alone, each in a fresh process (median of 5): peak RSS, and the part training added
(peak less the RSS before the first step).

``--fit-cost`` times one step of the GRU on rows 1..32 x widths 4..256 and fits the model
automatic buckets minimise, ``fixed + per_timestep * width + per_token * rows * width`` ms
(``fitdp.data.length_groups.GRU_CPU_STEP_COST`` holds the result), by least squares on the
relative error. ``--compile`` trains a token tagger (no RNN: dynamo does not trace
``nn.GRU``) on 160 sequences in 4 buckets, eager and ``compile=True``, each mode in a fresh
process sharing one inductor cache: the first fit (cold, then warm cache) and a steady step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from common import Results, parser, pin_threads
from torch import nn
from torch.nn import functional as F

import fitdp

N, VOCAB, DIM, BATCH, MEGA = 4000, 1000, 64, 32, 50


class GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)
        self.head = nn.Linear(DIM, 2)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(tokens))
        return self.head(h[torch.arange(len(tokens)), lengths - 1])


def make_data(n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Log-normal lengths clipped to [4, 256], mean ~40; label: whether token 1 occurs."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(40.0) - 0.32, 0.8, n)), 4, 256).astype(int)
    labels = rng.integers(0, 2, n)
    seqs = []
    for k, label in zip(lengths, labels):
        s = rng.integers(2, VOCAB, k)
        if label:
            s[rng.integers(0, k)] = 1
        seqs.append(torch.from_numpy(s))
    return seqs, torch.from_numpy(labels)


def plan(strategy: str, lengths: np.ndarray, epoch: int) -> list[list[int]]:
    """The batches (sample indices) of one epoch of a hand-loop strategy."""
    g = np.random.default_rng(1000 + epoch)
    order = g.permutation(len(lengths))
    if strategy == "c":  # sort inside each mega-batch, then shuffle the batches
        chunks = np.split(order, range(BATCH * MEGA, len(order), BATCH * MEGA))
        order = np.concatenate([c[np.argsort(lengths[c], kind="stable")] for c in chunks])
    batches = [order[i:i + BATCH].tolist() for i in range(0, len(order), BATCH)]
    return [batches[i] for i in g.permutation(len(batches))] if strategy == "c" else batches


class Strategy:
    """One way to batch; ``epoch(e)`` trains one epoch and returns (real, padded) tokens."""

    def __init__(self, key: str, n: int) -> None:
        seqs, labels = make_data(n)
        self.lengths = np.array([len(s) for s in seqs])
        torch.manual_seed(0)
        self.key, self.net, self.seqs, self.labels = key, GRUClassifier(), seqs, labels
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        if key in ("a", "b", "c"):
            return
        if key == "e":
            self.rows = [{"tokens": s, "label": int(y)} for s, y in zip(seqs, labels)]
            self.model = fitdp.Model(self.net)
            self.model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy")
            return
        buckets = None  # (d): automatic
        if key != "d":  # 20 buckets at length quantiles; the largest holds the longest
            buckets = sorted({int(q) for q in np.quantile(self.lengths, np.linspace(0.05, 1, 20))})
        if key == "m1":  # the samples of the largest bucket only
            keep = [i for i in range(n) if self.lengths[i] > buckets[-2]]  # type: ignore[index]
            seqs, labels, buckets = [seqs[i] for i in keep], labels[keep], buckets[-1:]  # type: ignore[index]
        self.it = fitdp.BucketIterator(seqs, labels, batch_size=BATCH, buckets=buckets,
                                       include_lengths=True, seed=0)
        self.model = fitdp.Model(self.net, bucket_module=None if key == "d" else (
            lambda k: GRUClassifier()))
        self.model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy")

    def epoch(self, e: int) -> tuple[int, int]:
        if self.key == "e":
            self.padded = 0
            self.model.fit(self.rows, batch_size=BATCH, epochs=e + 1, initial_epoch=e, seed=0,
                           collate_fn=self.pad, group_by_length="tokens", devices=["cpu"],
                           verbose=0)
            return int(self.lengths.sum()), self.padded
        if self.key not in ("a", "b", "c"):
            self.model.fit(self.it, epochs=e + 1, initial_epoch=e, devices=["cpu"], verbose=0)
            return self.it.num_tokens, round(self.it.num_tokens / (1 - self.it.padding_fraction))
        real = padded = 0
        for index in plan(self.key, self.lengths, e):
            lengths = torch.tensor([len(self.seqs[i]) for i in index])
            x = torch.zeros(len(index), 256 if self.key == "a" else int(lengths.max()),
                            dtype=torch.long)
            for row, i in enumerate(index):
                x[row, :len(self.seqs[i])] = self.seqs[i]
            self.opt.zero_grad()
            F.cross_entropy(self.net(x, lengths), self.labels[index]).backward()
            self.opt.step()
            real, padded = real + int(lengths.sum()), padded + x.numel()
        return real, padded


    def pad(self, rows: list[dict]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(e)'s collate function: tokens padded to the batch's longest, their lengths."""
        lengths = torch.tensor([len(r["tokens"]) for r in rows])
        x = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
        for row, r in enumerate(rows):
            x[row, :len(r["tokens"])] = r["tokens"]
        self.padded += x.numel()
        return (x, lengths), torch.tensor([r["label"] for r in rows])


def memory(key: str, n: int, epochs: int) -> dict[str, float]:
    """Peak RSS (MiB) of ``epochs`` epochs of one strategy, and what training added."""
    pin_threads()
    strategy = Strategy(key, n)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    for e in range(epochs):
        strategy.epoch(e)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak": peak, "train": peak - before}


def speed(out: Results, n: int, epochs: int) -> None:
    strategies = [Strategy(k, n) for k in "abcde"]
    cpu: dict[str, list[float]] = {s.key: [] for s in strategies}
    tokens: dict[str, tuple[int, int]] = {}
    for e in range(epochs):
        for s in strategies[e % 5:] + strategies[:e % 5]:
            t = time.process_time()
            tokens[s.key] = s.epoch(e)
            cpu[s.key].append(time.process_time() - t)
    rate = {k: tokens[k][0] / min(cpu[k]) for k in cpu}  # the fastest epoch, as timeit does
    pad = {k: 1 - real / padded for k, (real, padded) in tokens.items()}
    out.extra["tokens_per_s"], out.extra["padding"] = rate, pad
    for ref, name, target in (("c", "(c) length-grouped sampler", 0.97),
                              ("a", "(a) pad all to 256", 2.0),
                              ("b", "(b) pad to the batch's longest", None)):
        out.row("speed", f"GRU, real tokens/s: (d) BucketIterator vs {name}", name, rate[ref],
                rate["d"],
                "tokens/s", None, ">=" if target else "", target)
    out.row("speed", "padding of automatic buckets", "(c)'s", pad["c"], pad["d"], "fraction",
            pad["d"], "<=", 0.05, "ratio: (d)'s padding itself")
    for ref, name, target in (("b", "(b) pad to the batch's longest", 2.0),
                              ("c", "(c) length-grouped sampler", None)):
        out.row("speed", f"GRU, real tokens/s: (e) fit(group_by_length) vs {name}", name,
                rate[ref], rate["e"], "tokens/s", None, ">=" if target else "", target)


def memories(out: Results, n: int, epochs: int, quick: bool) -> None:
    got: dict[str, dict[str, float]] = {}
    for key in ("m20", "m1"):
        if quick:  # in this process: the code runs, the numbers mean little
            got[key] = memory(key, n, epochs)
            continue
        runs = []
        for _ in range(5):
            proc = subprocess.run([sys.executable, __file__, "--memory-child", key],
                                  capture_output=True, text=True, check=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        got[key] = sorted(runs, key=lambda r: r["train"])[2]
    for part, what in (("peak", "peak RSS"), ("train", "RSS training added")):
        out.row("memory", f"{what}: 20 buckets", "the largest bucket alone", got["m1"][part],
                got["m20"][part], "MiB", None, "<=", 1.05)


def fit_cost(rounds: int = 7) -> None:
    """Time one step over rows x widths; fit and print the two step-time models."""
    pin_threads()
    torch.manual_seed(0)
    net = GRUClassifier()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    grid = [(r, w) for r in (1, 2, 4, 8, 16, 24, 32) for w in (4, 8, 16, 32, 64, 128, 256)]
    times: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
    for _ in range(rounds):  # interleaved: a busy moment hits every point alike
        for rows, width in grid:
            x, n = torch.randint(2, VOCAB, (rows, width)), torch.full((rows,), width)
            y, steps = torch.randint(0, 2, (rows,)), max(1, 2000 // (rows * width))
            for i in range(steps + 1):  # the first is a warm-up
                if i == 1:
                    t = time.process_time()
                opt.zero_grad()
                F.cross_entropy(net(x, n), y).backward()
                opt.step()
            times[(rows, width)].append((time.process_time() - t) / steps * 1e3)
    t_ms = np.array([np.median(times[g]) for g in grid])
    r, w = np.array(grid, dtype=np.float64).T
    for name, cols in (("fixed, per_timestep, per_token", [np.ones_like(r), w, r * w]),
                       ("fixed, per_token", [np.ones_like(r), r * w])):
        a = np.stack(cols, 1) / t_ms[:, None]  # least squares on the relative error
        coef = np.linalg.lstsq(a, np.ones_like(t_ms), rcond=None)[0]
        err = np.abs(a @ coef - 1)
        print(f"{name}: {', '.join(f'{c:.4g}' for c in coef)} ms; error: median "
              f"{np.median(err):.1%}, worst {err.max():.1%}")


class Tagger(nn.Module):
    """A token tagger without an RNN (dynamo does not trace ``nn.GRU``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.emb(tokens)))).transpose(1, 2)


def compile_cost(mode: str) -> None:
    """One mode's first fit (it compiles) and second fit (the steady state): one row."""
    pin_threads()
    torch.manual_seed(0)
    seqs = [torch.randint(1, 50, (int(n),)) for n in torch.randint(3, 30, (160,))]
    it = fitdp.BucketIterator(seqs, [s % 3 for s in seqs], batch_size=16,
                              buckets=[8, 16, 24, 30], seed=0)
    model = fitdp.Model(Tagger())
    model.compile(optimizer="adam", loss="cross_entropy", compile=mode != "eager")
    seconds = []
    for _ in range(2):
        t = time.perf_counter()
        model.fit(it, devices=["cpu"], verbose=0)
        seconds.append(time.perf_counter() - t)
    print(f"| {mode:<5} | {len(it)} | {seconds[0]:8.2f} | {seconds[1] / len(it) * 1e3:7.2f} |")


def compile_modes() -> None:
    """Eager, compiled with a cold inductor cache, then with it warm: each a fresh process
    on the same ``TORCHINDUCTOR_CACHE_DIR``."""
    print("| mode  | steps | first fit s | steady ms/step |\n|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        for mode in ("eager", "cold", "warm"):
            subprocess.run([sys.executable, __file__, "--compile-child", mode], check=True,
                           env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}, timeout=900)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--epochs", type=int, default=5, help="epochs timed per strategy")
    p.add_argument("--no-memory", action="store_true", help="the speed comparison only")
    p.add_argument("--fit-cost", action="store_true", help="fit the step-time model, then exit")
    p.add_argument("--compile", action="store_true",
                   help="what compile=True costs with buckets (cold and warm cache), then exit")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    p.add_argument("--compile-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fit_cost:
        return fit_cost()
    if args.compile or args.compile_child:
        return compile_cost(args.compile_child) if args.compile_child else compile_modes()
    n, epochs = (800, 1) if args.quick else (N, args.epochs)  # 800: still 20 distinct buckets
    if args.memory_child:
        return print(json.dumps(memory(args.memory_child, n, 2)))
    pin_threads()
    out = Results("bucketing", args)
    if not args.no_memory:
        print("[memory]", flush=True)
        memories(out, n, 1 if args.quick else 2, args.quick)
    print("[speed]", flush=True)
    speed(out, 320 if args.quick else n, epochs)
    out.finish()


if __name__ == "__main__":
    main()
