"""Smoke test for bench/reproducible.py (issue 31): its quick run measures the two-replica
pair and prints the ratio line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reproducible_bench_quick_runs(tmp_path: Path) -> None:
    out = tmp_path / "reproducible.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reproducible.py"), "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reproducible (micro_batch_size=8) / ordinary, 2 replica(s): time" in proc.stdout
    numbers = json.loads(out.read_text())
    assert numbers["micro8-2"]["ms_per_step"] > 0 and "peak_mb" in numbers["ordinary-2"]
