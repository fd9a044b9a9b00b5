"""The replicas a call runs on: an executor manager for one placement, with the optimizer
bound to its parameters and one clone of every metric per device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch import nn

from fitdp.call.custom_step import CustomStep
from fitdp.call.host import HostTree
from fitdp.call.ranks import Ranks
from fitdp.checks import fail
from fitdp.compiled.metrics import DeviceMetrics
from fitdp.compiled.optimizers import bind_optimizer
from fitdp.compiled.setup import Compiled
from fitdp.data.sources import SourcePlan
from fitdp.executor.engines import engine_for
from fitdp.executor.manager import DataParallelExecutorManager
from fitdp.saving.fence import wait_for_snapshots


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a call runs, resolved once per call and passed down.

    Attributes:
        devices: one torch.device per replica.
        work_load_list: each device's share of a batch.
        ranks: this process's place in a torch.distributed job, and its collectives.
        default_bucket_key: the bucket the default executor group runs (None: whichever the
            current replicas have, or no bucketing).
    """

    devices: tuple[torch.device, ...]
    work_load_list: tuple[float, ...]
    ranks: Ranks = Ranks()
    default_bucket_key: Hashable | None = None

    @property
    def distributed(self) -> bool:
        """This process is one rank of a torch.distributed job of several."""
        return self.ranks.enabled


class Replicas:
    """The executor manager for a ``Placement`` and a ``Compiled`` (or none: predict without
    compile), with per-device metric clones.

    Args:
        module: the host module (copied to the devices; with one device already holding
            it, the replica is the module itself).
        bucket_module: ``callable(bucket_key) -> nn.Module`` (MXNet's ``sym_gen``) or None.
        placement: devices, work loads, ranks, default bucket.
        compiled: the compiled setup, or None.
        step: a model subclass's own step (``CustomStep``), or None: the built-in step.

    Raises:
        ValueError: 16-mixed on devices that are not all CUDA; sync_batchnorm off CUDA; a
            ``strategy`` that cannot run on this placement.
    """

    def __init__(self, module: nn.Module, bucket_module: Callable[[Any], nn.Module] | None,
                 placement: Placement, compiled: Compiled | None,
                 step: CustomStep | None = None) -> None:
        autocast = compiled.autocast_dtype if compiled is not None else None
        devices = list(placement.devices)
        # The call's engine, chosen once (a strategy that cannot run here fails before any
        # copy); predict without compile: the manager's default, fitdp's own.
        engine = engine_for(compiled.config.strategy, devices, placement.ranks.world_size,
                            bucketed=bucket_module is not None,
                            compiled=bool(compiled.config.compile),
                            custom_step=step is not None,
                            scaled=autocast is torch.float16) if compiled else None
        if autocast is torch.float16 and any(d.type != "cuda" for d in devices):
            fail("compile(precision='16-mixed')", [str(d) for d in devices],
                 "CUDA devices only (it uses a CUDA GradScaler)",
                 "precision='bf16-mixed' on the CPU, or run on CUDA devices")
        if placement.distributed and compiled is not None and compiled.config.sync_batchnorm:
            _convert_sync_batchnorm(module, devices)
        self.placement = placement
        self.compiled = compiled
        # Metrics first: a metric that cannot be merged across devices fails before any
        # thread is started.
        self.metrics = DeviceMetrics(compiled.metrics, devices) if compiled and compiled.metrics \
            else None
        self.manager = DataParallelExecutorManager(
            module, devices, work_load_list=list(placement.work_load_list),
            bucket_module=bucket_module, default_bucket_key=placement.default_bucket_key,
            loss=compiled.objective if compiled is not None else None,
            compile=compiled.config.compile if compiled is not None else False,
            autocast_dtype=autocast, distributed=placement.distributed, compute=step,
            engine=engine,
            forward_kwargs=compiled.forward_kwargs if compiled is not None else None,
        )
        self.engine = self.manager.engine
        self.step = step
        if step is not None:
            step.bind(self.manager, compiled)
        if autocast is torch.float16 and compiled is not None and compiled.scaler is None:
            compiled.scaler = torch.amp.GradScaler("cuda")
            # The scaler makes its scale tensor on first use: here, in one thread, not in
            # the device threads that scale their losses at once.
            compiled.scaler.scale(torch.zeros((), device=devices[0]))

    def fits(self, params: Mapping[str, torch.Tensor], placement: Placement,
             compiled: Compiled | None) -> bool:
        """Whether this call can run on these replicas as they are (same placement and
        compile, and no parameter of the host module, ``params`` its named parameters,
        frozen or unfrozen since they were made: gradients exist only for the trainable
        ones)."""
        here = self.placement
        same_bucket = placement.default_bucket_key is None or (
            placement.default_bucket_key == here.default_bucket_key)
        return (placement.devices == here.devices
                and placement.work_load_list == here.work_load_list
                and placement.ranks == here.ranks and same_bucket
                and (compiled is self.compiled or compiled is None)
                and [p.requires_grad for p in params.values()] == self.manager.trainable)

    def prepare(self, plan: SourcePlan) -> None:
        """Before the first step: input buffers for the largest batch, and every bucket's
        executor group (a ``bucket_module`` that cannot share a parameter fails now); with
        compile, the caller's dynamo/inductor settings as they are now, for the replica
        threads (thread-local, see ``fitdp.executor.compile_config``)."""
        if self.manager.compile_config is not None:
            self.manager.compile_config.capture()
        if plan.inputs:
            self.manager.reserve(list(plan.inputs))
        self.manager.prepare_buckets(plan.bucket_keys)

    def load_host(self, module: nn.Module, tree: HostTree | None = None) -> None:
        """Copy the host module's weights into every replica (rank 0's under torchrun);
        ``tree``: the module as the caller has just read it."""
        wait_for_snapshots()  # an async save may be copying a replica (the module itself)
        self.placement.ranks.broadcast_module(module, self.placement.devices[0])
        tree = HostTree.read(module) if tree is None else tree
        self.manager.set_params(tree.params, tree.buffers)
        self.engine.stored()

    def store_host(self, module: nn.Module, tree: HostTree | None = None) -> None:
        """Average the replicas into the host module, in place (exact when they agree).

        Sharded weights (FSDP2) are gathered into whole tensors, a collective that every
        rank joins (``fit`` and ``evaluate`` end with it, ``ModelCheckpoint``/
        ``BackupAndRestore`` call it on every rank), skipped while the engine says the host
        holds them already, so that rank 0 alone can then read the weights
        (``get_weights``, ``save``, ``export``). ``tree``: the module as the caller has
        just read it."""
        wait_for_snapshots()  # an async save may be copying the host module
        tree = HostTree.read(module) if tree is None else tree
        params = {} if self.engine.host_current() else tree.params
        self.manager.copy_to(params, tree.buffers)  # (buffers: never sharded)
        self.engine.stored()

    def sharded_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """FSDP2: ``module``'s state with each parameter as this rank's shard (its sharded
        tensor, no gather) and the buffers copied from the replica into ``module`` (not sharded)."""
        wait_for_snapshots()  # an async save may be copying the host buffers
        self.manager.copy_to({}, dict(module.named_buffers()))
        shards = self.manager.named_master_parameters()
        return {k: shards.get(k, v) for k, v in module.state_dict().items()}

    @property
    def shards_weights(self) -> bool:
        """Each rank holds a shard of every parameter (FSDP2)."""
        return self.engine.shards_weights

    def bind(self, optimizer: torch.optim.Optimizer, module: nn.Module, *, to_host: bool
             ) -> None:
        """Carry ``optimizer`` between the host module's parameters and device 0's (with its
        state as the engine holds it: FSDP2's gathered to whole tensors on the host, on
        every rank, or sharded)."""
        host = dict(module.named_parameters())
        replica = self.manager.named_master_parameters()
        src, dst = (replica, host) if to_host else (host, replica)
        bind_optimizer(optimizer, {id(src[n]): dst[n] for n in src if n in dst})
        self.engine.carry_optimizer(optimizer, to_host)

    def share_optimizer(self) -> None:
        """Every rank, where rank 0 alone may save next: the optimizer state that the engine
        holds in parts gathered for that save (a collective where it does: ZeRO-1)."""
        compiled = self.compiled
        if compiled is not None and compiled.optimizer is not None:
            self.engine.share_optimizer(compiled.optimizer)

    def own_buffers(self) -> dict[str, list[torch.Tensor]] | None:
        """The buffers whose replicas differ (BatchNorm statistics between epoch ends: each
        replica updates its own from its slice; its ``num_batches_tracked`` too, which a
        replica given an empty slice does not count), one copy per replica; None when
        they all agree. Under torchrun every buffer: each rank's replicas update theirs from
        the rank's own batches (the session keeps every rank's, ``Session.buffers``). A
        checkpoint keeps them so that a resume in the middle of an epoch continues bit for
        bit (the saved module holds their average). Costs a comparison per buffer at each
        save."""
        mgr = self.manager
        every = mgr.distributed
        own = {name: [t.detach().clone() for t in block]
               for name, block in zip(mgr.aux_names, mgr.aux_arrays)
               if every or (len(block) > 1
                            and any(not torch.equal(block[0], t) for t in block[1:]))}
        return own or None

    def load_own_buffers(self, own: dict[str, list[torch.Tensor]]) -> None:
        """Put ``own_buffers`` back, each replica's own; with another replica count the
        replicas keep the saved average (what they can share)."""
        mgr = self.manager
        arrays = dict(zip(mgr.aux_names, mgr.aux_arrays))
        with torch.no_grad():
            for name, values in own.items():
                block = arrays.get(name)
                if block is not None and len(block) == len(values):
                    for dst, src in zip(block, values):
                        dst.copy_(src)

    def modules(self) -> list[nn.Module]:
        """Every replica of every bucket (the modules whose train/eval modes a pass sets)."""
        return [ex.module for group in self.manager.groups.values() for ex in group.executors]

    def close(self) -> None:
        self.manager.close()


