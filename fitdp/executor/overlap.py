"""The cross-rank all-reduce of a rank with several CPU replicas, overlapped with backward.

A rank that drives several local devices (the hybrid case, which DDP cannot wrap) sums its
replicas' gradients into device 0's flat buckets (``FlatBuckets``) and then all-reduces each
bucket across the ranks. Without overlap every all-reduce waits for the end of backward
(``FlatBuckets.reduce_global``). ``BucketOverlap`` starts them during backward, as DDP's
reducer does: a post-accumulate-grad hook on every replica's trainable parameters counts, per
device and bucket, the gradients backward has finished; once every device has finished
bucket ``b``'s, the bucket is summed over the devices into device 0's (the same additions, in
the same order, as ``Update.reduce_shard``) and its ``dist.all_reduce(async_op=True)``
starts, while backward goes on with earlier layers. The optimizer step waits for every work
(``finish``): the numbers are bit for bit those of the reduction after backward.

Ranks match gloo's collectives by the order they are issued in, so every launch is issued
from one thread, the one that armed the step (the caller, which also runs device 0's
backward: CPU autograd runs on the thread that calls ``backward``), in a fixed order: the
last bucket first (backward reaches the last layers first), and a bucket ready early waits
for the ones before it in that order. Hooks on the other device threads only count. What
backward has not launched by its end (a bucket whose last gradient came from another thread
after device 0's backward ended, a parameter no backward reached, an empty share) is
launched by ``finish``, in the same order. Armed only on a batch that steps (``arm``):
accumulating batches count nothing and reduce nothing, as before.

Costs: no memory (the all-reduces work in place on device 0's buckets, which exist anyway),
one Python hook call per parameter and device per backward (a few microseconds each), and
the local sum of a bucket moves from after backward into device 0's backward.
"""

from __future__ import annotations

import atexit
import functools
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from fitdp.executor.flat_buckets import FlatBuckets, add_into

# Whether a rank with several CPU replicas overlaps its all-reduce with backward (bench and
# tests turn it off to measure and compare the reduction after backward).
OVERLAP = True


class BucketOverlap:
    """Device 0's gradient buckets all-reduced across ranks as backward finishes each one.

    Called as a manager's ``cross_rank`` (``Update.reduce_shard``) outside an armed step, it
    all-reduces every bucket after backward, as ``FlatBuckets.reduce_global``.

    Args:
        flat: the rank's flat buckets, with gradient buckets (``grads=True``), CPU devices.
    """

    def __init__(self, flat: FlatBuckets) -> None:
        self.flat = flat
        buckets = len(flat.plan)
        self.order = list(range(buckets))[::-1]  # fixed on every rank: see the module doc
        self.sizes = [len(ks) for ks in flat.plan]
        # Per device, per bucket: gradients backward has yet to finish (each row is written
        # by one device's thread only: no lock).
        self.left = [list(self.sizes) for _ in flat.params]
        self.pairs = [(flat.grad_flat[0][b], [g[b] for g in flat.grad_flat[1:]])
                      for b in range(buckets)]
        self.armed = False
        self.owner = 0  # the thread that armed the step: the only one that launches
        self.next = 0  # position in ``order`` of the next bucket to launch
        self.works: list[dist.Work] = []
        self.early = 0  # buckets launched during backward, all steps (tests, bench)
        bucket_of = {k: b for b, ks in enumerate(flat.plan) for k in ks}
        for d, ps in enumerate(flat.params):  # (the replicas' parameters keep the hooks)
            for k, p in enumerate(ps):
                p.register_post_accumulate_grad_hook(
                    functools.partial(self._on_grad, d, bucket_of[k]))
        # Async works still running when the process exits can abort it in gloo's threads:
        # wait for them first (registered after the join's exit hook, so it runs before).
        atexit.register(_drain_ref, weakref.ref(self))

    def __call__(self) -> None:
        """Every bucket all-reduced now (the reduction after backward; not armed)."""
        self.flat.reduce_global()

    def arm(self, stepping: bool) -> None:
        """The next batch's backward launches its buckets' all-reduces (``stepping``: it ends
        with the optimizer step) or launches none (it accumulates)."""
        if self.works:  # a step that failed after launching: its works end first
            self.drain()
        self.next = 0
        if stepping:
            for row in self.left:
                row[:] = self.sizes
            self.owner = threading.get_ident()
        self.armed = stepping

    def _on_grad(self, d: int, b: int, _param: torch.Tensor) -> None:
        """Device ``d``'s gradient of a parameter of bucket ``b`` is final for this step."""
        if not self.armed:
            return
        self.left[d][b] -= 1
        if threading.get_ident() == self.owner:
            self._launch_ready()

    def _launch_ready(self) -> None:
        order, left = self.order, self.left
        while self.next < len(order) and all(row[order[self.next]] == 0 for row in left):
            self._launch(order[self.next])
            self.early += 1

    def _launch(self, b: int) -> None:
        acc, others = self.pairs[b]
        add_into(acc, others)
        self.works.append(dist.all_reduce(acc, async_op=True))
        self.next += 1

    def finish(self) -> None:
        """After backward (on the arming thread): the buckets not launched yet, in order, then
        every work waited for. A peer that left shows as the collective error it is."""
        self.armed = False
        while self.next < len(self.order):
            self._launch(self.order[self.next])
        works, self.works = self.works, []
        for i, work in enumerate(works):
            try:
                work.wait()
            except RuntimeError as err:  # gloo's "Connection closed by peer" and the like
                self.drain(works[i + 1:])
                # As a torch.distributed error: the failing-rank protocol tells a peer's
                # failure from this rank's own by it (``Ranks.report_failure``).
                raise dist.DistBackendError(str(err)) from err

    def drain(self, works: Sequence[dist.Work] | None = None) -> None:
        """Wait for every launched work, ignoring its error (that step has failed already)."""
        works, self.works = (self.works if works is None else works), []
        for work in works:
            try:
                work.wait()
            except RuntimeError:
                pass  # the step's own error was raised; this one repeats it


def _drain_ref(ref: weakref.ref[BucketOverlap]) -> None:
    overlap = ref()
    if overlap is not None and overlap.works:
        overlap.drain()


def cross_rank(flat: FlatBuckets | None, devices: Sequence[torch.device], distributed: bool,
               custom: bool) -> Callable[[], None] | None:
    """The manager's cross-rank gradient sum: a ``BucketOverlap`` for several CPU replicas
    (not for a custom step, whose replicas may run collectives of their own mid-step), the
    reduction after backward otherwise (GPUs: stream ordering is not built), None for one
    process."""
    if not distributed or flat is None:
        return None
    if OVERLAP and not custom and len(devices) > 1 and all(d.type == "cpu" for d in devices):
        return BucketOverlap(flat)
    return flat.reduce_global
