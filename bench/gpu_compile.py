"""The compile part of ``bench/gpu.py``: ``compile=True`` with a ``BucketIterator``.

One graph per bucket shape in the first epoch and no recompile after it; CUDA graphs per
bucket (``mode="reduce-overhead"``) where they work, else plain compile (on the CPU dry run:
dynamo with the eager backend, which needs no C++ compiler and compiles in a second).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from gpu_parts import Ctx, Result
from torch import nn

import fitdp


class SeqNet(nn.Module):
    """Embedding, a position-wise MLP, mean over time, a classifier: one graph per shape."""

    def __init__(self, vocab: int, width: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.emb(tokens)).mean(1))


@contextlib.contextmanager
def compile_options(**options: Any) -> Iterator[None]:
    """torch.compile with ``options`` (e.g. mode="reduce-overhead") for the replicas fitdp
    compiles in the block: fitdp's compile=True takes no options of its own."""
    original = torch.compile

    def patched(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**options, **kwargs})

    torch.compile = patched  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return int(counters["stats"]["unique_graphs"])


REDUCE_OVERHEAD_S = 60  # time a CUDA-graph run needs (3 shapes to compile, 4 epochs)


def sequences(buckets: list[int], per_bucket: int, vocab: int, classes: int
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``per_bucket`` sequences of lengths in each bucket's range, and a label each; with
    ``per_bucket`` a multiple of the batch size every batch is full: one shape per bucket."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, vocab, (int(n),), generator=g)
            for low, high in zip([1, *buckets[:-1]], buckets)
            for n in torch.randint(low + 1, high + 1, (per_bucket,), generator=g)]
    return seqs, torch.tensor([int(s[0]) % classes for s in seqs])


def compile_part(ctx: Ctx, res: Result) -> None:
    """compile=True on a BucketIterator: one graph per bucket shape in the first epoch, no
    recompile after it (target 0); plain compile, then CUDA graphs per bucket
    (mode="reduce-overhead") when time is left; time per step against eager."""
    d = ctx.device
    vocab, width, classes, bs, buckets, epochs = (
        (2000, 256, 8, 64, [16, 32, 64], 4) if ctx.cuda else (50, 16, 3, 8, [6, 12], 2))
    seqs, labels = sequences(buckets, bs * (8 if ctx.cuda else 2), vocab, classes)

    def fit_epochs(model: fitdp.Model) -> tuple[list[float], list[int]]:
        """Seconds and graphs compiled so far, per epoch."""
        it = fitdp.BucketIterator(seqs, labels, batch_size=bs, buckets=buckets, seed=0)
        seconds, graphs = [], []
        for _ in range(epochs):
            ctx.sync()
            start = time.perf_counter()
            model.fit(it, devices=[d], verbose=0)
            ctx.sync()
            seconds.append(time.perf_counter() - start)
            graphs.append(graphs_compiled())
        return seconds, graphs

    def build(compile: bool) -> fitdp.Model:
        torch.manual_seed(0)
        model = fitdp.Model(SeqNet(vocab, width, classes))
        model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy", compile=compile)
        return model

    steps = len(fitdp.BucketIterator(seqs, labels, batch_size=bs, buckets=buckets, seed=0))
    eager: dict[str, float] = {}

    def run_eager() -> None:
        seconds, _ = fit_epochs(build(False))
        eager["ms"] = statistics.median(seconds[1:]) / steps * 1e3
        res.row("eager: ms / step", f"{eager['ms']:.3f}")

    res.attempt("compile: eager", run_eager)
    modes = [{}, {"mode": "reduce-overhead"}] if ctx.cuda else [{"backend": "eager"}]
    for options in modes:
        if options and ctx.deadline - time.perf_counter() < REDUCE_OVERHEAD_S:
            res.row("compile, mode=reduce-overhead", "not run: out of time")
            break
        label = "compile, " + (", ".join(f"{k}={v}" for k, v in options.items())
                               or "default mode")

        def run(options: dict[str, Any] = options, label: str = label) -> None:
            import torch._dynamo  # noqa: PLC0415

            torch._dynamo.reset()
            before = graphs_compiled()
            with compile_options(**options):
                model = build(True)
                seconds, graphs = fit_epochs(model)
            executors = [ex for grp in model._replicas.manager.groups.values()  # type: ignore
                         for ex in grp.executors]
            shapes = sum(len(ex.signatures) for ex in executors)
            first, later = graphs[0] - before, graphs[-1] - graphs[0]
            ms = statistics.median(seconds[1:]) / steps * 1e3
            res.numbers[label] = {"graphs_first_epoch": first, "shapes": shapes,
                                  "recompiles_after_first_epoch": later, "ms_per_step": ms,
                                  "first_epoch_s": seconds[0], "cudagraphs": cudagraph_counts()}
            res.row(f"{label}: graphs in epoch 1 / shapes", f"{first} / {shapes}",
                    "equal", first == shapes)
            res.row(f"{label}: recompiles after epoch 1", str(later), "0", later == 0)
            speedup = f" ({eager['ms'] / ms:.2f}x eager)" if eager else ""
            res.row(f"{label}: ms / step", f"{ms:.3f}{speedup}")

        res.attempt(label, run)


def cudagraph_counts() -> dict[str, int]:
    """Inductor's CUDA-graph counters (how often it skipped CUDA graphs, and why)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return {k: int(v) for k, v in counters["inductor"].items() if "cudagraph" in k}
