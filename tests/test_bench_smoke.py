"""Smoke test for the benchmarks in bench/: they run and print their ratio lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
