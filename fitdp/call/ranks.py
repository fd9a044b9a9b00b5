"""Running as one rank of a ``torch.distributed`` job under ``torchrun``: ``Ranks``, the one
object above the executor that talks to the other ranks (as Lightning Fabric's strategy).

torchrun's rendezvous plays Caffe2's ``rendezvous``: it sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the master address, and fitdp joins the default process group from them
(gloo on the CPU, NCCL on CUDA). fitdp never invents a transport of its own. Every
collective the layers above the executor run (join, broadcast of the initial weights, loss
sums, predict's rows, the even-data check, barriers, the failing-rank report) is a method
here; the executor runs its gradient collectives itself.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("fitdp")

DEFAULT_TIMEOUT = 600.0  # seconds a collective may wait before every rank gives up
_Row = TypeVar("_Row")


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in the job (rank 0 of 1 when not under torchrun) and the
    collectives fitdp runs across ranks. Reading the place joins nothing: ``join`` does, once
    per process, when a call attaches its replicas.

    Example:
        >>> ranks = Ranks()
        >>> ranks.enabled, ranks.is_main, ranks.all_reduce_sum(torch.ones(2)).tolist()
        (False, True, [1.0, 1.0])
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Ranks:
        """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` as torchrun sets them (joins nothing)."""
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                   int(env.get("LOCAL_RANK", 0)))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def join(self, devices: Sequence[torch.device], timeout: float) -> None:
        """Join the default process group (once per process) with ``timeout`` on collectives.

        Raises:
            ValueError: a non-positive timeout, or a process group of another world size.
        """
        if not timeout > 0:
            raise ValueError(f"timeout: got {timeout}; expected a positive number of seconds")
        global _failed
        if not self.enabled:
            return
        # A call starts on this rank: an earlier call's failure, which the user caught and
        # carried on from, no longer makes this rank leave at exit without its peers.
        _failed = False
        cuda = all(d.type == "cuda" for d in devices)
        if cuda:
            # Also for a group the user initialized: NCCL's object collectives (check_even,
            # gather_rows) run on the current device, which is cuda:0 on every rank until
            # set. devices[0] is cuda:LOCAL_RANK under devices="auto", and the device fitdp's
            # own collectives use (broadcast_module).
            torch.cuda.set_device(devices[0])
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise ValueError(
                    f"WORLD_SIZE is {self.world_size} but the initialized process group has "
                    f"{dist.get_world_size()} ranks; launch with torchrun and let fitdp join"
                )
            return
        backend = "nccl" if cuda else "gloo"
        limit = datetime.timedelta(seconds=timeout)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one store across restarts: without a per-attempt prefix
            # a restarted rank can read the dead ranks' addresses and fail to connect.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 self.world_size, is_master=False, timeout=limit)
            store = dist.PrefixStore(f"fitdp/attempt_{attempt}", base)
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=self.world_size, timeout=limit)
        else:
            dist.init_process_group(backend, timeout=limit)
        atexit.register(_leave)
        log.debug("fitdp: rank %d of %d joined (%s)", self.rank, self.world_size,
                  dist.get_backend())

    def broadcast_module(self, module: nn.Module, device: torch.device) -> None:
        """Copy rank 0's parameters and buffers into every rank (the initial weights),
        through ``device`` (NCCL moves CUDA tensors only: host tensors go through the first
        device). One process: nothing to do."""
        if not self.enabled:
            return
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                staged = t.detach().to(device)
                dist.broadcast(staged, 0)
                if staged is not t:
                    t.copy_(staged)

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum ``values`` over ranks (in place; returned for chaining)."""
        if self.enabled:
            dist.all_reduce(values)
        return values

    def vote(self, flag: bool) -> tuple[Any, torch.Tensor]:
        """Start the all-reduce (max) of ``flag`` over the ranks and return at once; read
        the answer with ``tally`` (every rank gets the same). One number, on the host under
        gloo."""
        cuda = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
        value = torch.tensor([int(flag)], device="cuda" if cuda else "cpu")
        return dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True), value

    @staticmethod
    def tally(vote: tuple[Any, torch.Tensor]) -> bool:
        """Whether any rank voted yes in ``vote`` (waits for it to complete)."""
        work, value = vote
        work.wait()
        return bool(value.item())

    def check_even(self, name: str, counts: dict[str, int | None]) -> None:
        """Every rank must see the same amount of data, or the ranks fall out of step in a
        collective (gloo aborts with "Received data size doesn't match"), or one finishes
        early. Checked before the first step, on every rank alike.

        Raises:
            ValueError: on every rank, naming each rank's counts.
        """
        if not self.enabled:
            return
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, counts)
        if all(p == parts[0] for p in parts):
            return
        seen = "; ".join(f"rank {r}: " + ", ".join(f"{v} {k}" for k, v in p.items())
                         for r, p in enumerate(parts))
        raise ValueError(
            f"{name}: the ranks see different amounts of data ({seen}); expected the same on "
            f"every rank. Fix: pass the same, whole data set on every rank (fitdp gives each "
            f"rank its shard), or make every rank's loader yield as many batches."
        )

    def gather_rows(self, keyed: list[_Row]) -> list[_Row]:
        """Every rank's keyed rows, on every rank, in rank order (used by predict)."""
        if not self.enabled:
            return list(keyed)
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, keyed)
        return [item for part in parts for item in part]

    @staticmethod
    def gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``tensor`` (dim 0), in rank order, on every rank, with
        torch's differentiable ``all_gather`` (``fitdp.all_gather`` across ranks); ranks with
        fewer rows are padded, then cut back."""
        import torch.distributed.nn.functional as dist_nn  # torch's differentiable collectives

        world = dist.get_world_size()
        rows = torch.tensor([tensor.shape[0]], device=tensor.device)
        counts = [torch.zeros_like(rows) for _ in range(world)]
        dist.all_gather(counts, rows)
        sizes = [int(c) for c in counts]
        most = max(sizes)
        if tensor.shape[0] < most:
            pad = tensor.new_zeros((most - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        parts = dist_nn.all_gather(tensor)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    def barrier(self) -> None:
        """Wait until every rank has arrived (one process: returns at once)."""
        if self.enabled:
            dist.barrier()

    def report_failure(self, err: BaseException) -> None:
        """Name the failing rank and its traceback on stderr and in torchrun's error file, so
        the launcher's summary shows the root cause (the other ranks then fail in a
        collective); this rank then leaves without waiting for its peers at exit."""
        global _failed
        if not self.enabled:
            return
        _failed = True
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        why = ""
        if _in_collective(err):
            # Most likely a peer failed first and this collective failed because it left.
            # torchrun names the failure with the earliest timestamp (whole seconds; a tie
            # goes to the rank it noticed first), so this rank waits: the launcher sees the
            # raising rank exit first, and this rank's error is stamped later. Costs
            # PEER_GRACE seconds, only on a job that is failing anyway.
            time.sleep(PEER_GRACE)
            why = " in a collective (a peer probably failed first: see its error)"
        print(f"fitdp: rank {self.rank} (local {self.local_rank}) failed{why}:\n{text}",
              file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and isinstance(err, Exception):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(err)


_failed = False
PEER_GRACE = 2.0  # seconds; over 1 s, so a later whole-second timestamp than the raiser's
_DIST_DIR = os.path.dirname(dist.__file__)


def _in_collective(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) came out of a torch.distributed call:
    a peer that left or stalled, rather than this rank's own failure."""
    seen: BaseException | None = err
    while seen is not None:
        frames = traceback.extract_tb(seen.__traceback__)
        if isinstance(seen, dist.DistError) or (frames and frames[-1].filename.startswith(
                _DIST_DIR)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _leave() -> None:
    """At exit: leave the process group together with the other ranks.

    A rank that tears gloo down while a peer still talks to it can abort (SIGABRT) during
    interpreter shutdown, so healthy ranks meet in a barrier first. A rank that failed skips
    it: its peers are stuck elsewhere, and the launcher must see it exit at once.
    """
    if not dist.is_initialized():
        return
    if not _failed and getattr(sys, "last_value", None) is None:
        try:
            dist.barrier()
        except RuntimeError:
            pass  # a peer is gone; nothing left to wait for
    dist.destroy_process_group()
    gc.collect()  # free the group's C++ objects while the interpreter is still whole
