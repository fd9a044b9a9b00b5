"""Shared helpers of the checkpoint tests: state comparison and the SIGKILL fork server."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.trees import assert_same  # noqa: F401 - re-exported for the checkpoint tests

HELPER = Path(__file__).with_name("checkpoint_kill_helper.py")


def temp_files(folder: Path) -> list[str]:
    """Names of the atomic writer's temporary files in ``folder``."""
    return [name for name in os.listdir(folder) if ".tmp-" in name]


class SaverServer:
    """The kill helper as a subprocess: ``start()`` forks a saver of ``path``, ``kill(pid)``
    SIGKILLs it and waits until it is reaped. Every read fails instead of hanging after
    ``seconds``."""

    def __init__(self, path: Path, mode: str, stderr_file: Path, seconds: float = 50) -> None:
        self.errors = stderr_file
        self.deadline = time.monotonic() + seconds
        self.buffer = bytearray()
        self.live: int | None = None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(HELPER.parents[2]), os.environ.get("PYTHONPATH", "")])}
        with open(stderr_file, "wb") as stderr:  # a file, not a pipe: reading it never blocks
            self.proc = subprocess.Popen(
                [sys.executable, str(HELPER), str(path), mode], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, env=env, bufsize=0)
        assert self.read_line() == "ready"

    def read_line(self) -> str:
        """Next stdout line of the server."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"helper silent; its stderr:\n{self.errors.read_text()}")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError(f"helper exited; its stderr:\n{self.errors.read_text()}")
            self.buffer += chunk
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer[:] = rest
        return line.decode()

    def start(self) -> int:
        """Fork a saver; its pid."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"run\n")
        self.live = int(self.read_line().split()[1])
        return self.live

    def kill(self, pid: int) -> None:
        """SIGKILL saver ``pid`` and wait until it is reaped."""
        os.kill(pid, signal.SIGKILL)
        assert self.read_line() == f"dead {pid}"
        self.live = None

    def close(self) -> None:
        if self.live is not None:
            try:
                os.kill(self.live, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
