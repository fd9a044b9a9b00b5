"""Split a batch across devices by work load (MXNet's ``_split_input_slice``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

from fitdp.executor.checks import check_split


def check_work_load_list(work_load_list: Sequence[float] | None, num_devices: int) -> list[float]:
    """Validate a work load list (one positive entry per device); None means equal loads."""
    if work_load_list is None:
        return [1.0] * num_devices
    if isinstance(work_load_list, (str, bytes)) or not isinstance(work_load_list, Sequence):
        raise TypeError(
            f"work_load_list: got {work_load_list!r} ({type(work_load_list).__name__}); "
            f"expected a list of {num_devices} positive numbers, one per device, or 'auto' "
            f"(loads measured while training)"
        )
    if len(work_load_list) != num_devices:
        raise ValueError(
            f"work_load_list: got {len(work_load_list)} entries {list(work_load_list)} for "
            f"{num_devices} devices; expected one positive number per device. Fix: pass "
            f"{num_devices} entries or leave it None for equal loads."
        )
    loads = []
    for w in work_load_list:
        if isinstance(w, int) and not isinstance(w, bool) and w > sys.float_info.max:
            raise ValueError(
                f"work_load_list: got an int of {len(str(w))} digits; expected shares below "
                f"{sys.float_info.max:.3g} (relative shares: only their ratios count). Fix: "
                f"scale them down, e.g. [1.0, 2.0]."
            )
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < math.inf:
            raise ValueError(
                f"work_load_list: got {list(work_load_list)}; every entry must be a positive, "
                f"finite number (a device's relative share of each batch)"
            )
        loads.append(float(w))
    if not math.isfinite(sum(loads)):  # each share is load * rows / sum: it would overflow
        raise ValueError(
            f"work_load_list: got {list(work_load_list)}, whose sum is not a finite number; "
            f"expected relative shares with a finite sum. Fix: scale them down, e.g. "
            f"{[round(w / max(loads), 6) for w in loads]}."
        )
    return loads


def check_work_load_arg(work_load_list: Sequence[float] | str | None, num_devices: int
                        ) -> list[float] | str:
    """``check_work_load_list``, also accepting ``"auto"`` (returned as it is).

    Example:
        >>> check_work_load_arg("auto", 2), check_work_load_arg(None, 2)
        ('auto', [1.0, 1.0])
    """
    if isinstance(work_load_list, str):  # the right type, so a wrong value: ValueError
        if work_load_list == "auto":
            return "auto"
        raise ValueError(
            f"work_load_list: got {work_load_list!r}; expected 'auto' (loads measured while "
            f"training) or a list of {num_devices} positive numbers, one per device. Fix: "
            f"pass work_load_list='auto' or a list such as {[1] * num_devices}."
        )
    return check_work_load_list(work_load_list, num_devices)  # type: ignore[arg-type]


def split_input_slice(batch_size: int, work_load_list: Sequence[float]) -> list[slice]:
    """Split ``batch_size`` rows into contiguous slices proportional to the work loads.

    Uses largest-remainder rounding: with equal loads and ``batch_size >= len(loads)`` no
    device is left empty (the seed's half-to-even ``round`` could leave one empty).

    Args:
        batch_size: rows in the batch.
        work_load_list: relative share of each device, in device order.

    Returns:
        One slice per device, in order, covering ``range(batch_size)``.

    Raises:
        TypeError: ``batch_size`` is not an int, or ``work_load_list`` not a list of numbers.
        ValueError: ``batch_size`` < 1, an empty list, an entry that is not positive and
            finite; ``Too many slices. Some splits are empty.`` when a slice would be empty.

    Example:
        >>> split_input_slice(10, [1, 1, 3])
        [slice(0, 2, None), slice(2, 4, None), slice(4, 10, None)]
    """
    check_split(batch_size, work_load_list)
    loads = check_work_load_list(work_load_list, len(work_load_list))
    total = sum(loads)
    # A huge load times the rows overflows to inf: then its share of the total first.
    shares = [w * batch_size / total if math.isfinite(w * batch_size) else
              w / total * batch_size for w in loads]
    counts = [int(s) for s in shares]
    # Hand the rows lost to flooring to the largest fractional parts (earlier device on ties).
    order = sorted(range(len(shares)), key=lambda i: (counts[i] - shares[i], i))
    for i in order[: batch_size - sum(counts)]:
        counts[i] += 1
    slices = []
    begin = 0
    for n in counts:
        if n <= 0:
            raise ValueError("Too many slices. Some splits are empty.")
        slices.append(slice(begin, begin + n))
        begin += n
    return slices


def device_slices(rows: int, work_load_list: Sequence[float]) -> list[slice]:
    """``split_input_slice`` for a step of ``rows`` rows that may be fewer than the devices:
    a final short batch goes to the first devices and leaves the rest idle for that step
    (an empty slice each); 0 rows (a rank with nothing left) gives every device nothing.

    Example:
        >>> device_slices(2, [1, 1, 1])
        [slice(0, 1, None), slice(1, 2, None), slice(2, 2, None)]
    """
    if rows == 0:
        return [slice(0, 0)] * len(work_load_list)
    n = len(work_load_list)
    while True:
        try:
            slices = split_input_slice(rows, work_load_list[:n])
            break
        except ValueError:
            if n == 1:
                raise
            n -= 1
    return slices + [slice(rows, rows)] * (len(work_load_list) - n)
