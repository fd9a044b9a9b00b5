"""The GPU checks of issues 12.5 and 21 in one run of at most 8 minutes on one GPU.

Run: python -m bench --gpu [--json bench-gpu.json] [--device cuda:0]
     python bench/gpu.py --dry-run     (or --device cpu): every part on the CPU, tiny sizes

Parts, each with its own time budget, each in its own process (a part that crashes, hangs or
leaves the GPU in an error state cannot stop the others; a part killed at its limit keeps
the rows it had written):

  tier       ``pytest -m requires_cuda tests/``: the CUDA test tier, passed/failed/skipped
  repeat     the tier's two-replica tests four more times each (five runs in all)
  speed      ``Model.fit`` against a hand-written loop (same MLP, data on the GPU,
             interleaved, warmed up, medians); target >= 0.97 of the loop's speed
  syncs      host syncs per step between log points (sync debug mode "warn"); target 0;
             measured without a target: a metric with its default arguments,
             ``work_load_list="auto"``, 16-mixed with a user's unfused Adam
  replicas   ``devices=["cuda:0", "cuda:0"]``: weights allclose to one device; time per
             step; host time / step time for 1 and 2 replicas on one GPU
  precision  ``bf16-mixed`` and ``16-mixed`` against ``32``: time per step; the loss falls
  compile    ``compile=True`` and ``compile="reduce-overhead"`` (CUDA graphs per bucket), on
             one device and on ``["cuda:0", "cuda:0"]``, with a ``BucketIterator``: the mode
             torch.compile got, recompiles after the first epoch (target 0), inductor's
             CUDA-graph counters, time per step against eager

It prints one table and writes a JSON file with every number, the GPU's name, driver, and
the torch and CUDA versions. The exit code is 1 when a part or a tier test failed (a MISSED
target is a result, not a failure), 2 when there is no GPU and no ``--dry-run``. A dry run
runs the parts in this process and the tier (where every test skips) next to them.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This checkout's fitdp, not an installed one, in this process and in the ones it starts.
sys.path.insert(1, str(ROOT))
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}

from gpu_compile import compile_part  # noqa: E402
from gpu_parts import PARTS as MEASURED  # noqa: E402
from gpu_parts import Ctx, Result  # noqa: E402
from gpu_repeat import repeat_part  # noqa: E402

PARTS: dict[str, Callable[[Ctx, Result], None]] = {
    "repeat": repeat_part, **MEASURED, "compile": compile_part}
# Seconds each part may take on one GPU; they add up to TOTAL_S, and all of them together
# stop there. Compile has the most: its first variant compiles cold (inductor, Triton).
BUDGET_S = {"tier": 100, "repeat": 65, "speed": 40, "syncs": 45, "replicas": 35,
            "precision": 25, "compile": 120}
TOTAL_S = 430  # 8 minutes are 480 s: 50 s left for start-up, each part's CUDA start and
# the table (a session that lends a GPU for 15 minutes in all keeps room for a second run)
MIN_PART_S = 15  # a part that would get less is skipped


class Child:
    """A process in a session of its own: on its time limit, it and everything it started
    (pytest, inductor's compile workers) are killed together."""

    def __init__(self, cmd: Sequence[str]) -> None:
        print(f"\n== {' '.join(cmd[1:])}", flush=True)
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(list(cmd), cwd=ROOT, env=CHILD_ENV,
                                     start_new_session=True)

    def finish(self, timeout: float) -> tuple[str, float]:
        """Wait at most ``timeout`` seconds: ("ok" | "exit code N" | "timed out", seconds)."""
        left = max(timeout - (time.perf_counter() - self.start), 0.1)
        try:
            code = self.proc.wait(timeout=left)
            status = "ok" if code == 0 else f"exit code {code}"
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
        finally:
            if self.proc.poll() is None:  # timed out or interrupted: leave nothing behind
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return status, time.perf_counter() - self.start


def tier_command(dry_run: bool, xml: Path) -> list[str]:
    """The CUDA tier (on a dry run only tests/cuda: every test skips, collecting is enough).
    A test module that cannot be imported here (an optional package missing on the GPU
    machine) must not stop the tier: it is listed instead."""
    return [sys.executable, "-m", "pytest", "-m", "requires_cuda",
            "tests/cuda" if dry_run else "tests", "-q", "-p", "no:cacheprovider",
            "--continue-on-collection-errors", f"--junitxml={xml}"]


def tier_result(xml: Path, status: str) -> Result:
    """Pass/fail counts of the tier from pytest's JUnit XML; modules that could not be
    collected are counted apart (a failure only for the tier's own tests/cuda)."""
    res = Result()
    if not xml.exists():
        res.rows.append(["CUDA tier", f"no report ({status})", "all pass", "FAILED"])
        return res
    root = ET.parse(xml).getroot()
    cases = list(root.iter("testcase"))
    uncollected = [c.get("name", "") for c in cases if _problem(c) == "collection failure"]
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases
              if _problem(c) not in (None, "collection failure")]
    skipped = sum(c.find("skipped") is not None for c in cases)
    passed = len(cases) - len(uncollected) - len(failed) - skipped
    own = [name for name in uncollected if name.startswith("tests.cuda")]
    res.numbers = {"passed": passed, "failed": len(failed), "skipped": skipped,
                   "failed_tests": failed + own, "not_collected": uncollected}
    res.rows.append(["CUDA tier (pytest -m requires_cuda)",
                     f"{passed} passed, {len(failed)} failed, {skipped} skipped", "all pass",
                     "MISSED" if failed or own else "met" if passed else ""])
    res.rows += [[f"  failed: {name}", "", "", ""] for name in failed[:15]]
    if uncollected:
        res.rows.append([f"  not collected: {', '.join(uncollected)[:50]}",
                         f"{len(uncollected)} module(s)", "", "MISSED" if own else ""])
    return res


