"""The snapshot fence: a weight change waits for background copies of the weights.

An async checkpoint save (``Model.save(path, async_save=True)``) copies the weights and the
optimizer state on its writer thread while the next forward and backward run: neither changes
them. Whatever changes them next first waits for the copy: ``set_weights``, ``load`` and
averaging the replicas into the host module call ``wait_for_snapshots``; the executor's
optimizer step runs its manager's ``before_step`` hooks, where ``fence_steps`` puts a wait
while a copy is pending (the executor itself knows nothing of saving). With no copy pending
``wait_for_snapshots`` is one list read; with one, the wait is what the copy had left.

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
from collections.abc import Callable

__all__ = ["fence_steps", "hold", "pending", "wait_for_snapshots"]

pending: list[threading.Event] = []  # copies not known to be complete; read without the lock
_lock = threading.Lock()


def hold(copied: threading.Event) -> None:
    """Make every later ``wait_for_snapshots`` wait until ``copied`` is set."""
    with _lock:
        pending.append(copied)


def wait_for_snapshots() -> None:
    """Return once every held copy is complete (at once when none is pending). Safe from
    several threads (a custom step's optimizer step runs on a replica thread)."""
    if not pending:
        return
    with _lock:
        events = list(pending)
    for event in events:
        event.wait()
    with _lock:
        pending[:] = [e for e in pending if not e.is_set()]


def fence_steps(hooks: list[Callable[[], None]]) -> None:
    """While a copy is pending, the optimizer steps that run ``hooks`` (an executor
    manager's ``before_step``) first wait for it; the wait takes itself out once every copy
    is complete, so later steps run no hook at all."""
    if not pending or any(getattr(h, "fences", False) for h in hooks):
        return

    def wait() -> None:
        wait_for_snapshots()
        if wait in hooks:
            hooks.remove(wait)

    wait.fences = True  # type: ignore[attr-defined]
    hooks.append(wait)
