"""The numbers of each benchmark's ``--json`` output as tables: ratio rows with targets, details.

The targets are the ones each script prints (overhead.py, checkpoint.py, bucketing.py,
distributed.py); they are repeated here because only some scripts write them into their JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TINY = "tiny MLP 32-64-64-10, batch 32"
WIDE = "MLP 784-512-512-10, batch 256"


@dataclass
class Table:
    """Rows of already formatted cells; prints as aligned text or as a Markdown table."""

    headers: list[str]
    rows: list[list[str]]

    def text(self) -> str:
        cells = [self.headers, *self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.headers))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def markdown(self) -> str:
        def line(cells: list[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

        return "\n".join([line(self.headers), "|" + "---|" * len(self.headers),
                          *(line(r) for r in self.rows)])


@dataclass
class Ratio:
    """One comparison of fitdp against its reference, and the target it is held to."""

    bench: str
    case: str
    reference: str  # formatted, with the reference's name
    fitdp: str
    ratio: float | None  # None where the target applies to the value itself (padding)
    check: float | None  # what the target compares: the ratio, or the value
    op: str = ""  # "<=" or ">="
    target: float | None = None
    peers: list[str] = field(default_factory=list)  # "Keras 3.74 ms (5.85x)"
    target_format: str = "{:.2f}"

    @property
    def result(self) -> str:
        if self.target is None or self.check is None:
            return "-"
        ok = self.check <= self.target if self.op == "<=" else self.check >= self.target
        return "PASS" if ok else "MISS"

    def cells(self, with_bench: bool = True) -> list[str]:
        target = ("-" if self.target is None
                  else f"{self.op} {self.target_format.format(self.target)}")
        ratio = f"{self.ratio:.3f}x" if self.ratio is not None else "-"
        head = [self.bench] if with_bench else []
        return [*head, self.case, self.reference, self.fitdp, ratio, target, self.result,
                "; ".join(self.peers) or "-"]


RATIO_HEADERS = ["case", "reference", "fitdp", "ratio", "target", "result", "peers (ratio)"]


def ratio_table(rows: list[Ratio], with_bench: bool = True) -> Table:
    return Table((["benchmark"] if with_bench else []) + RATIO_HEADERS,
                 [r.cells(with_bench) for r in rows])


def overhead(data: dict[str, Any], keras: dict[str, Any] | None) -> tuple[list[Ratio], Table]:
    """fitdp vs hand loop per step (and Keras, measured against its own hand loop); two CPU
    replicas vs a hand-written two-thread loop; work_load_list="auto" vs the equal split."""
    rows, detail = [], []
    for name, target in ((TINY, 1.05), (WIDE, 1.01)):
        r = data[name]
        peers = []
        k = (keras or {}).get("cases", {}).get(name)
        if k:
            peers.append(f"Keras {k['a_ms']:.3f} ms ({k['ratio']:.2f}x its hand loop)")
        rows.append(Ratio("overhead", f"{name}: ms/step", f"hand loop {r['b_ms']:.3f}",
                          f"{r['a_ms']:.3f}", r["ratio"], r["ratio"], "<=", target, peers))
        detail.append([name, f"{r['b_ms']:.3f}", f"{r['a_ms']:.3f}", f"{r['ratio']:.3f}x",
                       f"{k['a_ms']:.3f}" if k else "-", f"{k['b_ms']:.3f}" if k else "-",
                       f"{k['ratio']:.3f}x" if k else "-"])
    s = data["scaling"]
    rows.append(Ratio("overhead", "MLP 1024-1024-1024-10, batch 256: 2-replica speed-up",
                      f"1 replica {s['a_ms']:.2f} ms/step", f"2 replicas {s['b_ms']:.2f}",
                      s["ratio"], s["ratio"], ">=", 1.5))
    detail.append(["MLP 1024^3, batch 256: 2 replicas (fitdp) vs 1 replica (reference)",
                   f"{s['a_ms']:.3f}", f"{s['b_ms']:.3f}", f"{s['ratio']:.3f}x speed-up",
                   "-", "-", "-"])
    replica_rows, replica_detail = replicas(data.get("replicas") or {})
    headers = ["case", "hand ms/step", "fitdp ms/step", "fitdp / hand", "Keras ms/step",
               "hand ms/step (Keras run)", "Keras / hand"]
    return rows + replica_rows, Table(headers, detail + replica_detail)


def replicas(cases: dict[str, Any]) -> tuple[list[Ratio], list[list[str]]]:
    """Rows of bench/replicas.py's cases (in overhead.py's JSON under "replicas")."""
    rows, detail = [], []
    for name, r in cases.items():
        if name == "auto":
            continue
        rows.append(Ratio("overhead", f"{name}: 2 CPU replicas, speed vs hand 2 threads",
                          f"hand {r['hand_ms']:.3f} ms/step", f"{r['fitdp_ms']:.3f}",
                          r["speed_ratio"], r["speed_ratio"], ">=", 0.95,
                          [f"1 replica {r['one_replica_ms']:.3f} ms"]))
        detail.append([f"{name}: 2 replicas (fitdp) vs hand-written 2 threads",
                       f"{r['hand_ms']:.3f}", f"{r['fitdp_ms']:.3f}",
                       f"{r['speed_ratio']:.3f}x speed", "-", "-", "-"])
    a = cases.get("auto")
    if a:
        rows.append(Ratio("overhead", "MLP 1024^3, batch 256, replica 1 at half speed: "
                          "work_load_list='auto' speed-up", f"equal split {a['equal_ms']:.2f} "
                          "ms/step", f"auto {a['auto_ms']:.2f}", a["throughput_ratio"],
                          a["throughput_ratio"], ">=", 1.3, [f"loads {a['auto_loads']}"]))
        detail.append(["work_load_list='auto' (fitdp) vs equal split, replica 1 at half speed",
                       f"{a['equal_ms']:.3f}", f"{a['auto_ms']:.3f}",
                       f"{a['throughput_ratio']:.3f}x speed-up", "-", "-", "-"])
    return rows, detail


STALL_NAMES = {"one": "one process", "ddp": 'torchrun 2 ranks, "ddp"',
               "fsdp": 'torchrun 2 ranks, "fsdp"'}


def stall_cells(res: dict[str, Any]) -> tuple[str, str, str]:
    """Lost per async save, sync cost (medians with IQR) and the per-round ratio IQR."""
    lost, cost = res["lost_quartiles_s"], res["sync_cost_quartiles_s"]
    q = res["round_ratio_quartiles"]
    return (f"{lost[1] * 1e3:.1f} (IQR {lost[0] * 1e3:.1f} to {lost[2] * 1e3:.1f})",
            f"{cost[1] * 1e3:.1f} (IQR {cost[0] * 1e3:.1f} to {cost[2] * 1e3:.1f})",
            f"{q[0]:.3f} to {q[2]:.3f}")


def checkpoint(data: dict[str, Any]) -> tuple[list[Ratio], Table]:
    """save_checkpoint vs torch.save + fsync; async save vs sync on every path; copy_to vs
    memcpy."""
    sync, stall, copy = data["sync"], data["stall"], data["copy"]
    ms = {k: v * 1e3 for k, v in sync["median_s"].items()}
    rows = [
        Ratio("checkpoint", f"save, MLP of {data['params'] / 1e6:.1f}M params + Adam: ms",
              f"torch.save + fsync {ms['torch.save + fsync']:.1f}",
              f"{ms['fitdp save_checkpoint']:.1f}", data["save_fsync_ratio"],
              data["save_fsync_ratio"], "<=", 1.05,
              [f"bare torch.save {ms['bare torch.save']:.1f} ms"]),
    ]
    for path, res in stall.items():
        lost, cost, spread = stall_cells(res)
        rows.append(Ratio("checkpoint", f"async model.save in fit, {STALL_NAMES[path]}: "
                          "training ms lost per save", f"sync save costs {cost}", lost,
                          res["ratio"], res["ratio"], "<=", 0.10,
                          [f"per-round ratio IQR {spread}"]))
    rows.append(Ratio("checkpoint", "copy_to from 2 CPU replicas: GB/s (read + write)",
                      f"memcpy {copy['memcpy GB/s']:.2f}", f"{copy['copy_to GB/s']:.2f}",
                      data["copy_bandwidth_ratio"], data["copy_bandwidth_ratio"], ">=", 0.5))
    base = ms["torch.save + fsync"]
    detail = [[name, f"{ms[name]:.2f} ms", f"{sync['bytes'] / 1e6:.1f}", f"{ms[name] / base:.3f}x"]
              for name in ms]
    for path, res in stall.items():
        lost, cost, spread = stall_cells(res)
        detail.append([f"async save in fit, {STALL_NAMES[path]}: ms lost per save "
                       f"({len(res['lost_s'])} rounds; the sync save costs {cost})", lost,
                       f"{res['bytes'] / 1e6:.1f}", f"{res['ratio']:.3f}x a sync save"])
    for name, key in (("copy_to, 2 CPU replicas -> host", "copy_to"),
                      ("memcpy dst.copy_(src)", "memcpy")):
        detail.append([name, f"{copy[key + ' s'] * 1e3:.2f} ms",
                       f"{copy[key + ' bytes'] / 1e6:.1f} (r+w)",
                       f"{copy[key + ' GB/s']:.2f} GB/s"])
    return rows, Table(["case", "median", "MB", "vs torch.save + fsync / bandwidth"], detail)


BUCKET_NAMES = {
    "a": "(a) pad all to 256, hand loop",
    "b": "(b) random, pad to batch max, hand loop",
    "c": "(c) length-grouped sampler, hand loop",
    "d": "(d) fitdp BucketIterator",
    "m20": "fitdp, 20 buckets",
    "m1": "fitdp, largest bucket alone",
}


def bucketing(data: dict[str, Any]) -> tuple[list[Ratio], Table]:
    """Real tokens/s of four batching strategies; padding; memory of 20 buckets vs one."""
    r = data["results"]
    a, b, c, d, m20, m1 = (r[k] for k in ("a", "b", "c", "d", "m20", "m1"))

    def tps(x: dict[str, Any]) -> str:
        return f"{x['tokens_per_s']:,.0f}"

    rows = [
        Ratio("bucketing", "GRU, real tokens/s vs length-grouped sampler",
              f"(c) hand {tps(c)}", tps(d), d["tokens_per_s"] / c["tokens_per_s"],
              d["tokens_per_s"] / c["tokens_per_s"], ">=", 0.97,
              [f"(b) pad to batch max {tps(b)} ({b['tokens_per_s'] / c['tokens_per_s']:.2f}x)"]),
        Ratio("bucketing", "GRU, real tokens/s vs pad all to 256", f"(a) hand {tps(a)}", tps(d),
              d["tokens_per_s"] / a["tokens_per_s"], d["tokens_per_s"] / a["tokens_per_s"],
              ">=", 2.0),
        Ratio("bucketing", "padding of automatic buckets", f"(c) {c['padding']:.1%}",
              f"{d['padding']:.1%}", None, d["padding"], "<=", 0.05, target_format="{:.0%}"),
        Ratio("bucketing", "peak RSS MB, 20 buckets vs largest alone",
              f"largest alone {m1['peak_rss_mb']:.0f}", f"{m20['peak_rss_mb']:.0f}",
              m20["peak_rss_mb"] / m1["peak_rss_mb"], m20["peak_rss_mb"] / m1["peak_rss_mb"],
              "<=", 1.05),
        Ratio("bucketing", "training RSS MB, 20 buckets vs largest alone",
              f"largest alone {m1['train_rss_mb']:.1f}", f"{m20['train_rss_mb']:.1f}",
              m20["train_rss_mb"] / m1["train_rss_mb"], m20["train_rss_mb"] / m1["train_rss_mb"],
              "<=", 1.05),
    ]
    detail = []
    for key, name in BUCKET_NAMES.items():
        x = r[key]
        timed = "tokens_per_s" in x
        detail.append([name, tps(x) if timed else "-",
                       f"{x['wall_tokens_per_s']:,.0f}" if timed else "-", f"{x['padding']:.1%}",
                       f"{x['peak_rss_mb']:.0f}", f"{x['train_rss_mb']:.1f}"])
    headers = ["strategy", "real tokens/s (CPU time)", "real tokens/s (wall)", "padding",
               "peak RSS MB", "training RSS MB"]
    return rows, Table(headers, detail)


def replica_memory(data: dict[str, Any]) -> tuple[list[Ratio], Table]:
    """Peak RSS per extra CPU replica over the weights' bytes (bench/replica_memory.py)."""
    mib, weights = 2**20, data["weights_bytes"]
    median = {int(n): v for n, v in data["median_bytes"].items()}
    steps = "; ".join(f"{k}: {v:.2f}x" for k, v in data["steps"].items())
    rows = [Ratio("replica_memory", "peak RSS per extra CPU replica, MLP "
                  f"{'-'.join(map(str, data['sizes']))} + SGD: x the weights",
                  f"weights {weights / mib:.1f} MiB", f"{data['per_extra_replica']:.2f}x",
                  None, data["per_extra_replica"], "<=", data["target"], [f"steps {steps}"])]
    detail = [[f"{n} CPU replica(s)", f"{v / mib:.1f}", f"{(v - median[1]) / weights:.2f}x"]
              for n, v in sorted(median.items())]
    return rows, Table(["devices", "median peak RSS MiB", "above 1 replica, x the weights"],
                       detail)


