"""One rank of test_harness_ranks.py's 2-rank job: runs each drawn `Run` of a JSON file in
turn in the same process group (each torchrun start costs ~10 s): the uninterrupted run on
2 ranks when the test needs it, the run up to its stop, and its resume when that stays on 2
ranks. Rank 0 saves what it got to ``OUT/<i>/``; a resume on one process is the test's.

Usage: torchrun ... rank_worker.py RUNS.json OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from harness_promises import against_uninterrupted  # noqa: E402
from harness_runner import first_part, resume_part, uninterrupted  # noqa: E402
from harness_runs import Run  # noqa: E402

torch.set_num_threads(1)
RUNS, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ["RANK"])
with open(RUNS) as f:
    runs = [Run.from_json(text) for text in json.load(f)]
for i, run in enumerate(runs):
    start = time.monotonic()
    folder = os.path.join(OUT, str(i))
    got: dict[str, Any] = {}
    try:
        if run.stop is None or against_uninterrupted(run) is not None:
            got["uninterrupted"] = uninterrupted(run, checkpointing=False)
        if run.checkpointing and run.stop is None:
            got["drawn"] = uninterrupted(run)
        if run.stop is not None:
            first_part(run, folder)
            dist.barrier()  # rank 0's checkpoint is complete before any rank reads it
            if run.stop.ranks == run.ranks:
                got["drawn"] = resume_part(run, folder)
    except ValueError as err:  # a refusal: the test judges whether the docs allow it
        got["refused"] = str(err)
    if RANK == 0:
        os.makedirs(folder, exist_ok=True)
        torch.save(got, os.path.join(folder, "got.pt"))
    print(f"run {i} ok ({time.monotonic() - start:.1f} s)", flush=True)
