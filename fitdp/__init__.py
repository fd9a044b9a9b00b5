"""fitdp: a Keras-style trainer for PyTorch with a real data-parallel executor manager.

Example:
    >>> import fitdp, torch
    >>> model = fitdp.Model(torch.nn.Linear(4, 2))
    >>> model.compile(optimizer="sgd", loss="cross_entropy")
"""

from fitdp import callbacks, executor
from fitdp._version import __version__
from fitdp.call.gather import all_gather
from fitdp.call.interrupts import Preempted
from fitdp.call.monitor import Monitor
from fitdp.data.batch import DataBatch, DataDesc
from fitdp.data.bucketing import BucketIterator
from fitdp.data.length_groups import BucketBatchSampler
from fitdp.data.sequence import TokenMean
from fitdp.executor.ddp import DDP
from fitdp.executor.fsdp import FSDP
from fitdp.model.facade import Model
from fitdp.model.steps import unpack_x_y_sample_weight
from fitdp.saving.checkpoint import CheckpointError
from fitdp.saving.export import load_predictor

__all__ = [
    "DDP", "FSDP", "BucketBatchSampler", "BucketIterator", "CheckpointError", "DataBatch",
    "DataDesc", "Model",
    "Monitor", "Preempted", "TokenMean",
    "__version__", "all_gather", "callbacks", "executor", "load_predictor",
    "unpack_x_y_sample_weight",
]
