"""Activation checkpointing of chosen blocks in every replica (``compile(activation_
checkpointing=[Block])``): their activations are not kept for backward but recomputed in it,
through torch's non-reentrant ``torch.utils.checkpoint``.

A block's ``forward`` is replaced, on the replica's module object, by one that runs the
original under ``checkpoint`` when gradients are on, for the length of one call (put back
when it ends): the module's class, parameter names and state dict never change, so saving,
export and a replica copy made later see the module as it is.

A block that draws random numbers (dropout, as a module or through ``F.dropout``) is
recomputed with the forward's numbers. Where each replica has a generator of its own (one
device, one replica per GPU) torch's checkpoint does it (``preserve_rng_state``). Where
replicas share one (several CPU replicas), torch's way would race: a recompute sets the
generator back to the forward's state and puts it back after, while another replica's
thread draws from it. There a block's call records the generators' states itself when its
forward drew (``_Replayed``); its recompute sets them, runs and puts them back holding
``shared_generator.SHARED``, and once any block has drawn, each replica's whole forward holds
it too (``_Holding``). The forwards draw in the step's order (in turn, device order, as
without checkpointing) and no recompute moves the generator: the same numbers, bit for bit,
as without checkpointing, on any timing of the threads.

A block that takes a key/value cache (a Hugging Face decoder layer: ``use_cache``,
``cache``, ``past_key_values``, ``layer_past``) would append to it in forward and again in
the recompute; as transformers does for its own checkpointing
(``GradientCheckpointingLayer``), a checkpointed call gets ``use_cache=False`` and no cache
(a layer that only reads one, ``_can_checkpoint_with_cache``, keeps it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fitdp.checks import fail
from fitdp.executor.shared_generator import SHARED, generator

# A block's cache arguments and what a checkpointed call passes instead (transformers'
# names; its ``GradientCheckpointingLayer`` does the same): the recompute would write the
# block's keys and values into the cache a second time.
_NO_CACHE = {"use_cache": False, "cache": None, "past_key_value": None,
             "past_key_values": None, "layer_past": None}


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


class Draws:
    """The generators that replicas sharing them draw from, and whether a checkpointed
    block's forward has drawn from them in this call (then every replica's forward holds
    ``SHARED``, so a recompute's setting of their state never meets another's draws)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        # The CPU generator always (torch's checkpoint replays it for any block), and each
        # shared GPU's.
        self.generators = list(dict.fromkeys(
            [torch.default_generator] + [generator(d) for d in devices if d.type != "cpu"]))
        self.drawn = False


class _Replayed:
    """One checkpointed call of a block on replicas that share generators: the forward
    records their states where it draws; each recompute runs from those states, holding
    ``SHARED``, and gives the generators back as it found them."""

    def __init__(self, forward: Any, draws: Draws) -> None:
        self.forward, self.draws = forward, draws
        self.states: list[torch.Tensor] | None = None  # before the forward, if it drew
        self.ran = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        generators = self.draws.generators
        if not self.ran:  # the forward
            self.ran = True
            before = [g.get_state() for g in generators]
            out = self.forward(*args, **kwargs)
            if any(not torch.equal(b, g.get_state()) for b, g in zip(before, generators)):
                self.states = before
                self.draws.drawn = True
            return out
        if self.states is None:  # drew nothing: nothing to replay
            return self.forward(*args, **kwargs)
        with SHARED:
            kept = [g.get_state() for g in generators]
            for g, state in zip(generators, self.states):
                g.set_state(state)
            try:
                return self.forward(*args, **kwargs)
            finally:
                for g, state in zip(generators, kept):
                    g.set_state(state)


class Checkpointed:
    """A block's ``forward`` under non-reentrant ``torch.utils.checkpoint`` while gradients
    are on (in evaluation and predict it is the plain forward: nothing is kept anyway).

    Args:
        forward: the block's own forward (bound).
        draws: the shared generators (replicas that share them), or None: torch's own
            replay of the generators (``preserve_rng_state``).
        keeps_cache: the block only reads a cache (transformers' ``_can_checkpoint_with_
            cache``): only ``use_cache`` is turned off.
    """

    def __init__(self, forward: Any, draws: Draws | None = None,
                 keeps_cache: bool = False) -> None:
        self.forward, self.draws = forward, draws
        try:
            params = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):  # no signature to read (a builtin)
            params = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        at = {p.name: i for i, p in enumerate(params) if p.kind in positional}
        takes = {p.name for p in params} | (set(_NO_CACHE) if any(  # (**kwargs takes any)
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params) else set())
        # Each cache argument the forward takes: (name, position or None, what a checkpointed
        # call passes); read once here, so a block without one pays nothing per call.
        self.no_cache = [(name, at.get(name), off) for name, off in _NO_CACHE.items()
                         if name in takes and not (keeps_cache and name != "use_cache")]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        for name, i, off in self.no_cache:
            if name in kwargs:
                kwargs[name] = off
            elif i is not None and i < len(args):
                args = args[:i] + (off,) + args[i + 1:]
        if self.draws is None:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(_Replayed(self.forward, self.draws), *args, use_reentrant=False,
                          preserve_rng_state=False, **kwargs)


class _Holding:
    """A replica's forward that holds ``SHARED`` once a checkpointed block has drawn (its
    draws then never meet another replica's recompute; forwards run in turn anyway)."""

    def __init__(self, forward: Any, draws: Draws) -> None:
        self.forward, self.draws = forward, draws

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.draws.drawn and torch.is_grad_enabled()):  # (evaluation: no recompute)
            return self.forward(*args, **kwargs)
        with SHARED:
            return self.forward(*args, **kwargs)


class ActivationCheckpointing:
    """Installs ``Checkpointed`` forwards on every block of ``classes`` in the replicas of
    one call, and puts the blocks' forwards back at its end. Replicas that share a
    generator (several on one device) replay their blocks' draws through ``Draws``, and
    their forwards are ``_Holding`` (see the module docstring).

    Args:
        classes: the block classes (``check_blocks``).
        modules: every replica's module (of every bucket).
        devices: the replicas' devices.
    """

    def __init__(self, classes: Sequence[type[nn.Module]], modules: Sequence[nn.Module],
                 devices: Sequence[torch.device]) -> None:
        shared = len(set(devices)) < len(devices)
        draws = Draws(devices) if shared and classes else None
        self.saved: list[tuple[nn.Module, Any]] = []
        for root in dict.fromkeys(modules) if classes else ():
            for block in dict.fromkeys(m for m in root.modules() if isinstance(
                    m, tuple(classes))):
                keeps = getattr(block, "_can_checkpoint_with_cache", False) is True
                self._install(block, Checkpointed, draws, keeps)
            if draws is not None:
                self._install(root, _Holding, draws)

    def _install(self, module: nn.Module, wrapper: Any, *args: Any) -> None:
        """``module.forward`` replaced by ``wrapper(forward, *args)`` of it (the one set on
        the instance, or the class's), the old one kept for ``remove``."""
        own = module.__dict__.get("forward")  # a forward set on the instance, kept
        self.saved.append((module, own))
        module.forward = wrapper(own if own is not None else functools.partial(
            type(module).forward, module), *args)

    def remove(self) -> None:
        """Every forward as it was (the last replaced first: a root that is also a block
        was replaced twice)."""
        for module, own in reversed(self.saved):
            if own is None:
                del module.__dict__["forward"]
            else:
                module.forward = own  # type: ignore[method-assign]
        self.saved = []
