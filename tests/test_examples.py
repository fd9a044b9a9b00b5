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


def test_train_digits_takes_one_replica_on_one_core():
    """Regression: the first example always trained two CPU replicas, also where they could
    only take turns on one core (and then warned that one replica would be faster)."""
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_digits.py"), "--fast"],
                         capture_output=True, text=True, timeout=180,
                         preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert out.returncode == 0, out.stderr
    assert "on ['cpu'], 1 usable CPU cores" in out.stdout
    assert "one replica would train faster" not in out.stderr
