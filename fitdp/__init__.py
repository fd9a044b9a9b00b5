"""fitdp: a Keras-style trainer for PyTorch with a real data-parallel executor manager.

Example:
    >>> import fitdp, torch
    >>> model = fitdp.Model(torch.nn.Linear(4, 2))
    >>> model.compile(optimizer="sgd", loss="cross_entropy")
"""

from fitdp import callbacks, executor
from fitdp._version import __version__
from fitdp.batch import DataBatch, DataDesc
from fitdp.bucketing import BucketIterator
from fitdp.checkpoint import CheckpointError
from fitdp.executor.engines import DDP, FSDP
from fitdp.export import load_predictor
from fitdp.model import Model
from fitdp.monitor import Monitor
from fitdp.sequence import TokenMean

__all__ = [
    "DDP", "FSDP", "BucketIterator", "CheckpointError", "DataBatch", "DataDesc", "Model",
    "Monitor", "TokenMean",
    "__version__", "callbacks", "executor", "load_predictor",
]
