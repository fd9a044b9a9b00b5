"""Round-robin sharding of batch sources over the ranks of a torch.distributed job."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fitdp.checks import fail
from fitdp.data.batch import DataBatch, tree_map
from fitdp.data.sources.protocol import DataSource, SourcePlan


class ShardedSource:
    """Round-robin the batches of any source over ranks: rank r trains batches r, r+W, ...

    Every rank runs ``ceil(batches / W)`` steps; a rank with no batch left in the last step
    gets an empty one, so no rank waits in a collective for a peer that has stopped.

    Raises:
        ValueError: the source does not know its number of batches.

    Example:
        >>> from fitdp.data.sources.loaders import LoaderSource
        >>> import torch
        >>> src = LoaderSource([(torch.zeros(2, 1), torch.zeros(2))] * 3)
        >>> ShardedSource(src, rank=1, world_size=2).num_batches
        2
    """

    def __init__(self, source: DataSource, rank: int, world_size: int) -> None:
        self.source = source
        self.rank, self.world_size = rank, world_size
        self.steps_done = 0
        batches = source.num_batches
        if batches is None:
            fail("x", _users_data(source), "data whose number of batches is known under "
                 "torch.distributed (each rank must run as many steps as the others)",
                 "give the dataset a __len__, or pass a DataLoader, a Dataset, tensors or a "
                 "BucketIterator (a generator has no length)", error=ValueError,
                 described=True)
        self.steps = -(-batches // world_size)

    @property
    def num_batches(self) -> int:
        return self.steps

    def plan(self) -> SourcePlan:
        return self.source.plan()

    @property
    def count_tokens(self) -> Callable[[DataBatch], int] | None:
        """The wrapped source's token count of a batch, if it has one (throughput)."""
        return getattr(self.source, "count_tokens", None)

    def set_epoch(self, epoch: int) -> None:
        self.steps_done = 0
        self.source.set_epoch(epoch)

    def __iter__(self) -> Iterator[DataBatch]:
        template = None
        for i, batch in enumerate(self.source):
            template = template or batch
            if i % self.world_size == self.rank:
                self.steps_done += 1
                yield batch
        if template is not None:
            empty = DataBatch(tree_map(lambda t: t[:0], template.data),
                              tree_map(lambda t: t[:0], template.label))
            while self.steps_done < self.steps:
                self.steps_done += 1
                yield empty

    def state_dict(self) -> dict[str, Any]:
        # Every rank resumes at the start of the round it was in, whichever rank saved.
        return {**self.source.state_dict(), "position": self.steps_done * self.world_size}

    def check_resume(self, state: Any, *, continues: bool) -> str | None:
        check = getattr(self.source, "check_resume", None)
        if check is None:
            return None
        at = state.get("position") if isinstance(state, Mapping) else None
        if isinstance(at, int) and at <= self.steps * self.world_size:
            # the last round's empty batches are no batches of the source
            state = {**state, "position": min(at, self.source.num_batches or at)}
        return check(state, continues=continues)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.source.load_state_dict(state)
        self.steps_done = int(state["position"]) // self.world_size


def _users_data(source: DataSource) -> str:
    """What the user passed, in their words (the source that wraps it is fitdp's)."""
    stream = getattr(source, "stream", None)
    if stream is not None:
        return f"an IterableDataset ({type(stream).__name__}) without __len__"
    loader = getattr(source, "loader", None)
    return f"a {type(loader if loader is not None else source).__name__} without __len__"
