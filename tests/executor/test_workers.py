"""DeviceWorkers: one persistent thread per extra device; every task ends before run()
returns or raises."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from fitdp.executor.step import DeviceWorkers


def test_results_in_device_order_and_threads_are_reused():
    workers = DeviceWorkers(3)
    names = set()
    for _ in range(5):
        out = workers.run([lambda d=d: (d, threading.current_thread().name) for d in range(3)])
        assert [d for d, _ in out] == [0, 1, 2]
        names |= {name for _, name in out[1:]}
    assert names == {"fitdp-device-1", "fitdp-device-2"}
    workers.close()
    assert workers.alive == 0
    workers.close()  # idempotent


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_an_exception_in_any_worker_is_raised_after_all_finish(failing):
    workers = DeviceWorkers(3)
    finished = []

    def task(d: int):
        if d == failing:
            raise ValueError(f"device {d}")
        time.sleep(0.05)
        finished.append(d)

    with pytest.raises(ValueError, match=f"device {failing}"):
        workers.run([lambda d=d: task(d) for d in range(3)])
    assert sorted(finished) == [d for d in range(3) if d != failing]
    assert workers.run([lambda: 1] * 3) == [1, 1, 1]  # still usable
    workers.close()


def test_a_keyboard_interrupt_in_a_worker_waits_for_the_others():
    workers = DeviceWorkers(3)
    finished = []

    def slow():
        time.sleep(0.1)
        finished.append("slow")

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        workers.run([lambda: None, interrupted, slow])
    assert finished == ["slow"]
    workers.close()


def test_first_exception_by_device_order_wins():
    workers = DeviceWorkers(3)

    def fail(d: int):
        time.sleep(0.05 * (3 - d))  # device 2 fails first in time
        raise RuntimeError(f"device {d}")

    with pytest.raises(RuntimeError, match="device 1"):
        workers.run([lambda: None] + [lambda d=d: fail(d) for d in (1, 2)])
    workers.close()


def test_a_collected_pool_stops_its_threads():
    gc.collect()  # pools that earlier tests dropped: their threads are not ours to count
    time.sleep(0.2)
    before = threading.active_count()
    for _ in range(10):
        DeviceWorkers(3).run([lambda: None] * 3)
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before
