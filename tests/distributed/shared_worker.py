"""One torchrun job for several tests' rank scripts (tests/conftest.py's ``shared_ranks``):
each ``SCRIPT OUT LOG`` triple runs in turn in these 2 ranks as ``torchrun SCRIPT OUT`` would
run it (``__main__``, its folder first on sys.path, ``sys.argv`` = [SCRIPT, OUT]), its
output to ``LOG.rank<R>`` and its exit code as that file's last line. A torchrun start costs
each rank the import of torch and fitdp (~5 s of CPU, most of it torchmetrics'): once here.

A script that makes the default process group itself leaves it as it found it (fitdp joins
the group it finds, or makes its own).

Usage: torchrun ... shared_worker.py SCRIPT OUT LOG [SCRIPT OUT LOG ...]
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback

RANK = os.environ["RANK"]
jobs = sys.argv[1:]
for script, out, log in zip(jobs[0::3], jobs[1::3], jobs[2::3]):
    os.makedirs(out, exist_ok=True)
    path, sys.argv = list(sys.path), [script, out]
    sys.path.insert(0, os.path.dirname(script))
    with open(f"{log}.rank{RANK}", "w") as f, contextlib.redirect_stdout(f), \
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
