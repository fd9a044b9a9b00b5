"""PNG bar charts of each benchmark's ``--json`` numbers (matplotlib, Agg, no display needed).

Colours mean the same in every chart: fitdp blue, the hand-written reference grey, peers
(Keras, Lightning) orange.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display on benchmark machines
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from summary import BUCKET_NAMES, DIST_NAMES, INSTRUCTION_NAMES, TINY, WIDE  # noqa: E402

FITDP, HAND, PEER = "#1f77b4", "#8c8c8c", "#ff7f0e"


def _bars(ax: Axes, labels: list[str], values: list[float], colors: list[str], title: str,
          unit: str, fmt: str = "{:,.3g}", notes: list[str] | None = None) -> None:
    """Horizontal bars, first label on top, each bar labelled with its value (and note)."""
    y = range(len(labels))[::-1]
    bars = ax.barh(list(y), values, color=colors)
    ax.set_yticks(list(y), labels)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    texts = [fmt.format(v) + (f" {n}" if n else "")
             for v, n in zip(values, notes or [""] * len(values))]
    ax.bar_label(bars, texts, padding=3, fontsize=8)
    ax.set_xlim(min(0.0, *values), max(values) * (1.45 if notes else 1.3))  # room for labels
    big = max(values) >= 10_000
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1e3:g}k" if big else f"{x:g}"))
    ax.spines[["top", "right"]].set_visible(False)


def _save(fig: plt.Figure, path: Path, title: str, note: str) -> None:
    fig.suptitle(title, fontsize=11)
    fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def overhead(data: dict[str, Any], keras: dict[str, Any] | None, path: Path, note: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    for ax, name in zip(axes, (TINY, WIDE)):
        r = data[name]
        labels, values, colors = ["hand loop", "fitdp"], [r["b_ms"], r["a_ms"]], [HAND, FITDP]
        k = (keras or {}).get("cases", {}).get(name)
        if k:
            labels.append("Keras 3 (torch)")
            values.append(k["a_ms"])
            colors.append(PEER)
        _bars(ax, labels, values, colors, name, "ms per step (lower is better)")
    s = data["scaling"]
    _bars(axes[2], ["fitdp, 1 replica", "fitdp, 2 replicas"], [s["a_ms"], s["b_ms"]],
          [HAND, FITDP], f"MLP 1024^3, batch 256: speed-up {s['ratio']:.2f}x",
          "ms per step (lower is better)")
    _save(fig, path, "Time per training step: fitdp vs a hand-written loop", note)


def checkpoint(data: dict[str, Any], path: Path, note: str) -> None:
    sync, stall, copy = data["sync"]["median_s"], data["stall"], data["copy"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.0))
    names = ["fitdp save_checkpoint", "bare torch.save", "torch.save + fsync"]
    _bars(axes[0], names, [sync[n] * 1e3 for n in names], [FITDP, HAND, HAND],
          f"save, {data['params'] / 1e6:.1f}M parameters + Adam",
          "ms per save (lower is better)", "{:,.1f}")
    labels, values, colors = [], [], []
    for where, res in stall.items():  # (not "path": that is where the chart goes)
        labels += [f"{where}: async, lost", f"{where}: sync, cost"]
        values += [res["lost_quartiles_s"][1] * 1e3, res["sync_cost_quartiles_s"][1] * 1e3]
        colors += [FITDP, HAND]
    _bars(axes[1], labels, values, colors, "training time a save costs, in fit (median)",
          "ms (lower is better)", "{:,.1f}")
    _bars(axes[2], ["copy_to, 2 replicas -> host", "memcpy"],
          [copy["copy_to GB/s"], copy["memcpy GB/s"]], [FITDP, HAND], "weights to the host",
          "GB/s read + written (higher is better)", "{:,.1f}")
    _save(fig, path, "Checkpoints: fitdp against bare torch", note)

def bucketing(data: dict[str, Any], path: Path, note: str) -> None:
    r = data["results"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.2), gridspec_kw={"width_ratios": [5, 2, 2]})
    keys = ["a", "b", "c", "d"]
    _bars(axes[0], [BUCKET_NAMES[k] for k in keys], [r[k]["tokens_per_s"] for k in keys],
          [HAND, HAND, HAND, FITDP], "GRU classifier, batch 32",
          "real tokens/s, CPU time (higher is better)", "{:,.0f}",
          [f"({r[k]['padding']:.0%} padding)" for k in keys])
    for ax, key, what in ((axes[1], "peak_rss_mb", "peak RSS"),
                          (axes[2], "train_rss_mb", "RSS added by training")):
        _bars(ax, ["20 buckets", "largest bucket alone"], [r["m20"][key], r["m1"][key]],
              [FITDP, HAND], what, "MB (lower is better)", "{:,.1f}")
    _save(fig, path, "Variable-length batches: tokens/s per bucketing strategy, bucket memory",
          note)


def replica_memory(data: dict[str, Any], path: Path, note: str) -> None:
    median = {int(n): v / 2**20 for n, v in data["median_bytes"].items()}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    _bars(ax, [f"{n} replica(s)" for n in sorted(median)], [median[n] for n in sorted(median)],
          [FITDP] * len(median), f"MLP {'-'.join(map(str, data['sizes']))}, SGD",
          "median peak RSS, MiB (lower is better)", "{:,.0f}")
    _save(fig, path, "Peak memory of CPU replicas", note)


def distributed(data: dict[str, Any], path: Path, note: str) -> None:
    rows = data["rows"]
    keys = [k for k in DIST_NAMES if k in rows]
    colors = {"a": FITDP, "b": HAND, "c": PEER, "d": FITDP}
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * len(keys) + 0.8))
    ref = rows.get("b", {}).get("samples_per_s")
    _bars(ax, [DIST_NAMES[k] for k in keys], [rows[k]["samples_per_s"] for k in keys],
          [colors[k] for k in keys], "MLP 784-512-512-10, global batch 256, 1 thread per process",
          "samples/s (higher is better)", "{:,.0f}",
          [f"({rows[k]['samples_per_s'] / ref:.2f}x (b))" if ref else "" for k in keys])
    _save(fig, path, "Data-parallel training on the CPU: samples/s", note)


def sharding(data: dict[str, Any], path: Path, note: str) -> None:
    rows = data["rows"]
    kinds = ["ddp", "fsdp"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 2.6))
    _bars(axes[0], [f'"{k}"' for k in kinds],
          [sum(rows[k]["bytes"].values()) / 2**20 for k in kinds], [HAND, FITDP],
          "parameters + gradients + optimizer state per rank", "MiB (lower is better)",
          "{:,.0f}")
    _bars(axes[1], [f'"{k}"' for k in kinds], [rows[k]["step_s"] * 1e3 for k in kinds],
          [HAND, FITDP], "time per step", "ms (lower is better)", "{:,.0f}")
    _save(fig, path, f"Model.fit under torchrun, 2 ranks: {rows['ddp']['params'] / 1e6:.1f}M "
          "parameters + Adam", note)


def instructions(data: dict[str, Any], path: Path, note: str) -> None:
    cases = data["cases"]
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.5 * len(cases) + 0.8))
    _bars(ax, [INSTRUCTION_NAMES[k][0] for k in cases], [r["ratio"] for r in cases.values()],
          [FITDP] * len(cases), "valgrind (callgrind): every thread, kernels and interpreter",
          "fitdp / hand loop, instructions per step (lower is better)", "{:.3f}x")
    _save(fig, path, "Work per step: fitdp against the hand loops", note)
