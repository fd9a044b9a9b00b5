"""The compile part of ``bench/gpu.py``: ``compile=True`` with a ``BucketIterator``.

One graph per bucket shape in the first epoch and no recompile after it, on one device and
on two replicas of it; CUDA graphs per bucket (``compile="reduce-overhead"``) on both when
time is left. On the CPU dry run every variant runs with dynamo's eager backend (no C++
compiler, a second to compile), and the mode fitdp hands torch.compile is recorded: it must
be the one asked for.
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
def watch_compile(modes: list[str | None], eager: bool) -> Iterator[None]:
    """Record the ``mode`` of every torch.compile call fitdp makes in the block (its
    ``compile=`` argument is the mode; options merged over fitdp's own once lost it to
    fitdp's explicit ``mode=None``). ``eager``: the dry run's backend, which takes no mode."""
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


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return int(counters["stats"]["unique_graphs"])


VARIANT_S = 25  # a compiled variant needs about this (3 shapes, 3 epochs; the first
# variant's cold compile fills inductor's on-disk cache for the later ones); one that would
# get less is not started


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
        (2000, 256, 8, 64, [16, 32, 64], 3) if ctx.cuda else (50, 16, 3, 8, [6, 12], 2))
    seqs, labels = sequences(buckets, bs * (8 if ctx.cuda else 2), vocab, classes)

    def fit_epochs(model: fitdp.Model, devices: list[str]) -> tuple[list[float], list[int]]:
        """Seconds and graphs compiled so far, per epoch."""
        it = fitdp.BucketIterator(seqs, labels, batch_size=bs, buckets=buckets, seed=0)
        seconds, graphs = [], []
        for _ in range(epochs):
            ctx.sync()
            start = time.perf_counter()
            model.fit(it, devices=devices, verbose=0)
            ctx.sync()
            seconds.append(time.perf_counter() - start)
            graphs.append(graphs_compiled())
        return seconds, graphs

    def build(compile: bool | str) -> fitdp.Model:
        torch.manual_seed(0)
        model = fitdp.Model(SeqNet(vocab, width, classes))
        model.compile(optimizer="adam", lr=1e-3, loss="cross_entropy", compile=compile)
        return model

    steps = len(fitdp.BucketIterator(seqs, labels, batch_size=bs, buckets=buckets, seed=0))
    eager: dict[str, float] = {}

    def run_eager() -> None:
        seconds, _ = fit_epochs(build(False), [d])
        eager["ms"] = statistics.median(seconds[1:]) / steps * 1e3
        res.row("eager: ms / step", f"{eager['ms']:.3f}")

    res.attempt("compile: eager", run_eager)
    for mode in (True, "reduce-overhead"):
        for devices in ([d], [d, d]):
            label = (f"compile={mode!r}" if mode is not True else "compile=True") + \
                f" on {len(devices)} replica{'s' * (len(devices) > 1)}"
            if ctx.deadline - time.perf_counter() < VARIANT_S:
                res.row(label, "not run: out of time")
                continue

            def run(mode: bool | str = mode, devices: list[str] = devices,
                    label: str = label) -> None:
                import torch._dynamo  # noqa: PLC0415

                torch._dynamo.reset()
                counters_before = cudagraph_counts()
                before = graphs_compiled()
                modes: list[str | None] = []
                with watch_compile(modes, eager=not ctx.cuda):
                    model = build(mode)
                    seconds, graphs = fit_epochs(model, devices)
                executors = [ex for grp in model._replicas.manager.groups.values()  # type: ignore
                             for ex in grp.executors]
                shapes = sum(len(ex.signatures) for ex in executors)
                first, later = graphs[0] - before, graphs[-1] - graphs[0]
                ms = statistics.median(seconds[1:]) / steps * 1e3
                cudagraphs = {k: v - counters_before.get(k, 0)
                              for k, v in cudagraph_counts().items()}
                want = None if mode is True else mode
                res.numbers[label] = {"graphs_first_epoch": first, "shapes": shapes,
                                      "recompiles_after_first_epoch": later,
                                      "ms_per_step": ms, "first_epoch_s": seconds[0],
                                      "modes_seen": sorted(set(map(str, modes))),
                                      "cudagraphs": cudagraphs}
                res.row(f"{label}: mode torch.compile got", ", ".join(sorted(set(map(
                    str, modes)))), str(want), bool(modes) and set(modes) == {want})
                res.row(f"{label}: graphs in epoch 1 / shapes", f"{first} / {shapes}",
                        "equal", first == shapes)
                res.row(f"{label}: recompiles after epoch 1", str(later), "0", later == 0)
                speedup = f" ({eager['ms'] / ms:.2f}x eager)" if eager else ""
                graphs_note = f"; CUDA graphs: {cudagraphs}" if cudagraphs else ""
                res.row(f"{label}: ms / step", f"{ms:.3f}{speedup}{graphs_note}"[:60])

            res.attempt(label, run)


def cudagraph_counts() -> dict[str, int]:
    """Inductor's CUDA-graph counters (how often it skipped CUDA graphs, and why)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return {k: int(v) for k, v in counters["inductor"].items() if "cudagraph" in k}
