"""Hugging Face models at the sizes users train: GPT-2 124M (transformers' default
``GPT2Config``, the ``gpt2`` checkpoint's shape) and a BERT-base-sized classifier
(``BertConfig()``, 2 labels), built from their configs with random weights, AdamW 1e-4, on the
same token batches (GPT-2: 4 x 128, its own causal LM loss; BERT: 8 x 128, its own
classification loss). Nothing is downloaded.

Run: python bench/hf_sizes.py [--quick] [--repeats 2] [--steps 3] [--sections single,ranks]
                              [--models gpt2,bert] [--json out]

single   one process per case (peak memory is a process's), one torch thread each, the
         cases of a round one after the other, the order rotating from round to round:
           hand       the loop a user writes: ``model(**batch).loss.backward()``, AdamW step,
                      ``zero_grad()``
           fitdp      ``Model.fit(data, loss=None)`` on ``devices=["cpu"]``
           trainer    transformers' ``Trainer`` (``use_cpu``, no logging, saving or eval)
           lightning  a ``LightningModule`` under ``lightning.Trainer(accelerator="cpu")``
           repro      ``fit(reproducible=True, micro_batch_size=<the batch>)``: one
                      micro-batch per device, the reproducible mode's own cost
         Each process times every step after the first (median); its peak RSS counts from
         the model and batches built (``+GB``: what training adds). fitdp's and the hand
         loop's processes also time a checkpoint's save and load (``model.save`` /
         ``model.load`` against ``torch.save`` / ``torch.load`` of the model's and the
         optimizer's state dicts).
ranks    2 torchrun ranks (gloo on 127.0.0.1, one thread each), every rank its half of each
         global batch: a hand ``DistributedDataParallel`` loop, fitdp ``strategy="ddp"`` and
         ``strategy="fsdp"``; step time and each rank's peak RSS against the 16 bytes per
         parameter that fp32 weights, gradients and Adam's two moments take.

``--quick`` (a smoke run: its numbers mean nothing) runs every case once on a tiny GPT-2, the
single-process cases at once, and the three rank cases in turn in one torchrun job (each
process start imports torch, transformers and fitdp: seconds of CPU each).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from common import TAG, Results, emit, parser, pin_threads, torchrun

HERE = Path(__file__).resolve()
RANKS = ("hand-ddp", "ddp", "fsdp")
NAMES = {"hand": "hand loop", "fitdp": "fitdp", "trainer": "HF Trainer",
         "lightning": "Lightning", "repro": "fitdp reproducible (1 micro-batch per device)",
         "hand-ddp": "hand DDP loop, 2 ranks", "ddp": "fitdp strategy='ddp', 2 ranks",
         "fsdp": "fitdp strategy='fsdp', 2 ranks"}
LR = 1e-4


# -- the models and their batches --------------------------------------------------------------


def build(model: str, quick: bool) -> tuple[torch.nn.Module, int, int]:
    """The model (seeded) with its batch size and sequence length."""
    torch.manual_seed(0)
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415

        small = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000) if quick else {}
        return GPT2LMHeadModel(GPT2Config(**small)), 4, 32 if quick else 128
    from transformers import BertConfig, BertForSequenceClassification  # noqa: PLC0415

    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                 intermediate_size=128, vocab_size=1000) if quick else {}
    return BertForSequenceClassification(BertConfig(num_labels=2, **small)), 8, \
        32 if quick else 128


def batches(net: torch.nn.Module, rows: int, seq: int, steps: int
            ) -> dict[str, torch.Tensor]:
    """``steps`` batches of ``rows`` random token rows as one dict of tensors (labels: the
    tokens themselves for a causal LM, one class per row for a classifier)."""
    g = torch.Generator().manual_seed(1)
    vocab = net.config.vocab_size  # type: ignore[union-attr]
    ids = torch.randint(0, vocab, (rows * steps, seq), generator=g)
    causal = "CausalLM" in type(net).__name__ or "LMHead" in type(net).__name__
    labels = ids.clone() if causal else torch.randint(0, 2, (rows * steps,), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def split(data: dict[str, torch.Tensor], rows: int) -> list[dict[str, torch.Tensor]]:
    n = len(data["input_ids"])
    return [{k: v[i:i + rows] for k, v in data.items()} for i in range(0, n, rows)]


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


# -- one case in one process ---------------------------------------------------------------------


class Clock:
    """Each step's seconds, from its start to the end of its optimizer step: this process's
    CPU time where it runs one thread (waiting for a core on a shared machine does not
    count), the wall clock for ranks (they also wait for each other)."""

    def __init__(self, tick: Callable[[], float] = time.process_time) -> None:
        self.seconds: list[float] = []
        self.tick, self.t0 = tick, 0.0

    def begin(self, *_: Any, **__: Any) -> None:
        self.t0 = self.tick()

    def end(self, *_: Any, **__: Any) -> None:
        self.seconds.append(self.tick() - self.t0)


def hand(net: torch.nn.Module, parts: list[dict[str, torch.Tensor]], clock: Clock) -> Any:
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    for batch in parts:
        clock.begin()
        net(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        clock.end()
    return opt


def fitdp_case(net: torch.nn.Module, data: dict[str, torch.Tensor], rows: int, clock: Clock,
               strategy: str = "auto", **fit: Any) -> Any:
    import fitdp  # noqa: PLC0415

    class Timer(fitdp.callbacks.Callback):
        on_train_batch_begin = clock.begin
        on_train_batch_end = clock.end

    model = fitdp.Model(net)
    model.compile("adamw", lr=LR, loss=None, strategy=strategy,
                  loss_items="causal_lm" if data["labels"].dim() > 1 else None)
    model.fit(data, batch_size=rows, shuffle=False, epochs=1, verbose=0, callbacks=[Timer()],
              **fit)
    return model


def trainer_case(net: torch.nn.Module, parts: list[dict[str, torch.Tensor]], rows: int,
                 clock: Clock, folder: str) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: PLC0415

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.begin()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.end()

    rows_list = [{k: v[i] for k, v in b.items()} for b in parts for i in range(rows)]
    args = TrainingArguments(
        output_dir=folder, per_device_train_batch_size=rows, max_steps=len(parts),
        learning_rate=LR, weight_decay=0.01, optim="adamw_torch", lr_scheduler_type="constant",
        warmup_steps=0, report_to=[], save_strategy="no", logging_strategy="no",
        eval_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        seed=0)
    Trainer(model=net, args=args, train_dataset=rows_list, callbacks=[Timer()]).train()


def lightning_case(net: torch.nn.Module, parts: list[dict[str, torch.Tensor]],
                   clock: Clock) -> None:
    import lightning as L  # noqa: PLC0415, N812

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.net(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Timer(L.Callback):
        def on_train_batch_start(self, *a: Any, **k: Any) -> None:
            clock.begin()

        def on_train_batch_end(self, *a: Any, **k: Any) -> None:
            clock.end()

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(parts), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Timer()], num_sanity_val_steps=0)
    # batch_size=None: the loader yields the prepared batches as they are
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader(parts, batch_size=None))


def checkpoint_times(save: Callable[[str], None], load: Callable[[str], None]
                     ) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="fitdp-hf-bench-") as tmp:
        path = os.path.join(tmp, "model.pt")
        t = time.perf_counter()
        save(path)
        saved = time.perf_counter() - t
        t = time.perf_counter()
        load(path)
        return saved, time.perf_counter() - t


def single(case: str, model_name: str, steps: int, quick: bool) -> dict[str, Any]:
    """One case of the single-process section, in this process."""
    pin_threads()
    net, rows, seq = build(model_name, quick)
    data = batches(net, rows, seq, steps + 1)
    parts = split(data, rows)
    base = peak_gb()
    clock = Clock()
    out: dict[str, Any] = {}
    save: Callable[[str], None] | None = None
    load: Callable[[str], None] | None = None
    with tempfile.TemporaryDirectory(prefix="fitdp-hf-bench-") as folder:
        if case == "hand":
            opt = hand(net, parts, clock)

            def save(p: str) -> None:
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, p)

            def load(p: str) -> None:
                state = torch.load(p, weights_only=True)
                net.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
        elif case in ("fitdp", "repro"):
            fit = dict(reproducible=True, micro_batch_size=rows) if case == "repro" else {}
            model = fitdp_case(net, data, rows, clock, devices=["cpu"], **fit)
            if case == "fitdp":
                save, load = model.save, model.load
        elif case == "trainer":
            trainer_case(net, parts, rows, clock, folder)
        else:
            lightning_case(net, parts, clock)
    # Training's peak, before a checkpoint's save and load add theirs.
    out.update(step=statistics.median(clock.seconds[1:]), steps=len(clock.seconds),
               peak=peak_gb(), grown=peak_gb() - base,
               params=sum(p.numel() for p in net.parameters()))
    if save is not None and load is not None:
        out["save"], out["load"] = checkpoint_times(save, load)
    return out


def ranked(cases: str, model_name: str, steps: int, quick: bool) -> None:
    """The cases (comma-separated) of the ranks section in turn, on this torchrun rank."""
    for case in cases.split(","):
        rank_case(case, model_name, steps, quick)


def rank_case(case: str, model_name: str, steps: int, quick: bool) -> None:
    """One case of the ranks section, on this torchrun rank: emits its numbers."""
    pin_threads()
    import torch.distributed as dist  # noqa: PLC0415

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    net, rows, seq = build(model_name, quick)
    data = batches(net, rows * world, seq, steps + 1)  # global batches of rows * world
    clock = Clock(time.perf_counter)
    base = peak_gb()
    if case == "hand-ddp":
        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        mine = {k: v.view(steps + 1, world, rows, *v.shape[1:])[:, rank] for k, v in
                data.items()}
        hand(ddp, [{k: v[i] for k, v in mine.items()} for i in range(steps + 1)], clock)
        dist.destroy_process_group()
    else:
        # batch_size is one process's: each rank trains its shard of every global batch.
        fitdp_case(net, data, rows, clock, strategy=case)
    emit({"case": case, "rank": rank, "step": statistics.median(clock.seconds[1:]),
          "peak": peak_gb(),
          "grown": peak_gb() - base, "params": sum(p.numel() for p in net.parameters())})


# -- the launcher -------------------------------------------------------------------------------


def in_process(args: list[str], timeout: float) -> dict[str, Any]:
    """Run one single-process case in a fresh interpreter; its tagged JSON line."""
    proc = subprocess.run([sys.executable, str(HERE), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                "TOKENIZERS_PARALLELISM": "false"})
    lines = [ln[len(TAG):] for ln in proc.stdout.splitlines() if ln.startswith(TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(args)}: exit {proc.returncode}\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1])


def peers() -> tuple[str, ...]:
    """The peer cases whose packages are installed (``pip install -e ".[bench]"``)."""
    import importlib.util  # noqa: PLC0415

    found = {"trainer": importlib.util.find_spec("accelerate") is not None,
             "lightning": importlib.util.find_spec("lightning") is not None}
    for case, there in found.items():
        if not there:
            print(f"  {NAMES[case]}: not installed (the bench extra), no rows")
    return tuple(c for c, there in found.items() if there)


def main() -> None:
    p = parser(__doc__, repeats=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (after one)")
    p.add_argument("--sections", default="single,ranks")
    p.add_argument("--models", default="gpt2,bert")
    p.add_argument("--case", nargs=2, metavar=("CASE", "MODEL"), help=argparse_suppress())
    p.add_argument("--rank-case", nargs=2, metavar=("CASES", "MODEL"), help=argparse_suppress())
    args = p.parse_args()
    steps = 2 if args.quick else args.steps
    if args.case:
        emit(single(args.case[0], args.case[1], steps, args.quick))
        return
    if args.rank_case:
        ranked(args.rank_case[0], args.rank_case[1], steps, args.quick)
        return
    out = Results("hf_sizes", args)
    repeats = 1 if args.quick else args.repeats
    sections, models = args.sections.split(","), args.models.split(",")
    if args.quick:
        models = models[:1]  # a smoke run: every case once, on one tiny model
    cases = ("hand", "fitdp", *peers(), "repro")
    for model_name in models:
        label = {"gpt2": "GPT-2 124M, batch 4x128", "bert": "BERT-base classifier, batch 8x128"}[
            model_name]
        if "single" in sections:
            report_single(out, label, single_runs(cases, model_name, repeats, args.quick))
        if "ranks" in sections:
            report_ranks(out, label, rank_runs(model_name, repeats, args.quick))
    out.finish()


def rotated(cases: tuple[str, ...], repeats: int) -> list[tuple[str, ...]]:
    """Each round's order of the cases, rotating from round to round."""
    return [cases[r % len(cases):] + cases[:r % len(cases)] for r in range(repeats)]


