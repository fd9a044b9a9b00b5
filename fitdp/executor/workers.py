"""One worker thread per device, so replicas run at once (PyTorch ops release the GIL)."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any


class DeviceWorkers:
    """Runs one task per device concurrently: task 0 on the caller, task d on worker thread d.

    Workers are persistent (started once, reused every step), because starting threads per
    step would cost more than a small model's whole step. They stop on ``close()`` or when
    this object is garbage-collected (the threads hold only their queues, never this object).

    Example:
        >>> w = DeviceWorkers(2)
        >>> w.run([lambda: 1, lambda: 2])
        [1, 2]
        >>> w.close()
    """

    def __init__(self, num_devices: int) -> None:
        self._queues: list[queue.SimpleQueue[Any]] = []
        self._threads: list[threading.Thread] = []
        for d in range(1, num_devices):
            q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            t = threading.Thread(target=_serve, args=(q,), name=f"fitdp-device-{d}", daemon=True)
            t.start()
            self._queues.append(q)
            self._threads.append(t)
        self._finalizer = weakref.finalize(self, _stop, self._queues, self._threads, 0.0)

    @property
    def alive(self) -> int:
        """Worker threads still running (0 after ``close``)."""
        return sum(t.is_alive() for t in self._threads)

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks[d]`` for every device d at once; return their results in order.

        Every task has finished before this returns or raises, whatever happens: the first
        exception by device order is raised after all of them end, and a KeyboardInterrupt
        that arrives while waiting is raised only once every worker is done, so no worker is
        ever left running on state the caller is about to roll back.
        """
        if len(tasks) == 1:
            return [tasks[0]()]
        futures: list[Future[Any]] = []
        for q, task in zip(self._queues, tasks[1:]):
            fut: Future[Any] = Future()
            q.put((task, fut))
            futures.append(fut)
        first: Future[Any] = Future()
        try:
            first.set_result(tasks[0]())
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the others finish
            first.set_exception(err)
        interrupted: BaseException | None = None
        for fut in futures:
            while True:
                try:
                    fut.exception()  # waits for the task
                    break
                except KeyboardInterrupt as err:  # keep waiting: raise once all are done
                    interrupted = interrupted or err
        if interrupted is not None:
            raise interrupted
        for fut in [first, *futures]:
            exc = fut.exception()
            if exc is not None:
                raise exc
        return [fut.result() for fut in [first, *futures]]

    def close(self) -> None:
        """Stop the worker threads and wait for them (idempotent)."""
        if self._finalizer.detach() is not None:
            _stop(self._queues, self._threads)


def _stop(queues: list[queue.SimpleQueue[Any]], threads: list[threading.Thread],
          timeout: float = 10.0) -> None:
    for q in queues:
        q.put(None)
    if timeout:
        for t in threads:
            t.join(timeout=timeout)


def _serve(q: queue.SimpleQueue[Any]) -> None:
    while True:
        item = q.get()
        if item is None:
            return
        task, fut = item
        try:
            fut.set_result(task())
        except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(err)
        del task, fut, item  # drop references to the step's tensors while idle
