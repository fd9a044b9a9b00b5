"""One worker thread per device, so replicas run at once (PyTorch ops release the GIL)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any


class DeviceWorkers:
    """Runs one task per device concurrently: task 0 on the caller, task d on worker thread d.

    Workers are persistent (started once, reused every step), because starting threads per
    step would cost more than a small model's whole step.

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

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks[d]`` for every device d at once; return their results in order.

        Raises the first task's exception (by device order) after every task has finished,
        so no worker is left running on half-updated state.
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
        results = []
        for fut in [first, *futures]:
            exc = fut.exception()
            if exc is not None:
                for other in futures:
                    other.exception()
                raise exc
            results.append(fut.result())
        return results

    def close(self) -> None:
        """Stop the worker threads."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._queues, self._threads = [], []


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
