"""Smoke test for the benchmarks in bench/: they run and print their ratio lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_bench_quick_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "checkpoint.py"), "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "save ratio (fitdp / bare torch.save):" in proc.stdout
    assert "save ratio (fitdp / torch.save + fsync):" in proc.stdout
    assert "copy_to bandwidth ratio (copy_to / memcpy):" in proc.stdout
    numbers = json.loads(out.read_text())
    assert numbers["save_ratio"] > 0 and numbers["copy_bandwidth_ratio"] > 0


def quick(script: str) -> subprocess.CompletedProcess[str]:
    """``bench/script --quick``, which must succeed."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.distributed  # launches 2-rank gloo jobs on 127.0.0.1 under torchrun
def test_distributed_bench_quick_runs() -> None:
    proc = quick("distributed.py")
    for case in ("(a) fitdp, torchrun 2 ranks", "(b) hand DDP loop", "(d) fitdp, 1 process"):
        row = [line for line in proc.stdout.splitlines() if line.startswith(case)]
        assert row and "FAILED" not in row[0], proc.stdout
    assert "target (a) >= 0.95x (b):" in proc.stdout


@pytest.mark.distributed  # one 2-rank gloo job on 127.0.0.1 under torchrun
def test_hybrid_bench_quick_runs() -> None:
    proc = quick("hybrid.py")
    assert "step ratio (overlapped / after backward):" in proc.stdout, proc.stdout
    assert "of its step" in proc.stdout and "bit for bit equal: True" in proc.stdout


@pytest.mark.distributed  # launches 2-rank gloo jobs on 127.0.0.1 under torchrun
def test_sharding_bench_measures_fit_under_both_strategies(tmp_path: Path) -> None:
    """bench/sharding.py counted fitdp's engines driven by hand, not Model.fit's ranks."""
    out = tmp_path / "sharding.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sharding.py"), "--quick", "--json", str(out)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    numbers = json.loads(out.read_text())
    ddp, fsdp = numbers["rows"]["ddp"], numbers["rows"]["fsdp"]
    assert ddp["steps"] == fsdp["steps"] == 3  # one callback call per fit step
    # ddp holds 4 + 4 + 8 bytes per parameter; fsdp half of that on each of 2 ranks
    assert sum(ddp["bytes"].values()) == 16 * ddp["params"]
    for per_rank in fsdp["bytes_per_rank"]:
        assert abs(sum(per_rank.values()) - 8 * ddp["params"]) < 0.01 * 8 * ddp["params"]
    assert "fsdp / ddp memory per rank: 0.50x" in proc.stdout


def test_run_all_quick_writes_page_and_charts(tmp_path: Path) -> None:
    # distributed.py has its own smoke test above: leave its torchrun launches out here.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path),
         "--only", "overhead,checkpoint,bucketing"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "ratio" in proc.stdout and "load average" in proc.stdout
    page = (tmp_path / "benchmarks.md").read_text()
    assert "python bench/run.py --quick" in page and "distributed" in page
    assert "```python" not in page  # tests/test_docs.py would run it
    charts = sorted((tmp_path / "img").glob("*.png"))
    assert charts, page
    for chart in charts:  # every chart is on the page, by a relative link
        assert f"](img/{chart.name})" in page


def test_the_benchmarks_page_ends_with_the_first_gpu_runs_checklist():
    """docs/benchmarks.md is generated: the checklist lives in bench/report.py, so a
    regenerated page keeps it, and the page in docs/ holds it as generated."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import report  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "bench"))
    checklist = "\n".join(report.GPU_CHECKLIST).rstrip() + "\n"
    assert report.page("x", "now", [], [], [], quick=False).endswith(checklist)
    assert (ROOT / "docs" / "benchmarks.md").read_text().endswith(checklist)
