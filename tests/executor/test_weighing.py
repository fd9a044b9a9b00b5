"""``fitdp.executor.weighing``: the one rule for what a slice weighs and what the logged
loss counts (issue 30 item 2: it lived in four places with two caches of clean labels)."""

from __future__ import annotations

import torch
from torch import nn

from fitdp.data.batch import DataBatch
from fitdp.executor.replica import Executor
from fitdp.executor.step import Job
from fitdp.executor.weighing import Weighing, weighted

CPU = torch.device("cpu")


class Counter:
    """torch's cross_entropy count: the targets that are not -100; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (labels != -100).sum()


def job(devices: int, labels: torch.Tensor, slices: list[slice]) -> Job:
    j = Job([Executor(nn.Linear(2, 2), CPU, {}) for _ in range(devices)])
    rows = len(labels)
    j.set(DataBatch(torch.randn(rows, 2), labels), rows, 0, slices)
    return j


def test_slices_weigh_by_the_targets_they_count_as_one_device_on_the_whole_batch():
    """A mean over counted targets (cross_entropy with ignore_index): the whole batch's
    mean is sum(slice mean * slice count) / total count, so each slice weighs count/total."""
    y = torch.tensor([0, -100, -100, 1, 2, 1])
    j = job(2, y, [slice(0, 3), slice(3, 6)])
    Weighing(Counter(), [CPU, CPU], ranks=False).weigh(j, 6)
    assert [int(c) for c in j.counts] == [1, 3]
    assert [float(w) for w in j.weights] == [0.25, 0.75]


def test_one_device_keeps_its_weight_and_logs_its_counted_targets():
    y = torch.tensor([0, -100, 1, 2])
    j = job(1, y, [slice(0, 4)])
    Weighing(Counter(), [CPU], ranks=False).weigh(j, 4)
    assert j.weights == [1.0] and int(j.counts[0]) == 3


def test_labels_without_ignored_targets_are_counted_once_per_tensor_while_unchanged():
    y = torch.tensor([0, 1, 2, 1, 0, 2, 1, 1])
    counter = Counter()
    weighing = Weighing(counter, [CPU, CPU], ranks=False)
    for start in (0, 4, 0):  # views of y, as an in-memory source's batches
        j = job(2, y[start:start + 4], [slice(0, 2), slice(2, 4)])
        weighing.weigh(j, 4)
        assert j.weights == [0.5, 0.5] and j.counts == [2, 2]  # rows, no op per step
    assert counter.calls == 1
    y[0] = -100  # changed in place: counted again
    j = job(2, y[0:4], [slice(0, 2), slice(2, 4)])
    weighing.weigh(j, 4)
    assert [int(c) for c in j.counts] == [1, 2] and counter.calls > 1


def test_the_weighted_loss_is_the_loss_itself_at_weight_one():
    loss = torch.tensor(2.0)
    assert weighted(loss, 1.0) is loss
    assert float(weighted(loss, 0.25)) == 0.5


def test_per_token_labels_without_ignored_targets_log_their_tokens_not_their_rows():
    """Regression: a bucket's batch of per-token labels with no -100 was logged by its rows
    (1 sentence) while its loss means over its tokens (14): the epoch's logged loss then
    differed from the one-device token mean when batches differ in length."""
    y = torch.tensor([[1, 2, 0, 1, 2, 0, 1]])
    j = job(1, y, [slice(0, 1)])
    Weighing(Counter(), [CPU], ranks=False).weigh(j, 1)
    assert j.weights == [1.0] and j.counts == [7]
