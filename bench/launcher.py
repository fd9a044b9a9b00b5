"""Launch a job under torchrun on 127.0.0.1 (gloo), bounded in time: the benches' and the
distributed tests' one launcher (``tests/distributed/test_distributed.py`` imports it).

A timed-out job's whole process group is killed (torchrun and every rank), so no rank is left
behind holding a port or the CPU.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["Finished", "free_port", "torchrun"]


@dataclass(frozen=True)
class Finished:
    """How a launch ended: its exit code (the kill's when it timed out), its output (stdout
    and stderr of torchrun and every rank, interleaved) and its wall time."""

    code: int
    output: str
    seconds: float
    timed_out: bool


def free_port() -> int:
    """A TCP port free on 127.0.0.1 just now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: list[str], *, timeout: float, nproc: int = 2, max_restarts: int = 0,
             env: dict[str, str] | None = None) -> Finished:
    """Run ``script`` (a Python file and its arguments) on ``nproc`` ranks under
    ``python -m torch.distributed.run``, gloo over the loopback, one thread per process.

    Args:
        script: the worker file and its arguments.
        timeout: seconds the whole job may run; then its process group is killed.
        nproc: ranks on this machine.
        max_restarts: torchrun's ``--max-restarts`` (elastic restarts after a failure).
        env: variables added to this process's environment.

    Returns:
        The exit code, the output and the wall time; ``timed_out`` where the job was killed.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--max-restarts", str(max_restarts), *script]
    full_env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    start = time.monotonic()
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        if proc.poll() is None:  # interrupted: leave no rank behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Finished(proc.returncode, output, time.monotonic() - start, timed_out)
