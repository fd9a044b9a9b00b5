"""The example scripts run end to end (small settings)."""

from __future__ import annotations

import os
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def test_train_digits_fast(tmp_path):
    plot = tmp_path / "curves.png"
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_digits.py"), "--fast",
                          "--plot", str(plot)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "final metrics after 2 epochs" in out.stdout
    assert "val_multiclass_accuracy" in out.stdout
    assert plot.stat().st_size > 1000