DIST_NAMES = {
    "a": "(a) fitdp, torchrun 2 ranks",
    "b": "(b) hand DDP loop, torchrun 2 ranks",
    "c": "(c) Lightning DDP, torchrun 2 ranks",
    "d": "(d) fitdp, 1 process, devices=[cpu, cpu]",
}


def distributed(data: dict[str, Any]) -> tuple[list[Ratio], Table]:
    """Samples/s under torchrun: fitdp and Lightning against a hand DDP loop."""
    rows_in = data["rows"]
    b = rows_in.get("b")
    rows: list[Ratio] = []
    if b:
        ref = f"(b) hand DDP {b['samples_per_s']:,.0f}"
        peers = []
        if "c" in rows_in:
            c = rows_in["c"]
            peers.append(f"Lightning {c['samples_per_s']:,.0f} "
                         f"({c['samples_per_s'] / b['samples_per_s']:.2f}x)")
        for key, case, target in (("a", "MLP 784-512-512-10, samples/s, 2 ranks", 1.0),
                                  ("d", "same, 1 process, devices=[cpu, cpu]", None)):
            if key in rows_in:
                x = rows_in[key]
                ratio = x["samples_per_s"] / b["samples_per_s"]
                q = x.get("paired_ratio_quartiles")  # (a): the rounds' back-to-back ratios
                check = q[1] if q else ratio
                extra = [f"per round: median {q[1]:.3f}x, IQR {q[0]:.3f} to {q[2]:.3f} (the "
                         "target's)"] if q else []
                rows.append(Ratio("distributed", case, ref, f"{x['samples_per_s']:,.0f}", ratio,
                                  check, ">=" if target else "", target,
                                  extra + peers if key == "a" else []))
    detail = []
    for key, name in DIST_NAMES.items():
        if key not in rows_in:
            continue
        x = rows_in[key]
        ratio = f"{x['samples_per_s'] / b['samples_per_s']:.3f}x" if b else "-"
        detail.append([name, f"{x['samples_per_s']:,.0f}", ratio,
                       f"{256 / x['samples_per_s'] * 1e3:.2f}", f"{x['loss']:.5f}",
                       ", ".join(f"{v:,.0f}" for v in x.get("runs_samples_per_s", []))])
    headers = ["case", "samples/s (median)", "vs (b)", "ms per global batch of 256",
               "final loss", "samples/s per round"]
    return rows, Table(headers, detail)


