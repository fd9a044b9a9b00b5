"""A sharded save whose write fails on one rank (a full disk) is an OSError naming the step
folder with the errno, on every rank (issue 37, item 10)."""

from __future__ import annotations

import errno
import os

import pytest
from test_distributed import launch

pytestmark = pytest.mark.distributed
WORKER = os.path.join(os.path.dirname(__file__), "full_disk_worker.py")


def test_a_failed_write_on_one_rank_is_an_os_error_naming_the_folder_on_every_rank(tmp_path):
    """Was DCP's CheckpointException around torch's "[enforce fail at inline_container.cc]
    unexpected pos", with no path and no errno: DCP hands each rank's error to the others
    pickled, which dropped the OSError torch's error held as its context."""
    code, output, _ = launch("", tmp_path, script=[WORKER, str(tmp_path / "c")], limit=90)
    assert code == 0, output
    want = f"caught OSError errno={errno.EFBIG} [Errno {errno.EFBIG}] File too large: " \
           f"'{tmp_path / 'c' / 'step-3'}'"
    assert output.count(want) == 2, output
    assert not (tmp_path / "c" / "LATEST").exists()
