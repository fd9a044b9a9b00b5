"""Fork server for the SIGKILL test in test_checkpoint_io.py (not a test module).

Importing torch costs about a second, so this process imports it once and forks one saver per
``run`` line read from stdin; the saver resumes from ``PATH`` and rewrites it in a loop, and the
test SIGKILLs it at a random moment. Protocol (one line each): the server prints ``ready``,
then for each ``run``: ``pid <pid>`` when the saver starts and ``dead <pid>`` once reaped.
"""

from __future__ import annotations

import os
import sys

import torch

from fitdp.checkpoint import load_checkpoint, save_checkpoint

ELEMENTS = 1 << 18  # 1 MB of float32 plus 2 MB of int64: a few MB per checkpoint


def make_state(counter: int) -> dict[str, object]:
    """A checkpoint whose every tensor equals ``counter``, so a torn write would show."""
    return {
        "counter": counter,
        "weights": torch.full((ELEMENTS,), float(counter)),
        "nested": {"steps": [torch.full((ELEMENTS,), counter, dtype=torch.int64), counter]},
    }


def save_forever(path: str) -> None:
    """Resume the counter from ``path`` and save increasing counters until killed."""
    counter = load_checkpoint(path)["counter"]
    while True:
        counter += 1
        save_checkpoint(path, make_state(counter))


def main() -> None:
    """Serve ``run`` lines until stdin closes."""
    path = sys.argv[1]
    torch.set_num_threads(1)  # the machine is shared; one core is plenty for 3 MB
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        pid = os.fork()
        if pid == 0:
            try:
                save_forever(path)
            finally:
                os._exit(1)  # never fall back into the server loop
        print(f"pid {pid}", flush=True)
        os.waitpid(pid, 0)
        print(f"dead {pid}", flush=True)


if __name__ == "__main__":
    main()
