"""The equivalence harness on 2 torchrun ranks (gloo on 127.0.0.1): a drawn list of runs goes
to one 2-rank job (rank_worker.py), which runs each uninterrupted and up to its stop, and
resumes it on 2 ranks or leaves the resume to this process (another world size); each is then
held to what docs/ promises (harness_promises.py), as the one-process harness does. One job
in the CI profile, more with ``--hypothesis-profile=long``."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
import torch
from harness_compare import assert_refusal_allowed, judge
from harness_runner import resume_part
from harness_runs import Run, Stop, runs
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

from fitdp import CheckpointError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
from test_distributed import launch  # noqa: E402

pytestmark = pytest.mark.distributed
WORKER = os.path.join(os.path.dirname(__file__), "rank_worker.py")

# Issue 37 item 1: an embedding and dropout over variable-length padded batches (each rank
# draws another amount), BackupAndRestore(save_freq=3), a crash at step 5, the rerun.
ITEM1_PER_RANK_DRAWS = Run(kind="loader", varlen=True, ranks=2, randomness="dropout",
                           stop=Stop(step=5, how="backup", every=3, ranks=2))
# Kept so: 2 ranks in the reproducible mode crash, and the run ends in one process with the
# same global batch, bitwise (reproducible.md).
REPRODUCIBLE_TO_ONE_PROCESS = Run(kind="tensors", ranks=2, randomness="dropout",
                                  reproducible=True, accum=2,
                                  stop=Stop(step=3, ranks=1))
# Found by the long draw: BatchNorm on 2 ranks, a backup after step 1 (mid-epoch): each
# rank's running statistics are its own there, and the checkpoint held their average only
# (one replica per rank has no replica_buffers), so the resumed run's statistics and
# val_loss differed.
BATCHNORM_PER_RANK_MID_EPOCH = Run(kind="buckets", ranks=2, randomness="batchnorm", accum=2,
                                   validation=True,
                                   stop=Stop(step=1, how="backup", every=1, ranks=2))
PINNED = [ITEM1_PER_RANK_DRAWS, REPRODUCIBLE_TO_ONE_PROCESS, BATCHNORM_PER_RANK_MID_EPOCH]


@settings(max_examples=max(1, settings().max_examples // 30),
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each try is a torchrun job
@given(drawn=st.lists(runs(ranks=2), min_size=2, max_size=2))
def test_drawn_two_rank_runs_keep_what_the_docs_promise(drawn: list[Run]) -> None:
    assume(any(run.stop for run in drawn))  # hypothesis tries the simplest list first
    all_runs = PINNED + drawn
    failures = []
    with tempfile.TemporaryDirectory() as out:
        with open(os.path.join(out, "runs.json"), "w") as f:
            json.dump([run.to_json() for run in all_runs], f)
        code, output, _ = launch("", out, script=[WORKER, os.path.join(out, "runs.json"), out],
                                 limit=300)
        assert code == 0, output[-4000:]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank ran (reproducible.md: the bits need it)
        try:
            for i, run in enumerate(all_runs):
                folder = os.path.join(out, str(i))
                got = torch.load(os.path.join(folder, "got.pt"), weights_only=True)
                try:
                    try:
                        if "refused" in got:
                            raise ValueError(got["refused"])
                        if "drawn" not in got and run.stop is not None:
                            got["drawn"] = resume_part(run, folder)  # on one process
                    except (ValueError, CheckpointError) as err:
                        assert_refusal_allowed(run, err)
                        continue
                    judge(run, got.get("drawn", got.get("uninterrupted")),
                          got.get("uninterrupted"))
                except AssertionError as err:
                    failures.append(str(err))
        finally:
            torch.set_num_threads(threads)
    assert not failures, "\n\n".join(failures)
