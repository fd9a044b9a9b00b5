"""A sharded save whose write fails on one rank (a full disk) is an OSError naming the step
folder with the errno, on every rank (issue 37, item 10)."""

from __future__ import annotations

import errno
import os

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "full_disk_worker.py")
pytestmark = [pytest.mark.distributed, pytest.mark.ranks_script(WORKER)]


def test_a_failed_write_on_one_rank_is_an_os_error_naming_the_folder_on_every_rank(
        shared_ranks):
    """Was DCP's CheckpointException around torch's "[enforce fail at inline_container.cc]
    unexpected pos", with no path and no errno: DCP hands each rank's error to the others
    pickled, which dropped the OSError torch's error held as its context."""
    run = shared_ranks(WORKER)  # the job's 2 ranks run full_disk_worker.py
    assert run.code == 0, run.output
    want = f"caught OSError errno={errno.EFBIG} [Errno {errno.EFBIG}] File too large: " \
           f"'{run.out / 'step-3'}'"
    assert run.output.count(want) == 2, run.output
    assert not (run.out / "LATEST").exists()
