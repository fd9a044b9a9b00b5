"""The training time an asynchronous ``model.save`` costs, against a synchronous one, measured
inside one ``Model.fit``: in one process, and under torchrun (2 ranks, ``"ddp"`` and ``"fsdp"``).

Run: python bench/save_stall.py [--quick] [--rounds 8] [--paths one,ddp,fsdp] [--json out.json]
(``bench/checkpoint.py`` runs it too and puts its numbers in its own.)

One fit trains an MLP with Adam on fixed-size batches; a callback splits its steps into blocks
of K steps. Every round has three blocks in a rotating order: K steps alone ("none"), K steps
after ``model.save(path, async_save=True)`` and then ``model.wait_for_saves()`` ("async"), and
``model.save(path)`` then K steps ("sync"). Each block's time runs from just before the save to
just after its K-th step (and the wait), with ``os.sync()`` before it, untimed, so no earlier
write-back lands in it. Per round, lost(async) = async - none and cost(sync) = sync - none:
paired differences of blocks that ran back to back, so load drifting between rounds hits
both sides of each difference alike. The stall ratio is median lost(async) / median
cost(sync) (target <= 0.10); the interquartile ranges of both and of the per-round ratios are
reported with it. The part of the loss measured directly (so not blurred by load) is printed
next to it: the async save call plus the waits of that block's optimizer steps at the
snapshot fence (``fitdp.executor.fence``, timed by wrapping its ``wait_for_snapshots``); the
rest is the writer thread's competition for the CPU, and the wait at the block's end where the
save outlasted its K steps (printed too: a writer starved of CPU shows there). Round 0 warms up
and is left out. Under torchrun every rank saves (FSDP2's save gathers the shards: a
collective) and rank 0's times are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fitdp (children too)
from bench.launcher import torchrun  # noqa: E402

TARGET = 0.10  # lost per async save / cost of a sync save, at most
KINDS = ("none", "async", "sync")
TAG = "BENCH_JSON "
FULL = {"sizes": [4096, 4096, 2048], "batch": 32, "steps": 4}  # 25.2M parameters + Adam
QUICK = {"sizes": [256, 256, 64], "batch": 8, "steps": 2}
NAMES = {"one": "one process", "ddp": 'torchrun 2 ranks, "ddp"',
         "fsdp": 'torchrun 2 ranks, "fsdp"'}


def mlp(sizes: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def schedule(rounds: int) -> list[str]:
    """The kind of every block: round r rotates KINDS by r (round 0 is the warm-up)."""
    return [k for r in range(rounds + 1) for k in KINDS[r % 3:] + KINDS[:r % 3]]


def measure(config: dict[str, Any], rounds: int, folder: str, strategy: str = "auto"
            ) -> dict[str, Any]:
    """One fit with ``schedule(rounds)``'s blocks; each block's seconds and each save call's."""
    import fitdp
    from fitdp.callbacks import Callback
    from fitdp.executor import fence

    blocks, k = schedule(rounds), config["steps"]
    path = os.path.join(folder, "stall")  # a file; a folder of shards under "fsdp"
    waited = [0.0]  # seconds optimizer steps spent at the snapshot fence (an async save's copy)
    real_wait = fence.wait_for_snapshots

    def timed_wait() -> None:  # Update.apply calls fence.wait_for_snapshots() by this name
        if fence.pending:
            t = time.perf_counter()
            real_wait()
            waited[0] += time.perf_counter() - t

    fence.wait_for_snapshots = timed_wait

    class Blocks(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self.call_s: list[float] = []  # how long each save call took to return
            self.fence_s: list[float] = []  # each block's steps' waits at the fence
            self.end_wait_s: list[float] = []  # the wait at its end for the save to finish
            self.steps = 0

        def start(self) -> None:
            kind = blocks[len(self.seconds)]
            os.sync()
            waited[0] = 0.0
            self.t0 = time.perf_counter()
            if kind != "none":
                self.model.save(path, async_save=kind == "async")
            self.call_s.append(time.perf_counter() - self.t0)

        def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
            self.start()

        def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
            self.steps += 1
            if self.steps % k or len(self.seconds) == len(blocks):
                return
            t = time.perf_counter()
            self.model.wait_for_saves()
            end = time.perf_counter()
            self.seconds.append(end - self.t0)
            self.fence_s.append(waited[0])
            self.end_wait_s.append(end - t)
            if len(self.seconds) < len(blocks):
                self.start()

    n = k * len(blocks) * (2 if strategy != "auto" else 1)  # 2 ranks take halves
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n * config["batch"], config["sizes"][0], generator=g)
    y = torch.randint(0, config["sizes"][-1], (len(x),), generator=g)
    model = fitdp.Model(mlp(config["sizes"]))
    model.compile(optimizer="adam", lr=1e-4, loss="cross_entropy", strategy=strategy)
    probe = Blocks()
    try:
        model.fit(x, y, batch_size=config["batch"], epochs=1, shuffle=False, verbose=0,
                  callbacks=[probe])
    finally:
        fence.wait_for_snapshots = real_wait
    model.close()
    size = saved_bytes(Path(path))
    return {"blocks": blocks, "seconds": probe.seconds, "call_s": probe.call_s,
            "fence_s": probe.fence_s, "end_wait_s": probe.end_wait_s, "bytes": size,
            "params": sum(p.numel() for p in mlp(config["sizes"]).parameters())}