def single_runs(cases: tuple[str, ...], model_name: str, repeats: int, quick: bool
                ) -> dict[str, list[dict[str, Any]]]:
    """Each case's numbers from each round, one fresh process per case and round: one after
    the other, or all at once in a quick run (whose numbers mean nothing)."""
    order = [case for one in rotated(cases, repeats) for case in one]
    flag = ["--quick"] * quick
    with ThreadPoolExecutor(len(order) if quick else 1) as pool:
        got = pool.map(lambda case: in_process(["--case", case, model_name, *flag], 1500),
                       order)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
        for case, numbers in zip(order, got):
            runs[case].append(numbers)
    return runs


def rank_runs(model_name: str, repeats: int, quick: bool) -> dict[str, list[list[dict[str, Any]]]]:
    """Each rank case's ranks' numbers from each round: one torchrun job per case and round,
    or one job for the three in a quick run (one start of 3 processes instead of three)."""
    jobs = [RANKS] if quick else [(case,) for one in rotated(RANKS, repeats) for case in one]
    found: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in RANKS}
    for job in jobs:
        lines = torchrun([str(HERE), "--rank-case", ",".join(job), model_name,
                          *(["--quick"] * quick)], timeout=1500)
        for case in job:
            found[case].append([line for line in lines if line["case"] == case])
    return found


