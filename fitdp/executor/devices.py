"""Device resolution: the one place that turns a user's ``devices`` argument into torch devices."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

DevicesArg = str | int | torch.device | Sequence[int | str | torch.device]


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _one(spec: int | str | torch.device, requested: object) -> torch.device:
    if isinstance(spec, bool) or not isinstance(spec, (int, str, torch.device)):
        raise TypeError(
            f"devices: each entry must be an int (CUDA ordinal), a string such as 'cpu' or "
            f"'cuda:1', or a torch.device; got {spec!r} of type {type(spec).__name__} in "
            f"{requested!r}"
        )
    try:
        dev = torch.device(f"cuda:{spec}" if isinstance(spec, int) else spec)
    except RuntimeError as err:
        raise ValueError(
            f"devices: {spec!r} is not a device name; expected 'cpu', 'cuda', 'cuda:N' or an int"
        ) from err
    if dev.type == "cuda":
        count = _cuda_count()
        index = 0 if dev.index is None else dev.index
        if index >= count:
            have = list(range(count)) if count else "no CUDA GPU"
            raise ValueError(
                f"devices: you requested GPU {index} (from {requested!r}) but this machine has "
                f"{have}. Fix: pass devices='auto', devices=['cpu'] or an index in "
                f"{list(range(count))}."
                if count
                else f"devices: you requested GPU {index} (from {requested!r}) but this machine "
                f"has no CUDA GPU (torch.cuda.is_available() is False). Fix: pass "
                f"devices='auto' or devices=['cpu'] (['cpu', 'cpu'] for two CPU replicas)."
            )
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"devices: {spec!r} is not supported; fitdp runs on 'cpu' and 'cuda'")
    return torch.device("cpu")


def resolve_devices(devices: DevicesArg = "auto") -> list[torch.device]:
    """Turn ``devices`` into a list of ``torch.device``.

    Args:
        devices: ``"auto"`` (every visible CUDA GPU, else the CPU; under torchrun the rank's
            ``cuda:LOCAL_RANK``), an int ``n`` (GPUs ``0..n-1``), or a list of ints, strings or
            torch.devices. ``["cpu", "cpu"]`` is two replicas on the CPU.

    Returns:
        One torch.device per replica.

    Raises:
        ValueError: an empty list, or a device that does not exist.
        TypeError: an entry of the wrong type.

    Example:
        >>> resolve_devices(["cpu", "cpu"])
        [device(type='cpu'), device(type='cpu')]
    """
    if isinstance(devices, str) and devices == "auto":
        count = _cuda_count()
        if count and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return [torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % count)]
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"devices: got {devices}; expected a positive number of GPUs")
        return [_one(i, devices) for i in range(devices)]
    if isinstance(devices, (str, torch.device)):
        return [_one(devices, devices)]
    if not isinstance(devices, Sequence):
        raise TypeError(
            f"devices: got {type(devices).__name__}; expected 'auto', an int, or a list of "
            f"ints/strings/torch.devices such as ['cpu', 'cpu']"
        )
    if len(devices) == 0:
        raise ValueError(
            "devices: got an empty list; expected at least one device. Fix: devices=['cpu'] "
            "or devices='auto'."
        )
    return [_one(d, devices) for d in devices]


def pin_host_batches(devices: Sequence[torch.device]) -> bool:
    """Whether host batches should be in pinned memory: they go to CUDA devices, and a
    ``non_blocking`` copy from pageable memory is staged by the driver (which may serialize
    it with the GPU's work), while one from pinned memory is a true asynchronous DMA.

    Example:
        >>> pin_host_batches([torch.device("cpu")])
        False
    """
    return all(d.type == "cuda" for d in devices)
