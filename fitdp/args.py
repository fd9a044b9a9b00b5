"""Argument checks shared by ``Model``'s methods: what was received, what was expected."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fitdp.callbacks import Callback


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``.

    Raises:
        TypeError: not an int (bools are refused). ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}); expected an int")
    if value < minimum:
        raise ValueError(f"{name}: got {value}; expected an int >= {minimum}")
    return value


def resolve_seed(seed: int | None) -> int:
    """The data-order seed: ``seed``, or one drawn from torch's global RNG so that
    ``torch.manual_seed`` makes the order reproducible."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: got {type(seed).__name__}; expected an int or None")
    return seed


def verbose_level(verbose: int | str) -> int:
    """``"auto"`` -> 1 (a progress bar); 0 silent; 2 one line per epoch."""
    level = 1 if verbose == "auto" else verbose
    if level not in (0, 1, 2):
        raise ValueError(f"verbose: got {verbose!r}; expected 'auto', 0, 1 or 2")
    return int(level)


def check_callbacks(callbacks: Sequence[Callback] | None) -> list[Callback]:
    """A list of ``Callback`` instances.

    Raises:
        TypeError: not a list, or an entry that is not a Callback instance.
    """
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Sequence):
        raise TypeError(
            f"callbacks: got {type(callbacks).__name__}; expected a list of "
            f"fitdp.callbacks.Callback instances"
        )
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(
                f"callbacks: got an entry of type {type(cb).__name__}; expected "
                f"fitdp.callbacks.Callback instances (did you pass the class?)"
            )
    return list(callbacks)
