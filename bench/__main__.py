"""``python -m bench``: run every benchmark, print one table of ratios, and write the page
docs/benchmarks.md with a chart per benchmark (docs/img/NAME.png, when matplotlib is there).

Run: python -m bench [--quick] [--only overhead,replicas] [--out docs] [--jobs 1] [--keep DIR]
 or: python -m bench --gpu [bench/gpu.py's options]     (the GPU checks, see bench/gpu.py)

Each benchmark runs as its own process with ``--json`` (and ``--quick``), one after the other
so they never share the CPU (``--jobs N`` runs N at once: for smoke runs, whose numbers mean
nothing anyway). tools/instructions.py (valgrind's instruction counts) runs in a full run when
valgrind is on PATH. A benchmark that fails is noted on the page and the others still run; the
exit code is then 1 (a MISSed target is a result, not a failure).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = {"overhead": HERE / "overhead.py", "replicas": HERE / "replicas.py",
           "distributed": HERE / "distributed.py", "checkpoint": HERE / "checkpoint.py",
           "bucketing": HERE / "bucketing.py", "reproducible": HERE / "reproducible.py",
           "hf_sizes": HERE / "hf_sizes.py", "instructions": ROOT / "tools" / "instructions.py"}
TIMEOUT_S = {"overhead": 900, "replicas": 900, "distributed": 1200, "checkpoint": 1500,
             "bucketing": 1200, "reproducible": 1200, "hf_sizes": 3600, "instructions": 1200}
QUICK_TIMEOUT_S = 240
# With --jobs N the longest start first, so none is left running alone at the end (their
# --quick runs' CPU seconds, alone at load 5: hf_sizes 82, distributed 18, reproducible 17,
# overhead 12, bucketing 8, replicas 8, checkpoint 6).
LONGEST_FIRST = ("hf_sizes", "distributed", "reproducible", "overhead", "instructions",
                 "bucketing", "replicas", "checkpoint")
# What the first run on a GPU must show: no CUDA path of fitdp had run when this was written.
GPU_CHECKLIST = """## First GPU run: checklist

No CUDA path has run on a GPU yet. The first GPU run is `python -m bench --gpu --json gpu.json`
(at most 430 s of parts, under 8 minutes on one GPU); put its table in the closing note. It
must show:

1. **Machine**: torch, CUDA and Triton versions, and a C compiler for Triton's launcher
   (`cc --version`): without one `compile=True` fails at its first kernel.
2. **The tier** (`tier`): `pytest -m requires_cuda tests/` passes, and the two-replica tests
   pass four more times.
3. **Speed** (`speed`): `fit` at least 0.97 of the hand loop's speed.
4. **Host syncs per step** (`syncs`): 0 for the everyday variants; measured with a metric's
   default arguments and with a user's unfused Adam under `"16-mixed"`.
5. **Replicas and precision** (`replicas`, `precision`): two replicas on one GPU train the
   one-device weights; bf16-mixed and 16-mixed losses fall.
