"""The snapshot fence: a weight change waits for background copies of the weights.

An async checkpoint save (``Model.save(path, async_save=True)``) copies the weights and the
optimizer state on its writer thread while the next forward and backward run: neither changes
them. Whatever changes them next (the optimizer step in ``Update.apply``, ``set_weights``,
``load``, averaging the replicas into the host module) first calls ``wait_for_snapshots``.
With no copy pending that is one list read; with one, the wait is what the copy had left.

Example:
    >>> import threading
    >>> done = threading.Event()
    >>> hold(done)
    >>> done.set()  # the writer thread, once its copy is complete
    >>> wait_for_snapshots(); pending
    []
"""

from __future__ import annotations

import threading

__all__ = ["hold", "pending", "wait_for_snapshots"]

pending: list[threading.Event] = []  # copies not known to be complete; read without the lock
_lock = threading.Lock()


def hold(copied: threading.Event) -> None:
    """Make every later ``wait_for_snapshots`` wait until ``copied`` is set."""
    with _lock:
        pending.append(copied)


def wait_for_snapshots() -> None:
    """Return once every held copy is complete (at once when none is pending). Safe from
    several threads (the sharded optimizer step calls it on each device thread)."""
    if not pending:
        return
    with _lock:
        events = list(pending)
    for event in events:
        event.wait()
    with _lock:
        pending[:] = [e for e in pending if not e.is_set()]
