"""The signals a call handles: Ctrl-C held during a step, SIGTERM read between steps.

A call's steps run whole. A KeyboardInterrupt that lands between the optimizer step on
device 0 and the broadcast of its parameters leaves replicas that disagree (measured before
this guard: 5 of 16 trials). So a step runs in ``GUARD``'s critical section: a SIGINT that
arrives then is held and raised as KeyboardInterrupt when the section ends. Installing a
signal handler costs about 10 us, too much per step on a small model, so ``Model`` installs
it once per call with ``GUARD.installed()``; ``GUARD.critical()`` installs it for its own
duration when nobody has. SIGTERM (a preempted job) becomes a flag (``SIGTERM``) that the
session reads between training steps; ``fit`` then ends with ``Preempted``.

Each object here is one per process: there is one handler slot per signal.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any


class InterruptGuard:
    """Holds SIGINT while a critical section runs (main thread only; elsewhere a no-op, as
    Python delivers signals to the main thread alone).

    Example:
        >>> guard = InterruptGuard()
        >>> with guard.installed(), guard.critical():
        ...     pass  # a Ctrl-C here surfaces when the block ends
    """

    def __init__(self) -> None:
        self._depth = 0
        self._installs = 0
        self._pending = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._depth:
            self._pending = True
            return
        previous = self._previous
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Install the SIGINT handler for the duration (re-entrant)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        if self._installs == 0:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        self._installs += 1
        try:
            yield
        finally:
            self._installs -= 1
            if self._installs == 0:
                signal.signal(signal.SIGINT, self._previous)
                self._previous = None

    def critical(self) -> contextlib.AbstractContextManager[None]:
        """Run the block whole: a SIGINT during it is raised when it ends. Returns the guard
        itself (a reusable context: entering it is two calls) once ``installed()``, else a
        context that installs the handler for the block."""
        if self._installs == 0 and threading.current_thread() is threading.main_thread():
            return self._installed_critical()
        return self

    @contextlib.contextmanager
    def _installed_critical(self) -> Iterator[None]:
        with self.installed(), self:
            yield

    def __enter__(self) -> None:
        """Enter a critical section (re-entrant: the depth is counted); the caller has the
        handler ``installed()`` (else a SIGINT is not held)."""
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._pending and self._depth == 0:
            self._pending = False
            raise KeyboardInterrupt


GUARD = InterruptGuard()  # one per process: there is one SIGINT handler slot


class Preempted(SystemExit):
    """``fit`` stopped on SIGTERM (a preempted job): the step that was running finished,
    every ``BackupAndRestore`` of the call wrote its backup, and the model is as after that
    step. A subclass of ``SystemExit`` with code 143 (128 + SIGTERM, what a shell reports for
    a process SIGTERM ended), so a script that does not catch it exits as a terminated job
    does, quietly; run the same script again and it resumes from the backup.

    Example:
        >>> err = Preempted("fit: preempted")
        >>> err.code, str(err)
        (143, 'fit: preempted')
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 143


class SigtermFlag:
    """Turns SIGTERM into a flag read between steps, while ``installed()`` (main thread only:
    Python runs signal handlers there alone); the previous handler comes back after.

    Example:
        >>> flag = SigtermFlag()
        >>> with flag.installed() as on:
        ...     on, flag.requested
        (True, False)
    """

    def __init__(self) -> None:
        self.requested = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # acted on at the next step boundary, never inside a step

    @contextlib.contextmanager
    def installed(self) -> Iterator[bool]:
        """Catch SIGTERM for the duration; yields whether the handler is in place. A SIGTERM
        caught and not acted on (it came after the last step) is sent again to the previous
        handler once it is back, so it is never swallowed."""
        if threading.current_thread() is not threading.main_thread():
            yield False
            return
        self.requested = False
        previous = signal.signal(signal.SIGTERM, self._handler)
        acted = False
        try:
            yield True
        except Preempted:
            acted = True
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            pending, self.requested = self.requested, False
            if pending and not acted:
                signal.raise_signal(signal.SIGTERM)


SIGTERM = SigtermFlag()  # one per process: there is one SIGTERM handler slot
