"""Fork server for the SIGKILL tests in tests/saving/ (not a test module).

Importing torch costs about a second, so this process imports it once and forks one saver per
``run`` line read from stdin; the saver resumes from ``PATH`` and rewrites it in a loop, and the
test SIGKILLs it. ``MODE`` is ``sync`` (``save_checkpoint``) or ``async``
(``AsyncCheckpointWriter.submit``, one save in flight while the next state is built; its
tensors deferred, so the kill also lands during the writer thread's copy).
Protocol (one line each): the server prints ``ready``, then for each ``run``: ``pid <pid>``
when the saver starts and ``dead <pid>`` once reaped.

Usage: python checkpoint_kill_helper.py PATH [MODE]
"""

from __future__ import annotations

import os
import sys

import torch

from fitdp.saving.async_writer import AsyncCheckpointWriter
from fitdp.saving.checkpoint import load_checkpoint, save_checkpoint

ELEMENTS = 1 << 18  # 1 MB of float32 plus 2 MB of int64: a few MB per checkpoint


def make_state(counter: int) -> dict[str, object]:
    """A checkpoint whose every tensor equals ``counter``, so a torn write would show."""
    return {
        "counter": counter,
        "weights": torch.full((ELEMENTS,), float(counter)),
        "nested": {"steps": [torch.full((ELEMENTS,), counter, dtype=torch.int64), counter]},
    }


def save_forever(path: str, mode: str) -> None:
    """Resume the counter from ``path`` and save increasing counters until killed."""
    counter = load_checkpoint(path)["counter"]
    writer = AsyncCheckpointWriter() if mode == "async" else None
    while True:
        counter += 1
        if writer is None:
            save_checkpoint(path, make_state(counter))
        else:
            state = make_state(counter)
            writer.submit(path, state, defer=[state["weights"], state["nested"]["steps"][0]])


def main() -> None:
    """Serve ``run`` lines until stdin closes."""
    path = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "sync"
    torch.set_num_threads(1)  # the machine is shared; one core is plenty for 3 MB
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        pid = os.fork()
        if pid == 0:
            try:
                save_forever(path, mode)
            finally:
                os._exit(1)  # never fall back into the server loop
        print(f"pid {pid}", flush=True)
        os.waitpid(pid, 0)
        print(f"dead {pid}", flush=True)


if __name__ == "__main__":
    main()
