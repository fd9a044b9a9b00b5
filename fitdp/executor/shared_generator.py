"""The generator a replica draws from, and the lock held by whoever sets a generator that
replicas share to another state for a while.

Every CPU replica draws from torch's one CPU generator (replicas on one GPU from that GPU's).
Code that sets it to a state of its own, draws and puts it back (the reproducible step's
seeded forward, a checkpointed block's recompute in backward) holds ``SHARED`` meanwhile, so
no other replica's thread draws from the state it set or loses its draws to the put-back.
"""

from __future__ import annotations

import threading

import torch

# Re-entrant: a seeded forward (held) runs checkpointed blocks that take it again.
SHARED = threading.RLock()


def generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (CPU, or the CUDA device's).

    Example:
        >>> generator(torch.device("cpu")) is torch.default_generator
        True
    """
    if device.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[device.index or 0]
