"""Activation checkpointing of chosen blocks in every replica (``compile(activation_
checkpointing=[Block])``): their activations are not kept for backward but recomputed in it,
through torch's non-reentrant ``torch.utils.checkpoint``.

A block's ``forward`` is replaced, on the replica's module object, by one that runs the
original under ``checkpoint`` when gradients are on, for the length of one call (put back
when it ends): the module's class, parameter names and state dict never change, so saving,
export and a replica copy made later see the module as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fitdp.checks import fail

# Layers that draw random numbers in training (with p > 0): a recompute replays their draws.
_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
           nn.FeatureAlphaDropout)


def check_blocks(blocks: Any, module: nn.Module) -> tuple[type[nn.Module], ...]:
    """``compile(activation_checkpointing=...)`` as a tuple of classes, each found in
    ``module``.

    Raises:
        TypeError: not a list or tuple of ``nn.Module`` subclasses.
        ValueError: a class of which ``module`` holds no submodule.
    """
    name = "compile(activation_checkpointing=...)"
    if blocks is None:
        return ()
    if not isinstance(blocks, (list, tuple)) or not all(
            isinstance(b, type) and issubclass(b, nn.Module) for b in blocks):
        fail(name, blocks, "a list of nn.Module classes (the blocks to recompute in "
             "backward)", "pass e.g. activation_checkpointing=[nn.TransformerEncoderLayer]",
             error=TypeError)
    classes = tuple(blocks)
    for cls in classes:
        if not any(isinstance(m, cls) for m in module.modules()):
            fail(name, [c.__name__ for c in classes], f"classes of blocks the module holds; "
                 f"it holds no {cls.__name__}", f"drop {cls.__name__}, or name the class "
                 f"of the module's repeated blocks")
    return classes


class Checkpointed:
    """A block's ``forward`` under non-reentrant ``torch.utils.checkpoint`` while gradients
    are on (in evaluation and predict it is the plain forward: nothing is kept anyway).

    Args:
        forward: the block's own forward (bound).
    """

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


class ActivationCheckpointing:
    """Installs ``Checkpointed`` forwards on every block of ``classes`` in the replicas of
    one call, and puts the blocks' forwards back at its end.

    Args:
        classes: the block classes (``check_blocks``).
        modules: every replica's module (of every bucket).
        devices: the replicas' devices.

    Raises:
        ValueError: replicas sharing a device's generator (several CPU replicas) and a
            block holding a dropout layer: its recompute in backward sets the generator's
            state back to the forward's, and another replica's thread drawing from that
            generator meanwhile would get other numbers.
    """

    def __init__(self, classes: Sequence[type[nn.Module]], modules: Sequence[nn.Module],
                 devices: Sequence[torch.device]) -> None:
        self.blocks = [m for root in modules for m in root.modules() if isinstance(
            m, tuple(classes))] if classes else []
        if len(set(devices)) < len(devices):  # replicas that share a generator
            for block in self.blocks:
                drops = [m for m in block.modules() if isinstance(m, _RANDOM)
                         and getattr(m, "p", 0) > 0]
                if drops:
                    fail("compile(activation_checkpointing=...)",
                         f"{type(block).__name__} blocks holding {type(drops[0]).__name__}"
                         f"(p={drops[0].p})", "blocks without random layers on several CPU "
                         "replicas: they share one generator, and a block's recompute in "
                         "backward resets it while another replica draws from it",
                         "set the blocks' dropout to 0, train on one CPU device or on GPUs, "
                         "or checkpoint other blocks", described=True)
        self.saved: list[tuple[nn.Module, Any]] = []
        for block in self.blocks:
            own = block.__dict__.get("forward")  # a forward set on the instance, kept
            self.saved.append((block, own))
            block.forward = Checkpointed(own if own is not None else functools.partial(
                type(block).forward, block))  # type: ignore[method-assign]

    def remove(self) -> None:
        """Every block's forward as it was."""
        for block, own in self.saved:
            if own is None:
                del block.__dict__["forward"]
            else:
                block.forward = own  # type: ignore[method-assign]
        self.saved = []
