"""One torchrun job for several tests' rank scripts (tests/conftest.py's ``shared_ranks``):
each entry of JOBS_JSON (``argv``: [SCRIPT, *ARGS, OUT], ``log``) runs in turn in these 2 ranks
as ``torchrun SCRIPT *ARGS OUT`` would run it (``__main__``, its folder first on sys.path,
that ``sys.argv``), its output to ``LOG.rank<R>`` and its exit code as that file's last line.
A torchrun start costs each rank the import of torch and fitdp (~5 s of CPU, most of it
torchmetrics'): once here.

A script that makes the default process group itself leaves it as it found it (fitdp joins
the group it finds, or makes its own).

Usage: torchrun ... shared_worker.py JOBS_JSON
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import traceback

RANK = os.environ["RANK"]
with open(sys.argv[1]) as jobs:
    entries = json.load(jobs)
for entry in entries:
    script = entry["argv"][0]
    os.makedirs(entry["argv"][-1], exist_ok=True)
    path, sys.argv = list(sys.path), list(entry["argv"])
    sys.path.insert(0, os.path.dirname(script))
    with open(f"{entry['log']}.rank{RANK}", "w") as f, contextlib.redirect_stdout(f), \
            contextlib.redirect_stderr(f):
        code: object = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            code = stop.code
        except BaseException:  # noqa: BLE001 - the test reads it; the next script still runs
            traceback.print_exc()
            code = 1
        print(f"exit code {code}", flush=True)
    sys.path[:] = path
    print(f"rank {RANK}: {os.path.basename(script)} exit code {code}", flush=True)
