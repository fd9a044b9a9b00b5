"""The examples in the executor modules' docstrings run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch
from torch import nn

MODULES = ["balance", "flat_buckets", "group", "manager", "replica", "slicing", "step",
           "update", "weighing", "local_reduce", "ddp", "fsdp", "zero1"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(f"fitdp.executor.{name}")
    result = doctest.testmod(module, extraglobs={"torch": torch, "nn": nn})
    assert result.failed == 0 and result.attempted > 0