def saved_bytes(path: Path) -> int:
    """The bytes of the checkpoint at ``path``: a file, or the newest ``step-*`` folder of a
    sharded one (every rank's shards)."""
    if path.is_file():
        return path.stat().st_size
    steps = sorted(path.glob("step-*"), key=lambda p: p.stat().st_mtime)
    return sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file()) if steps else 0


def quartiles(values: list[float]) -> list[float]:
    """[25th, 50th, 75th] percentiles (the median in the middle)."""
    if len(values) < 2:
        return [values[0]] * 3 if values else [float("nan")] * 3
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[1], q[2]]


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Paired differences per round (round 0 left out), their quartiles and the ratio."""
    per: dict[str, list[float]] = {kind: [] for kind in KINDS}
    calls: dict[str, list[float]] = {kind: [] for kind in KINDS}
    direct: list[float] = []  # the async save call + the fence waits of its block
    end_waits: list[float] = []  # the async save outlasted its block's steps by this much
    for i, (kind, s) in enumerate(zip(raw["blocks"], raw["seconds"])):
        if i >= len(KINDS):
            per[kind].append(s)
            calls[kind].append(raw["call_s"][i])
            if kind == "async":
                direct.append(raw["call_s"][i] + raw["fence_s"][i])
                end_waits.append(raw["end_wait_s"][i])
    lost = [a - n for a, n in zip(per["async"], per["none"])]
    cost = [s - n for s, n in zip(per["sync"], per["none"])]
    ratios = [a / c for a, c in zip(lost, cost) if c > 0]
    q_lost, q_cost = quartiles(lost), quartiles(cost)
    return {**raw, "block_s": per, "lost_s": lost, "sync_cost_s": cost,
            "lost_quartiles_s": q_lost, "sync_cost_quartiles_s": q_cost,
            "round_ratio_quartiles": quartiles(ratios), "ratio": q_lost[1] / q_cost[1],
            "direct_quartiles_s": quartiles(direct), "end_wait_quartiles_s": quartiles(end_waits),
            "direct_ratio": statistics.median(direct) / q_cost[1],
            "async_call_median_s": statistics.median(calls["async"]),
            "sync_call_median_s": statistics.median(calls["sync"]),
            "step_s": statistics.median(per["none"]) / raw["steps_per_block"]}


def line(name: str, res: dict[str, Any]) -> str:
    ql, qc, qr = (res[k] for k in ("lost_quartiles_s", "sync_cost_quartiles_s",
                                   "round_ratio_quartiles"))
    return (f"  {name:<26} lost per async save {ql[1] * 1e3:7.1f} ms [IQR {ql[0] * 1e3:.1f} to "
            f"{ql[2] * 1e3:.1f}]; sync save costs {qc[1] * 1e3:7.1f} ms [IQR {qc[0] * 1e3:.1f} to "
            f"{qc[2] * 1e3:.1f}]; ratio {res['ratio']:.3f} (per round: median {qr[1]:.3f}, IQR "
            f"{qr[0]:.3f} to {qr[2]:.3f}; target <= {TARGET}) "
            f"{'met' if res['ratio'] <= TARGET else 'MISSED'}; async call returns in "
            f"{res['async_call_median_s'] * 1e3:.1f} ms, + waits at the fence: "
            f"{res['direct_quartiles_s'][1] * 1e3:.1f} ms ({res['direct_ratio']:.3f} of the sync "
            f"cost); waited at the block's end for the save "
            f"{res['end_wait_quartiles_s'][1] * 1e3:.1f} ms; step {res['step_s'] * 1e3:.1f} ms")


def run_path(path: str, config: dict[str, Any], rounds: int, timeout: float) -> dict[str, Any]:
    """One path: "one" in this process, "ddp"/"fsdp" under torchrun (rank 0's numbers)."""
    with tempfile.TemporaryDirectory(prefix="fitdp-stall-") as folder:
        if path == "one":
            raw = measure(config, rounds, folder)
        else:
            run = torchrun([os.path.abspath(__file__), "--worker", path, "--rounds", str(rounds),
                            "--dir", folder, "--config", json.dumps(config)], timeout=timeout)
            found = [json.loads(x[len(TAG):]) for x in run.output.splitlines()
                     if x.startswith(TAG)]
            if run.code != 0 or not found:
                raise RuntimeError(f"{path}: exit code {run.code}"
                                   f"{' (timed out)' if run.timed_out else ''}\n"
                                   f"{run.output[-3000:]}")
            raw = found[0]
    return analyse({**raw, "steps_per_block": config["steps"], "path": path})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of none/async/sync")
    parser.add_argument("--paths", default="one,ddp,fsdp",
                        help="one (one process), ddp, fsdp (torchrun, 2 ranks)")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per torchrun job")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.worker:
        raw = measure(json.loads(args.config), args.rounds, args.dir, args.worker)
        if int(os.environ["RANK"]) == 0:
            os.write(sys.stdout.fileno(), f"\n{TAG}{json.dumps(raw)}\n".encode())
        return 0
    config, rounds = (QUICK, 2) if args.quick else (FULL, args.rounds)
    out = {"loadavg_before": os.getloadavg(), "paths": {}}
    print(f"save stall: MLP {'-'.join(map(str, config['sizes']))} + Adam, batch "
          f"{config['batch']}, blocks of {config['steps']} steps, {rounds} rounds; load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    for path in args.paths.split(","):
        res = run_path(path, config, rounds, args.timeout)
        out["paths"][path] = res
        print(line(NAMES[path], res), flush=True)
    out["loadavg_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
