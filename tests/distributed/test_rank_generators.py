"""Each rank's generators come back as that rank left them (issue 37 item 1)."""

from __future__ import annotations

import os

import pytest
import torch
from test_distributed import launch

pytestmark = pytest.mark.distributed


def test_a_torchrun_resume_is_bitwise_when_the_ranks_draw_different_amounts(tmp_path):
    """Regression (issue 37 item 1): 2 ranks with dropout over padded batches of other
    lengths, BackupAndRestore(save_freq=3), a crash after step 5 and the rerun: the weights
    ended 0.05 off the uninterrupted run's and History differed (the backup held rank 0's
    generators, and every rank resumed from them)."""
    worker = os.path.join(os.path.dirname(__file__), "rank_rng_worker.py")
    code, output, _ = launch("", tmp_path, script=[worker, str(tmp_path)], limit=120)
    assert code == 0 and output.count("done") == 2, output
    want = torch.load(tmp_path / "uninterrupted.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for key, value in want["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    assert got["history"] == want["history"]
