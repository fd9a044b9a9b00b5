"""Each rank's generators come back as that rank left them (issue 37 item 1)."""

from __future__ import annotations

import os

import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "rank_rng_worker.py")
pytestmark = [pytest.mark.distributed, pytest.mark.ranks_script(WORKER)]


def test_a_torchrun_resume_is_bitwise_when_the_ranks_draw_different_amounts(shared_ranks):
    """Regression (issue 37 item 1): 2 ranks with dropout over padded batches of other
    lengths, BackupAndRestore(save_freq=3), a crash after step 5 and the rerun: the weights
    ended 0.05 off the uninterrupted run's and History differed (the backup held rank 0's
    generators, and every rank resumed from them)."""
    run = shared_ranks(WORKER)  # the job's 2 ranks run rank_rng_worker.py
    assert run.code == 0 and run.output.splitlines().count("done") == 2, run.output
    want = torch.load(run.out / "uninterrupted.pt", weights_only=True)
    got = torch.load(run.out / "resumed.pt", weights_only=True)
    for key, value in want["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    assert got["history"] == want["history"]
