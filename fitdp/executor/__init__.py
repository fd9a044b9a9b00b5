"""The data-parallel layer (MXNet's ``executor_manager``), usable on its own.

Example:
    >>> from fitdp.executor import split_input_slice
    >>> split_input_slice(6, [1, 2])
    [slice(0, 2, None), slice(2, 6, None)]
"""

from fitdp.executor.group import DataParallelExecutorGroup
from fitdp.executor.manager import DataParallelExecutorManager
from fitdp.executor.replica import Executor
from fitdp.executor.slicing import split_input_slice

__all__ = [
    "DataParallelExecutorGroup", "DataParallelExecutorManager", "Executor", "split_input_slice",
]