def _convert_sync_batchnorm(module: nn.Module, devices: list[torch.device]) -> None:
    """Caffe2's ``combine_spatial_bn``: BatchNorm statistics over every rank's batch."""
    if len(devices) > 1:
        # Each replica thread would issue SyncBatchNorm's all_gather on the one process group
        # at once (collective order may then differ between ranks: a hang), and the
        # statistics would cover one thread's slice per rank.
        fail("compile(sync_batchnorm=True)", f"devices={[str(d) for d in devices]} on each "
             "rank under torchrun", "one device per rank",
             "launch one process per device (torchrun --nproc-per-node), or drop "
             "sync_batchnorm (BatchNorm running statistics are then averaged over devices and "
             "ranks at epoch ends)", described=True)
    if any(d.type != "cuda" for d in devices):
        fail("compile(sync_batchnorm=True)", [str(d) for d in devices],
             "CUDA devices (torch's SyncBatchNorm runs on CUDA only)",
             "drop sync_batchnorm on the CPU (fitdp then averages BatchNorm running statistics "
             "over ranks at epoch ends)")
    if not any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        if converted is not module:
            fail("compile(sync_batchnorm=True)", "a module that is itself a BatchNorm layer",
                 "a module containing BatchNorm layers",
                 "wrap it in an nn.Sequential so it can be converted in place", described=True)