def sharding(data: dict[str, Any]) -> tuple[list[Ratio], Table]:
    """Per-rank bytes and step time of strategy="fsdp" against "ddp" (bench/sharding.py)."""
    mib, rows_in = 2**20, data["rows"]
    total = {k: sum(r["bytes"].values()) / mib for k, r in rows_in.items()}
    params = rows_in["ddp"]["params"] / 1e6
    rows = [
        Ratio("sharding", f"MLP of {params:.1f}M params + Adam, 2 ranks: MiB of parameters + "
              "gradients + optimizer state per rank", f'"ddp" {total["ddp"]:.0f}',
              f'"fsdp" {total["fsdp"]:.0f}', data["memory_ratio"], data["memory_ratio"], "<=",
              data["target"], [f"step time {data['step_ratio']:.2f}x ddp's",
                               f"peak RSS growth {data['rss_ratio']:.2f}x ddp's"]),
    ]
    detail = []
    for kind, r in rows_in.items():
        parts = r["bytes"]
        detail.append([f'"{kind}"', *(f"{parts[k] / mib:.0f}" for k in
                                       ("params", "grads", "optimizer")),
                       f"{total[kind]:.0f}", f"{r['rss_growth_steps'] / mib:.0f}",
                       f"{r['step_s'] * 1e3:.0f}",
                       ", ".join(f"{t * 1e3:.0f}" for t in r["runs_step_s"])])
    headers = ["strategy (Model.fit, torchrun 2 ranks)", "parameters MiB", "gradients MiB",
               "optimizer MiB", "sum MiB", "peak RSS growth MiB", "ms per step (median)",
               "ms per step per round"]
    return rows, Table(headers, detail)

INSTRUCTION_NAMES = {
    "tiny": (TINY, "floor loop"),
    "replicas_128": ("2 CPU replicas, MLP 128-128-128-10, batch 64", "hand two-thread loop"),
}


def instructions(data: dict[str, Any]) -> tuple[list[Ratio], Table]:
    """Instructions per step under valgrind, fitdp over the hand loop (bench/instructions.py)."""
    cases = data.get("cases")
    if cases is None:
        raise ValueError(data.get("skipped", "no cases"))
    rows, detail = [], []
    for key, r in cases.items():
        case, ref = INSTRUCTION_NAMES[key]
        rows.append(Ratio("instructions", f"{case}: instructions per step",
                          f"{ref} {r['hand'] / 1e6:.3f} M", f"{r['fitdp'] / 1e6:.3f} M",
                          r["ratio"], r["ratio"], "<=", r["target"]))
        n1, n2 = data["steps"][key]
        detail.append([case, f"{r['fitdp']:,.0f}", f"{r['hand']:,.0f}", f"{n1} and {n2}"])
    return rows, Table(["case", "fitdp instructions/step", "hand instructions/step",
                        "epochs counted (steps)"], detail)
