"""Callbacks: the `Callback` hook interface, its `CallbackList` dispatcher and the built-ins.

Example:
    >>> from fitdp.callbacks import EarlyStopping, ModelCheckpoint
    >>> callbacks = [EarlyStopping(patience=3), ModelCheckpoint("runs/best.ckpt",
    ...                                                         save_best_only=True)]
"""

from fitdp.callbacks.backup import BackupAndRestore
from fitdp.callbacks.base import HOOKS, Callback, is_log_point
from fitdp.callbacks.callback_list import CallbackList, state_keys
from fitdp.callbacks.csv_logger import CSVLogger
from fitdp.callbacks.early_stopping import EarlyStopping
from fitdp.callbacks.ema import EMA
from fitdp.callbacks.grad_norm import GradNormLogger
from fitdp.callbacks.history import History
from fitdp.callbacks.lambda_callback import LambdaCallback
from fitdp.callbacks.lr import LearningRateScheduler, ReduceLROnPlateau
from fitdp.callbacks.mlflow_logger import MLflowLogger
from fitdp.callbacks.model_checkpoint import ModelCheckpoint
from fitdp.callbacks.nan import TerminateOnNaN
from fitdp.callbacks.profiler import Profiler
from fitdp.callbacks.progress import ProgressBar, Speedometer
from fitdp.callbacks.swa import SWA
from fitdp.callbacks.tensorboard import TensorBoard
from fitdp.callbacks.weight_averaging import WeightAveraging

__all__ = [
    "EMA", "HOOKS", "SWA", "BackupAndRestore", "CSVLogger", "Callback", "CallbackList",
    "EarlyStopping", "GradNormLogger", "History", "LambdaCallback", "LearningRateScheduler",
    "MLflowLogger", "ModelCheckpoint", "Profiler", "ProgressBar", "ReduceLROnPlateau",
    "Speedometer", "TensorBoard", "TerminateOnNaN", "WeightAveraging", "is_log_point",
    "state_keys",
]
