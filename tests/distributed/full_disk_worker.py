"""2 ranks save one sharded checkpoint; rank 1's writes fail as on a full disk (a file size
limit: the kernel refuses the write, errno EFBIG). Each rank prints what it caught, then
has its file size limit back."""

from __future__ import annotations

import resource
import signal
import sys

import torch
import torch.distributed as dist

from fitdp.executor import sharded_io

owned = not dist.is_initialized()  # in tests/conftest.py's shared job it may be made
if owned:
    dist.init_process_group("gloo")
rank = dist.get_rank()
limit = resource.getrlimit(resource.RLIMIT_FSIZE)
if rank == 1:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the rank
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
try:
    sharded_io.save(sys.argv[1], 3, {f"w{rank}": torch.ones(100_000)})
    print(f"rank {rank} saved", flush=True)
except BaseException as exc:  # noqa: BLE001 - the test reads what each rank caught
    print(f"rank {rank} caught {type(exc).__name__} errno={getattr(exc, 'errno', None)} "
          f"{exc}", flush=True)
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)  # the next script of a shared job writes
if owned:
    dist.destroy_process_group()
