"""Peak memory saved by activation checkpointing, against the same fit without it.

Run: python bench/activation_checkpointing.py [--json out.json] [--quick]

Each row trains the same model on the same batches twice on one CPU device, once plainly and
once recomputing its transformer blocks in backward: ``compile(activation_checkpointing=
[Block])`` (torch's non-reentrant ``checkpoint``), and for the Hugging Face BERT also the
model's own ``gradient_checkpointing_enable()``. The peak is the CPU allocator's: the most
bytes allocated at once during the fit above what was allocated when it started (weights
and optimizer state are made by a warm-up fit before), read from ``torch.profiler``'s
memory events (``profile_memory=True``: every allocation and free, with the running total).
The step time is the median of a few fits' seconds per step, without the profiler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp
import fitdp  # noqa: E402

MiB = 2**20


def encoder(width: int, layers: int, seq: int) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                         nn.Flatten(), nn.Linear(width * seq, 4))


class Bert(nn.Module):
    """A BERT classifier from a config (no download): input_ids in, logits out."""

    def __init__(self, width: int, layers: int, seq: int, own_checkpointing: bool) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=1000, hidden_size=width, num_hidden_layers=layers,
            num_attention_heads=4, intermediate_size=4 * width,
            max_position_embeddings=seq, num_labels=4, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
        self.bert = transformers.BertForSequenceClassification(config)
        if own_checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # renamed in transformers 5; use_cache notice
                self.bert.gradient_checkpointing_enable()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids).logits


def peak_and_time(make: Callable[[], nn.Module], blocks: list[type[nn.Module]] | None,
                  x: torch.Tensor, y: torch.Tensor, batch: int, repeats: int
                  ) -> tuple[float, float]:
    """(peak MiB allocated during a fit above its start, median seconds per step)."""
    model = fitdp.Model(make())
    model.compile("adamw", "cross_entropy", activation_checkpointing=blocks)
    fit: dict[str, Any] = {"batch_size": batch, "epochs": 1, "shuffle": False, "verbose": 0,
                           "devices": ["cpu"]}
    model.fit(x[:batch], y[:batch], **fit)  # weights and optimizer state made
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        model.fit(x, y, **fit)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.fit(x, y, **fit)
        seconds.append((time.perf_counter() - start) / (len(x) // batch))
    return (max(totals) - totals[0]) / MiB, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller models (a smoke run)")
    parser.add_argument("--json", default=None, help="write the rows there")
    args = parser.parse_args()
    width, layers, seq, batch = (64, 2, 32, 8) if args.quick else (256, 4, 128, 16)
    repeats = 1 if args.quick else 3
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * batch, seq, width, generator=g)
    ids = torch.randint(1, 1000, (2 * batch, seq), generator=g)
    y = torch.randint(0, 4, (2 * batch,), generator=g)
    rows: list[dict[str, Any]] = []

    def row(name: str, plain: tuple[float, float], saved: tuple[float, float]) -> None:
        rows.append({"case": name, "peak_mib": plain[0], "checkpointed_peak_mib": saved[0],
                     "peak_ratio": saved[0] / plain[0], "step_s": plain[1],
                     "checkpointed_step_s": saved[1], "time_ratio": saved[1] / plain[1]})
        r = rows[-1]
        print(f"{name}: peak {r['peak_mib']:.1f} MiB -> {r['checkpointed_peak_mib']:.1f} MiB "
              f"({r['peak_ratio']:.2f}x), step {r['step_s'] * 1e3:.1f} ms -> "
              f"{r['checkpointed_step_s'] * 1e3:.1f} ms ({r['time_ratio']:.2f}x)", flush=True)

    shape = f"{layers} layers, width {width}, sequence {seq}, batch {batch}"
    plain = peak_and_time(lambda: encoder(width, layers, seq), None, x, y, batch, repeats)
    row(f"nn.TransformerEncoder ({shape}), compile(activation_checkpointing=...)", plain,
        peak_and_time(lambda: encoder(width, layers, seq), [nn.TransformerEncoderLayer],
                      x, y, batch, repeats))
    try:
        from transformers.models.bert.modeling_bert import BertLayer
    except ImportError:
        print("transformers is not installed: no BERT rows")
    else:
        plain = peak_and_time(lambda: Bert(width, layers, seq, False), None, ids, y, batch,
                              repeats)
        row(f"BertForSequenceClassification ({shape}), compile(activation_checkpointing=...)",
            plain, peak_and_time(lambda: Bert(width, layers, seq, False), [BertLayer], ids, y,
                                 batch, repeats))
        row(f"BertForSequenceClassification ({shape}), gradient_checkpointing_enable()",
            plain, peak_and_time(lambda: Bert(width, layers, seq, True), None, ids, y, batch,
                                 repeats))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
