"""Data sources: every form ``fit``/``evaluate``/``predict`` accept, behind one interface.

Example:
    >>> import torch
    >>> from fitdp.data.sources import make_source
    >>> src = make_source(torch.zeros(10, 3), torch.zeros(10), batch_size=4, shuffle=False, seed=0)
    >>> src.num_batches, src.plan().rows_per_step
    (3, 4)
"""

from fitdp.data.sources.make import make_source
from fitdp.data.sources.protocol import DataSource, SourcePlan

__all__ = ["DataSource", "SourcePlan", "make_source"]