def _problem(case: ET.Element) -> str | None:
    """None for a test that passed or skipped; else its failure's or error's message."""
    for kind in ("failure", "error"):
        found = case.find(kind)
        if found is not None:
            return found.get("message") or kind
    return None


def machine(device: str) -> dict[str, Any]:
    """The GPU, driver, torch and CUDA versions, the host and the commit."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "python": platform.python_version(), "host": platform.node()}
    try:
        info["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        info["triton"] = "not installed"
    # Triton builds its launcher with a C compiler (CC, else cc/gcc/clang on PATH).
    compiler = os.environ.get("CC") or next(
        (c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    info["c_compiler"] = shutil.which(compiler) if compiler else "none found"
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
        try:
            query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                    "--format=csv,noheader"], capture_output=True, text=True,
                                   timeout=20, check=True)
            info["driver"] = query.stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (no nvidia-smi)"
    else:
        info["gpu"] = "none (dry run on the CPU)"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True, timeout=10
                                        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["commit"] = "unknown"
    return info


def run_inline(name: str, ctx: Ctx) -> tuple[Result, str]:
    """A part in this process (dry run): every exception is caught and reported."""
    res = Result()
    try:
        PARTS[name](ctx, res)
    except Exception as err:  # noqa: BLE001 - one part failing must not stop the others
        traceback.print_exc()
        return res, f"failed: {type(err).__name__}: {err}"
    return res, "ok"


def run_child(name: str, device: str, budget: float, folder: Path) -> tuple[Result, str]:
    """A part in a process of its own; whatever rows it wrote before it ended are kept."""
    out = folder / f"{name}.json"
    status, _ = Child([sys.executable, str(Path(__file__).resolve()), "--part", name,
                       "--device", device, "--budget", f"{budget:.0f}", "--json", str(out)]
                      ).finish(budget)
    try:
        data = json.loads(out.read_text())
        return Result(rows=data["rows"], numbers=data["numbers"]), status
    except (OSError, ValueError, KeyError):
        return Result(), f"{status}; wrote no rows" if status == "ok" else status


def table(parts: dict[str, dict[str, Any]]) -> str:
    """One table: part, measure, value, target, verdict."""
    rows = [["part", "measure", "value", "target", "verdict"]]
    for name, part in parts.items():
        if part["status"] != "ok":
            rows.append([name, "(the part)", part["status"][:60], "", "FAILED"])
        rows += [[name, *row] for row in part["rows"]]
    widths = [min(max(len(r[i]) for r in rows), cap) for i, cap in enumerate((9, 62, 40, 13, 7))]
    return "\n".join("  ".join(c[:w].ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a dry run")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every part on the CPU with tiny sizes (no GPU needed)")
    parser.add_argument("--json", type=Path, default=Path("bench-gpu.json"),
                        help="where the numbers go (default: ./bench-gpu.json)")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else args.device
    if args.part:  # one part, in the process bench/gpu.py started for it
        res = Result(sink=args.json)
        PARTS[args.part](Ctx(device, time.perf_counter() + args.budget), res)
        res.save()
        return 0
    dry = not device.startswith("cuda")
    if not dry and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA GPU here (torch.cuda.is_available() is False). Fix: run "
              "it on a GPU machine, or check the script on the CPU with --dry-run.")
        return 2

    start = time.perf_counter()
    deadline = start + TOTAL_S
    report: dict[str, Any] = {
        "command": "python -m bench --gpu" + (" --dry-run" if dry else ""),
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(device), "parts": {}}
    print(f"machine: {report['machine']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fitdp-gpu-") as tmp:
        xml = Path(tmp) / "tier.xml"
        tier = Child(tier_command(dry, xml))
        if not dry:  # nothing else may share the GPU while the tier runs
            report["parts"]["tier"] = finish_tier(tier, xml, deadline)
            write(args.json, report)
        for name in PARTS:
            budget = min(BUDGET_S[name], deadline - time.perf_counter())
            if budget < MIN_PART_S:
                report["parts"][name] = {"status": "skipped: out of time", "rows": [],
                                         "numbers": {}}
                continue
            part_start = time.perf_counter()
            res, status = (run_inline(name, Ctx(device, part_start + budget)) if dry else
                           run_child(name, device, budget, Path(tmp)))
            report["parts"][name] = {"status": status, "rows": res.rows,
                                     "numbers": res.numbers, "budget_s": budget,
                                     "seconds": round(time.perf_counter() - part_start, 1)}
            write(args.json, report)
        if dry:
            report["parts"] = {"tier": finish_tier(tier, xml, deadline), **report["parts"]}
    report["seconds"] = round(time.perf_counter() - start, 1)
    write(args.json, report)
    print(f"\n{table(report['parts'])}\n\nall parts in {report['seconds']:.0f} s "
          f"(target: under {TOTAL_S} s of parts, 480 s in all, on one GPU); numbers in "
          f"{args.json}")
    failed = any((p["status"] != "ok" and not p["status"].startswith("skipped"))
                 or any(r[-1] == "FAILED" for r in p["rows"]) for p in report["parts"].values())
    tier_failures = report["parts"]["tier"]["numbers"].get("failed_tests")
    return 1 if failed or tier_failures else 0


def finish_tier(tier: Child, xml: Path, deadline: float) -> dict[str, Any]:
    status, seconds = tier.finish(min(BUDGET_S["tier"], max(deadline - time.perf_counter(), 1)))
    res = tier_result(xml, status)
    # pytest exits 1 when a test failed: that is the tier's result, not the part failing.
    ok = status == "ok" or (status == "exit code 1" and xml.exists())
    return {"status": "ok" if ok else status, "rows": res.rows, "numbers": res.numbers,
            "budget_s": BUDGET_S["tier"], "seconds": round(seconds, 1)}


def write(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