6. **Compile** (`compile`): the mode torch.compile got, no recompile after the first epoch.
"""


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run(name: str, quick: bool, folder: Path, stream: bool) -> dict[str, Any]:
    """One benchmark in its own process: its JSON, or why there is none."""
    out, log = folder / f"{name}.json", folder / f"{name}.log"
    cmd = [sys.executable, str(SCRIPTS[name]), "--json", str(out), *(["--quick"] * quick)]
    print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        # At the limit the whole group goes: the script and any torchrun ranks it started.
        timer = threading.Timer(QUICK_TIMEOUT_S if quick else TIMEOUT_S[name],
                                lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout or ():
                f.write(line)
                if stream:
                    print("   " + line, end="", flush=True)
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # interrupted
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if not stream:
        print(f"== {name} (exit code {code}):\n" + log.read_text(), flush=True)
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError):
        data = {"rows": []}
    if code != 0:
        data["problem"] = f"exit code {code}: " + " ".join(log.read_text().split()[-60:])
    return data


def about(name: str) -> str:
    """The first paragraph of the script's docstring, and how to run it alone."""
    doc = ast.get_docstring(ast.parse(SCRIPTS[name].read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def table(rows: list[dict[str, Any]], with_script: bool) -> list[str]:
    head = ["benchmark"] * with_script + ["case", "reference", "fitdp", "ratio", "target",
                                          "result", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r["script"]] if with_script else []) + [
            r["case"], f"{r['reference']} {number(r['ref_value'])} {r['unit']}",
            f"{number(r['value'])} {r['unit']}",
            "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
            "-" if r["target"] is None else f"{r['op']} {r['target']}", r["verdict"], r["note"]]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return lines


def chart(name: str, rows: list[dict[str, Any]], path: Path, note: str) -> bool:
    """The rows' ratios as bars with their targets marked; False without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")  # no display on benchmark machines
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    rows = [r for r in rows if r["ratio"] is not None]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.35 * len(rows)))
    y = list(range(len(rows)))[::-1]
    colors = {"PASS": "#1f77b4", "MISS": "#d62728"}
    ax.barh(y, [r["ratio"] for r in rows], color=[colors.get(r["verdict"], "#8c8c8c")
                                                  for r in rows])
    for yi, r in zip(y, rows):
        if r["target"] is not None:
            ax.plot([r["target"]] * 2, [yi - 0.4, yi + 0.4], color="black")
    ax.set_yticks(y, [r["case"][:60] for r in rows], fontsize=7)
    ax.set_xlabel("ratio (black: the target; blue met, red missed, grey none)")
    ax.set_title(f"{name}: fitdp against its reference", fontsize=10)
    fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def page(command: str, when: str, results: dict[str, dict[str, Any]], quick: bool,
         img: Path, machine: dict[str, str]) -> str:
    out = ["# Benchmarks", "", f"Generated by `{command}` on {when}; do not edit by hand. "
           "To regenerate:", "", "```bash", command, "```", ""]
    if quick:
        out += ['!!! warning "Quick run"', "    A smoke run (`--quick`): tiny sizes, one round. "
                "The numbers show that the benchmarks run, not how fast fitdp is.", ""]
    out += ["Each benchmark is a script in `bench/` that times fitdp against the loop a user "
            "writes by hand, in the same run: one torch thread per process, warmed up, "
            "interleaved rounds, medians (`bench/common.py`). A ratio is fitdp over the "
            "reference (time: lower is better) unless its note says speed, bandwidth or "
            "speed-up (higher is better); the target says which side fitdp must be on. "
            "`python tools/instructions.py` counts instructions (valgrind) instead of time.",
            "", "## Commands", "", "```bash",
            "python -m bench                       # every benchmark; rewrites this page",
            "python -m bench --only overhead,replicas,instructions   # the speed targets",
            "python -m bench --quick --jobs 3      # smoke runs (tests/test_bench_smoke.py)",
            "python bench/overhead.py --sections mlp,cnn   # one script, some of its sections",
            "python -m bench --gpu --json gpu.json # the GPU checks (bench/gpu.py)",
            "python tools/instructions.py          # instructions per step (valgrind)",
            "python tools/bytecodes.py             # Python bytecodes per step, by function",
            "```", "", "Every script takes `--quick` (seconds) and `--json FILE`, the timed "
            "ones `--repeats N` too; `--help` lists a script's sections.",
            "", "## Machine", "", "| | |", "|---|---|",
            *(f"| {k} | {v} |" for k, v in machine.items()), "", "## Summary", ""]
    held = [r for r in (dict(row, script=n) for n, d in results.items() for row in d["rows"])
            if r["target"] is not None]
    out += [*table(held, True), ""]
    for name, data in results.items():
        out += [f"## {name}", "", about(name), "", "```bash",
                f"python {SCRIPTS[name].relative_to(ROOT)}", "```", ""]
        if data.get("problem"):
            out += [f'!!! failure "{data["problem"][:400]}"', ""]
        if data.get("load"):
            out += [f"- ran in {data['seconds']:.0f} s; load average (1, 5, 15 min) "
                    f"{data['load'][0]} at the start, {data['load'][1]} at the end", ""]
        if (img / f"{name}.png").exists():
            out += [f"![{name}](img/{name}.png)", ""]
        if data["rows"]:
            out += [*table(data["rows"], False), ""]
    return "\n".join(out) + "\n" + GPU_CHECKLIST


def main() -> int:
    sys.path.insert(0, str(HERE))  # the scripts import each other by name, as when run as files
    if "--gpu" in sys.argv[1:]:  # the GPU checks; the other options are bench/gpu.py's
        import gpu  # noqa: PLC0415

        return gpu.main([a for a in sys.argv[1:] if a != "--gpu"])
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke runs of every benchmark")
    p.add_argument("--out", type=Path, default=ROOT / "docs", help="folder of the page")
    p.add_argument("--only", default=",".join(SCRIPTS), help="comma-separated benchmarks")
    p.add_argument("--jobs", type=int, default=1, help="benchmarks run at once")
    p.add_argument("--keep", type=Path, default=None, help="keep each run's JSON and log here")
    args = p.parse_args()
    names = args.only.split(",")
    if set(names) - set(SCRIPTS):
        p.error(f"--only got {args.only}; expected some of {','.join(SCRIPTS)}")
    if "instructions" in names and (args.quick or shutil.which("valgrind") is None):
        names.remove("instructions")  # a minute even on short epochs; needs valgrind
        print("instructions: left out (" + ("--quick" if args.quick else
                                            "valgrind is not on PATH") + ")")
    load, start = loadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fitdp-bench-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            started = sorted(names, key=LONGEST_FIRST.index) if args.jobs > 1 else names
            done = dict(zip(started, pool.map(
                lambda n: run(n, args.quick, folder, args.jobs == 1), started)))
        found = {name: done[name] for name in names}  # the page keeps the order asked for
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info = {**next((d["machine"] for d in found.values() if "machine" in d), {}),
            "load average": f"{load} at the start, {loadavg()} at the end",
            "duration": f"{(time.perf_counter() - start) / 60:.1f} min"}
    img = args.out / "img"
    img.mkdir(parents=True, exist_ok=True)
    for name, data in found.items():
        (img / f"{name}.png").unlink(missing_ok=True)  # no chart of an earlier run stays
        chart(name, data["rows"], img / f"{name}.png", f"{when}, load average {load}")
    command = "python -m bench" + " --quick" * args.quick + (
        f" --only {args.only}" if args.only != ",".join(SCRIPTS) else "")
    (args.out / "benchmarks.md").write_text(page(command, when, found, args.quick, img, info))
    print("\n" + "\n".join(table([dict(r, script=n) for n, d in found.items()
                                  for r in d["rows"]], True)))
    for name, data in found.items():
        if data.get("problem"):
            print(f"{name}: FAILED, {data['problem'][:300]}")
    print(f"wrote {args.out / 'benchmarks.md'}")
    return 1 if any(d.get("problem") for d in found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
