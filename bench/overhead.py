"""What ``Model.fit`` costs over the loop a user writes by hand, per training step, one thread.

Run: python bench/overhead.py [--quick] [--repeats 7] [--sections mlp,cnn,...] [--json out]

Sections (all by default):
  mlp            the tiny MLP 32-64-64-10 (batch 32) and the MLP 784-512-512-10 (batch 256)
                 against the floor loop (``common.hand_loop``: pre-shuffled slices, Adam)
  custom         a subclass's own ``train_step`` against the built-in step (784-512-512)
  cnn            a small CNN on 28x28 images (batch 64) against the hand loop
  transformer    a tiny BERT classifier (Hugging Face, from a config) trained on a dict of
                 tensors with its own loss against ``model(**batch).loss.backward()``
  keras          Keras 3's ``model.fit`` (torch backend) on the two MLPs against the same
                 hand loop, when keras is installed (a peer, not a target)
  import         what ``import fitdp`` adds to ``import torch, torchmetrics`` in a fresh
                 interpreter (CPU time; target: at most 0.3 s)
  ema            ``fit`` with the ``EMA`` callback against without (784-512-512)
  checkpointing  peak memory and step time of ``compile(activation_checkpointing=[block])``
                 against the same fit without, for a transformer encoder and a BERT
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    ROOT,
    Loop,
    Results,
    fitdp_loop,
    hand_loop,
    interleave,
    mlp,
    ms,
    paired,
    parser,
    pin_threads,
)
from torch import nn

import fitdp

SECTIONS = ("mlp", "custom", "cnn", "transformer", "keras", "import", "ema", "checkpointing")
TINY, WIDE = ([32, 64, 64, 10], 32, 200), ([784, 512, 512, 10], 256, 20)  # sizes, batch, steps


class OwnStep(fitdp.Model):
    """Keras's guide's first custom step: what an overridden train_step costs."""

    def train_step(self, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = data
        return self.compute_loss(x, y, self(x, training=True))


def versus(out: Results, section: str, case: str, loops: dict[str, Loop], steps: int,
           repeats: int, target: float | None, reference: str = "hand loop") -> None:
    """Time ``loops`` ("fitdp" first, the reference second) and add their row."""
    times = interleave(loops, steps, repeats)
    a, b = list(loops)
    out.row(section, case, reference, ms(times[b]), ms(times[a]), "ms/step",
            paired(times, a, b), "<=" if target else "", target)


def mlps(out: Results, steps: Callable[[int], int], repeats: int) -> None:
    for (sizes, bs, n), target in ((TINY, 1.10), (WIDE, 1.02)):
        x = torch.randn(bs * steps(n), sizes[0])
        y = torch.randint(0, 10, (len(x),))
        net = mlp(sizes)
        versus(out, "mlp", f"MLP {'-'.join(map(str, sizes))}, batch {bs}",
               {"fitdp": fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu"]),
                "hand": hand_loop(copy.deepcopy(net), x, y, bs)}, steps(n), repeats, target,
               "floor loop")


def custom(out: Results, steps: Callable[[int], int], repeats: int) -> None:
    sizes, bs, n = WIDE
    x, y = torch.randn(bs * steps(n), sizes[0]), torch.randint(0, 10, (bs * steps(n),))
    net = mlp(sizes)
    versus(out, "custom", "own train_step, MLP 784-512-512-10",
           {"own": fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu"], OwnStep),
            "built-in": fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu"])}, steps(n), repeats,
           1.05, "built-in step")


def cnn(out: Results, steps: Callable[[int], int], repeats: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    bs, n = 64, steps(20)
    x, y = torch.randn(bs * n, 1, 28, 28), torch.randint(0, 10, (bs * n,))
    versus(out, "cnn", "CNN 2 conv + linear, 28x28, batch 64",
           {"fitdp": fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu"]),
            "hand": hand_loop(copy.deepcopy(net), x, y, bs)}, n, repeats, 1.03)


def bert(layers: int = 2, width: int = 32, seq: int = 64, checkpointing: bool = False
         ) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification  # noqa: PLC0415

    torch.manual_seed(0)
    net = BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=width, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=4 * width, max_position_embeddings=seq, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if checkpointing:
        net.gradient_checkpointing_enable()
    return net


def transformer(out: Results, steps: Callable[[int], int], repeats: int) -> None:
    bs, n = 32, steps(16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (bs * n, 16), generator=g)
    lengths = torch.randint(2, 17, (bs * n,), generator=g)
    mask = (torch.arange(16) < lengths[:, None]).long()
    data = {"input_ids": ids * mask, "attention_mask": mask,
            "labels": torch.randint(0, 3, (bs * n,), generator=g)}
    batches = [{k: v[i:i + bs] for k, v in data.items()} for i in range(0, bs * n, bs)]
    net = bert()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def hand() -> None:
        for batch in batches:
            opt.zero_grad()
            net(**batch).loss.backward()
            opt.step()

    model = fitdp.Model(bert())
    model.compile("adamw", lr=1e-3, loss=None)
    versus(out, "transformer", "tiny BERT classifier (Hugging Face), batch 32",
           {"fitdp": lambda: model.fit(data, batch_size=bs, shuffle=False, devices=["cpu"],
                                       verbose=0), "hand": hand}, n, repeats, 1.03)


def keras_peer(out: Results, steps: Callable[[int], int], repeats: int) -> None:
    os.environ["KERAS_BACKEND"] = "torch"  # read once, when keras is first imported
    try:
        import keras  # noqa: PLC0415
    except ImportError:
        print("  keras is not installed: no peer rows")
        return
    for sizes, bs, n in (TINY, WIDE):
        x = torch.randn(bs * steps(n), sizes[0])
        y = torch.randint(0, 10, (len(x),))
        layers = [keras.layers.Dense(k, activation="relu") for k in sizes[1:-1]]
        peer = keras.Sequential([keras.Input((sizes[0],)), *layers,
                                 keras.layers.Dense(sizes[-1])])
        peer.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False,
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        versus(out, "keras", f"Keras {keras.__version__} fit, MLP {'-'.join(map(str, sizes))}",
               {"keras": lambda p=peer, x=x, y=y, bs=bs: p.fit(x, y, batch_size=bs, epochs=1,
                                                               verbose=0),
                "hand": hand_loop(mlp(sizes), x, y, bs)}, steps(n), repeats, None)


IMPORTS = """import time
import torch, torchmetrics
base = time.process_time()
import fitdp
print(base, time.process_time() - base)"""


def import_time(out: Results, rounds: int) -> None:
    """In fresh interpreters: the CPU time up to ``import torch, torchmetrics`` (start-up
    included), then what ``import fitdp`` adds; medians of ``rounds``."""
    got = [[float(v) for v in subprocess.run(
        [sys.executable, "-c", IMPORTS], cwd=ROOT, check=True, capture_output=True,
        text=True).stdout.split()] for _ in range(rounds)]
    base, extra = (statistics.median(g[k] for g in got) for k in (0, 1))
    out.row("import", "import fitdp on top of torch + torchmetrics (s, CPU)",
            "import torch, torchmetrics", base, base + extra, "s", extra, "<=", 0.3,
            "ratio: the seconds fitdp adds")


def ema(out: Results, steps: Callable[[int], int], repeats: int) -> None:
    sizes, bs, n = WIDE
    x, y = torch.randn(bs * steps(n), sizes[0]), torch.randint(0, 10, (bs * steps(n),))
    net = mlp(sizes)
    with_ema = fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu"],
                          callbacks=[fitdp.callbacks.EMA(decay=0.999)])
    versus(out, "ema", "EMA(decay=0.999), MLP 784-512-512-10",
           {"ema": with_ema, "plain": fitdp_loop(copy.deepcopy(net), x, y, bs, ["cpu"])},
           steps(n), repeats, 1.03, "fit without EMA")


def peak_and_step(make: Callable[[], nn.Module], blocks: list[type[nn.Module]] | None,
                  x: torch.Tensor, y: torch.Tensor, bs: int) -> tuple[float, float]:
    """(MiB allocated at most during a fit above its start, seconds per step): the CPU
    allocator's running total from torch.profiler's memory events."""
    model = fitdp.Model(make())
    model.compile("adamw", "cross_entropy", activation_checkpointing=blocks)
    fit: dict[str, Any] = {"batch_size": bs, "shuffle": False, "verbose": 0, "devices": ["cpu"]}
    model.fit(x[:bs], y[:bs], **fit)  # the weights' and the optimizer's state exist
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        model.fit(x, y, **fit)
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(f"{folder}/trace.json")
        events = json.loads(Path(f"{folder}/trace.json").read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    start = time.perf_counter()
    model.fit(x, y, **fit)
    return (max(totals) - totals[0]) / 2**20, (time.perf_counter() - start) / (len(x) // bs)


class Bert(nn.Module):
    """A BERT classifier taking input_ids, returning logits (for a compile loss)."""

    def __init__(self, width: int, seq: int, own: bool) -> None:
        super().__init__()
        self.bert = bert(2, width, seq, checkpointing=own)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids).logits


def checkpointing(out: Results, quick: bool) -> None:
    width, seq, bs = (64, 32, 8) if quick else (256, 128, 16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * bs, seq, width, generator=g)
    ids = torch.randint(1, 100, (2 * bs, seq), generator=g)
    y = torch.randint(0, 3, (2 * bs,), generator=g)

    def encoder() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                             nn.Flatten(), nn.Linear(width * seq, 3))

    from transformers.models.bert.modeling_bert import BertLayer  # noqa: PLC0415

    shape = f"2 layers, width {width}, sequence {seq}, batch {bs}"
    cases = [(f"nn.TransformerEncoder ({shape})", encoder, [nn.TransformerEncoderLayer], x),
             (f"BERT ({shape})", lambda: Bert(width, seq, False), [BertLayer], ids),
             (f"BERT ({shape}), its own gradient_checkpointing_enable()",
              lambda: Bert(width, seq, True), None, ids)]
    plain: tuple[float, float] = (0.0, 0.0)
    for case, make, blocks, inputs in cases:
        if blocks is not None:  # the same model without checkpointing is the reference
            plain = peak_and_step(make, None, inputs, y, bs)
        saved = peak_and_step(make, blocks, inputs, y, bs)
        out.row("checkpointing", f"peak MiB, {case}", "without", plain[0], saved[0], "MiB",
                note=f"step {saved[1] / plain[1]:.2f}x the time")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated sections")
    args = p.parse_args()
    chosen = args.sections.split(",")
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        p.error(f"--sections got {sorted(unknown)}; expected some of {','.join(SECTIONS)}")
    repeats = 1 if args.quick else args.repeats

    def steps(n: int) -> int:  # a quick run checks that each case runs, not its timing
        return max(2, n // 10) if args.quick else n

    pin_threads()
    out = Results("overhead", args)
    runs: dict[str, Callable[[], None]] = {
        "mlp": lambda: mlps(out, steps, repeats),
        "custom": lambda: custom(out, steps, repeats),
        "cnn": lambda: cnn(out, steps, repeats),
        "transformer": lambda: transformer(out, steps, repeats),
        "keras": lambda: keras_peer(out, steps, repeats),
        "import": lambda: import_time(out, 1 if args.quick else 7),
        "ema": lambda: ema(out, steps, repeats),
        "checkpointing": lambda: checkpointing(out, args.quick),
    }
    if args.quick and "keras" in chosen:  # a peer, not a target: its import alone takes seconds
        print("[keras] left out of --quick")
        chosen.remove("keras")
    for name in SECTIONS:
        if name in chosen:
            print(f"[{name}]", flush=True)
            runs[name]()
    out.finish()


if __name__ == "__main__":
    main()
