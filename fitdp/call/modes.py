"""The train/eval mode of every submodule: what each pass of a call runs in, and what the
user's module is given back.

A call records each submodule's ``training`` flag when it starts. A pass that needs the mode
the module already had then (training for a freshly built module) runs every submodule in
the mode it had: a teacher the user put in eval stays in eval, in every epoch, after every
validation pass. A pass that needs the other mode switches the way the user's own
``module.train(mode)`` or ``module.eval()`` would: every submodule, through the module's own
``train`` (so an override that keeps a layer frozen still does). The call ends with every
submodule in the mode it had at the start. Replicas on other devices get the same modes,
by submodule name.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fitdp.call.host import walk


class Modes:
    """Each submodule's mode when a call starts (see the module docstring).

    Args:
        module: the user's module.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5).eval())
        >>> modes = Modes(net)
        >>> modes.apply([net], training=False); [m.training for m in net]
        [False, False]
        >>> modes.apply([net], training=True); [m.training for m in net]
        [True, False]
    """

    def __init__(self, module: nn.Module,
                 named: Iterable[tuple[str, nn.Module]] | None = None) -> None:
        named = walk(module) if named is None else named  # (read already)
        self.flags = {name: m.training for name, m in named}

    def apply(self, modules: Iterable[nn.Module], training: bool) -> None:
        """Put each of ``modules`` (the replicas) in the modes a ``training`` pass runs in."""
        as_found = self.flags[""] is training
        for module in modules:
            if as_found:
                self.restore(module)
            else:
                module.train(training)

    def restore(self, module: nn.Module,
                named: Iterable[tuple[str, nn.Module]] | None = None) -> None:
        """Give every submodule of ``module`` (``named``: its ``named_modules()``, when read
        already) that the call started with its mode back."""
        flags = self.flags
        for name, m in walk(module) if named is None else named:
            flag = flags.get(name)
            if flag is not None and m.training is not flag:
                m.training = flag
