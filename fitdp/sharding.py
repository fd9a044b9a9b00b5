"""Round-robin sharding of batch sources over the ranks of a torch.distributed job."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from fitdp.batch import DataBatch, tree_map


class ShardedSource:
    """Round-robin the batches of any source over ranks: rank r trains batches r, r+W, ...

    Every rank runs ``ceil(batches / W)`` steps; a rank with no batch left in the last step
    gets an empty one, so no rank waits in a collective for a peer that has stopped.
    """

    def __init__(self, source: Any, rank: int, world_size: int) -> None:
        self.source = source
        self.rank, self.world_size = rank, world_size
        self.num_samples = getattr(source, "num_samples", None)
        self.steps_done = 0
        try:
            self.steps = -(-len(source) // world_size)
        except TypeError:
            raise ValueError(
                f"data: under torch.distributed fitdp must know how many batches each rank "
                f"gets, but {type(source).__name__} has no len(). Fix: pass a DataLoader, a "
                f"Dataset, tensors or a BucketIterator."
            ) from None

    def __len__(self) -> int:
        return self.steps

    def __getattr__(self, name: str) -> Any:  # default_bucket_key, provide_data, ...
        return getattr(self.source, name)

    def set_epoch(self, epoch: int) -> None:
        if epoch != getattr(self.source, "epoch", epoch):
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
        self.steps_done = 0

    def state_dict(self) -> dict[str, Any]:
        # Every rank resumes at the start of the round it was in, whichever rank saved.
        return {**self.source.state_dict(), "position": self.steps_done * self.world_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.source.load_state_dict(state)
        self.steps_done = state["position"] // self.world_size