def argparse_suppress() -> str:
    import argparse  # noqa: PLC0415

    return argparse.SUPPRESS


def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report_single(out: Results, label: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    params = runs["hand"][0]["params"]
    out.extra.setdefault("params", {})[label] = params
    peers = [c for c in ("hand", "trainer", "lightning") if c in runs]
    for case in peers:  # fitdp against each: the hand loop holds the targets
        out.row(label, "step time", NAMES[case], med(runs[case], "step"),
                med(runs["fitdp"], "step"), "s/step", op="<=",
                target=1.03 if case == "hand" else None)
    for case in peers:
        out.row(label, "peak memory added by training", NAMES[case], med(runs[case], "grown"),
                med(runs["fitdp"], "grown"), "GiB", op="<=",
                target=1.10 if case == "hand" else None,
                note=f"whole process: fitdp {med(runs['fitdp'], 'peak'):.2f} GiB, "
                     f"{NAMES[case]} {med(runs[case], 'peak'):.2f}; fp32 Adam's 16 "
                     f"B/parameter = {16 * params / 2**30:.2f} GiB")
    out.row(label, "reproducible mode (one micro-batch per device): step time", "fitdp",
            med(runs["fitdp"], "step"), med(runs["repro"], "step"), "s/step", op="<=",
            target=1.25)
    for what in ("save", "load"):
        out.row(label, f"checkpoint {what} (model and optimizer)", "torch." + what,
                med(runs["hand"], what), med(runs["fitdp"], what), "s")


def report_ranks(out: Results, label: str, found: dict[str, list[list[dict[str, Any]]]]
                 ) -> None:
    def per(case: str, key: str) -> float:  # the median over rounds of the ranks' largest
        return statistics.median(max(r[key] for r in ranks) for ranks in found[case])

    params = found["hand-ddp"][0][0]["params"]
    adam = 16 * params / 2**30
    for case in ("ddp", "fsdp"):
        out.row(f"{label}, 2 ranks", f"{case}: step time", NAMES["hand-ddp"],
                per("hand-ddp", "step"), per(case, "step"), "s/step")
        out.row(f"{label}, 2 ranks", f"{case}: peak memory per rank", NAMES["hand-ddp"],
                per("hand-ddp", "peak"), per(case, "peak"), "GiB",
                note=f"added by training {per(case, 'grown'):.2f} GiB; fp32 Adam's 16 "
                     f"B/parameter = {adam:.2f} GiB whole, {adam / 2:.2f} GiB per rank sharded")


if __name__ == "__main__":
    main()
