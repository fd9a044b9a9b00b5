"""DeviceMetrics: per-device clones merged with torchmetrics' merge_state, exact for every state
kind; no metric keeps a reused buffer or autograd history; unmergeable metrics and those that
read logits per update updated once per batch, as one device."""

from __future__ import annotations

import copy
import doctest
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics import Metric
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryAUROC,
    MulticlassAccuracy,
    MulticlassAUROC,
)
from torchmetrics.image import PeakSignalNoiseRatio
from torchmetrics.regression import PearsonCorrCoef

import fitdp
import fitdp.compiled.metrics
from fitdp.compiled.metrics import DeviceMetrics, metric_specs
from fitdp.executor import DataParallelExecutorManager

CPU = torch.device("cpu")


class Extreme(Metric):
    """Smallest ('min' state) or largest ('max' state) error preds - target seen."""

    full_state_update = False

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fn = torch.minimum if kind == "min" else torch.maximum
        start = float("inf") if kind == "min" else float("-inf")
        self.add_state("value", torch.tensor(start), dist_reduce_fx=kind)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        err = preds - target
        self.value = self.fn(self.value, err.min() if self.fn is torch.minimum else err.max())

    def compute(self) -> torch.Tensor:
        return self.value


def _logsumexp0(states: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(states, dim=0)


class LogSumExp(Metric):
    """log(sum(exp(preds))), merged by a custom callable reduction."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("lse", torch.tensor(float("-inf")), dist_reduce_fx=_logsumexp0)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.lse = torch.logaddexp(self.lse, preds.logsumexp(0))

    def compute(self) -> torch.Tensor:
        return self.lse


class KeepFirstLabel(Metric):
    """A tensor state set to a view of its input: the aliasing a copy must catch."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("first", torch.zeros(1, dtype=torch.long), dist_reduce_fx="max")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if self.update_count == 1:
            self.first = target[:1]

    def compute(self) -> torch.Tensor:
        return self.first.float().sum()


class Undeclared(Metric):
    """A user's metric that never declares full_state_update (torchmetrics reads None)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("n", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.n += target.numel()

    def compute(self) -> torch.Tensor:
        return self.n


class InPlaceMergeCount(Undeclared):
    """full_state_update=True, with its own merge_state that adds in place."""

    full_state_update = True

    def merge_state(self, incoming_state: dict | Metric) -> None:
        other = incoming_state if isinstance(incoming_state, dict) else incoming_state.metric_state
        self.n += other["n"]


KINDS: dict[str, Callable[[], Metric]] = {
    "sum": BinaryAccuracy,
    "cat": BinaryAUROC,
    "mean": lambda: PeakSignalNoiseRatio(data_range=1.0),  # data_range is a 'mean' state
    "min": lambda: Extreme("min"),
    "max": lambda: Extreme("max"),
    "callable": LogSumExp,
}
SETUPS = {"cpu2": (["cpu", "cpu"], None), "cpu3-uneven": (["cpu", "cpu", "cpu"], [1, 2, 4])}


class PoolNet(nn.Module):
    """Embedding -> mean over time -> one probability per sequence (not a logit: binary
    torchmetrics apply a sigmoid only when some value of an update lies outside [0, 1], so
    logits of a small slice could be read as probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.emb(x).mean(1)).squeeze(1))


def _bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy(out, y.float())


def _sequences(n: int = 90) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 20, (n,), generator=g)
    return [torch.randint(1, 32, (int(k),), generator=g) for k in lengths], torch.randint(
        0, 2, (n,), generator=g)


def _check_epoch_equals_one_update(metric: Metric, devices: list[str],
                                   loads: list[float] | None) -> None:
    """Train one bucketed epoch (labels staged in buffers every bucket reuses, outputs with
    autograd history), computing after every batch as batch logs do; the merged value must
    equal the metric updated once, on one device, with the whole epoch."""
    torch.manual_seed(0)
    mgr = DataParallelExecutorManager(PoolNet(), devices, work_load_list=loads,
                                      bucket_module=lambda key: PoolNet(), loss=_bce)
    dm = DeviceMetrics({"m": metric}, mgr.devices)
    outputs, labels = [], []
    seqs, y = _sequences()
    for batch in fitdp.BucketIterator(seqs, y, batch_size=16, buckets=[8, 20], seed=0):
        mgr.load_data_batch(batch)
        mgr.forward(is_train=True)
        mgr.backward()
        mgr.update_metric(dm)
        outputs += [o.detach().cpu().clone() for o in mgr.outputs()]
        labels.append(batch.label.clone())
        dm.compute()
    reference = copy.deepcopy(metric)
    reference.update(torch.cat(outputs), torch.cat(labels))
    expected = float(reference.compute())
    assert dm.compute()["m"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    dm.reset()
    assert all(m.update_count == 0 for clones in dm.clones for m in clones.values())


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_state_kind_with_buckets_equals_one_update(kind: str, setup: str) -> None:
    """Regression (issue 10.1): 'cat' metrics kept views of reused label buffers (AUROC wrong
    with bucketing). torchmetrics reduces each state by its own rule when it syncs processes;
    merging the device clones must give the whole-epoch value for sum, mean, cat, min, max and
    a custom callable reduction, on several devices with even and uneven work loads."""
    _check_epoch_equals_one_update(KINDS[kind](), *SETUPS[setup])


@pytest.mark.requires_cuda
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_state_kind_with_buckets_on_cuda(kind: str) -> None:
    """The CUDA tier: every batch's labels live in device buffers reused by the next batch."""
    _check_epoch_equals_one_update(KINDS[kind](), ["cuda:0", "cuda:0"], None)


@pytest.mark.parametrize("n_devices", [1, 2])
def test_label_view_of_reused_buffer_is_not_kept(n_devices: int) -> None:
    """Regression (issue 10.1): a label view kept by a 'cat' state changed when fitdp wrote
    the next batch into the same buffer."""
    dm = DeviceMetrics({"auroc": BinaryAUROC(), "first": KeepFirstLabel()}, [CPU] * n_devices)
    buffer = torch.empty(4, dtype=torch.long)
    preds = torch.tensor([0.9, 0.8, 0.2, 0.1])
    for d in range(n_devices):
        buffer.copy_(torch.tensor([1, 1, 0, 0]))
        dm.update(d, preds, buffer[:4])
        dm.end_batch()  # as the executor does after each batch's hand-off
        buffer.copy_(torch.tensor([0, 0, 1, 1]))  # the next batch overwrites the buffer
    logs = dm.compute()
    assert logs == {"auroc": 1.0, "first": 1.0}


def test_outputs_with_autograd_history_several_replicas() -> None:
    """Regression (issue 10.1): 'cat' states kept outputs with autograd history and merging
    them crashed ("Only Tensors created explicitly by the user (graph leaves) support the
    deepcopy protocol")."""
    net = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0), nn.Sigmoid())
    dm = DeviceMetrics({"auroc": BinaryAUROC()}, [CPU, CPU])
    x = torch.randn(8, 3)
    y = torch.tensor([0, 1] * 4)
    dm.update(0, net(x[:4]), y[:4])
    dm.update(1, net(x[4:]), y[4:])
    dm.end_batch()
    states = [t for clones in dm.clones for v in clones["auroc"].metric_state.values()
              for t in (v if isinstance(v, list) else [v])]
    assert states and all(t.grad_fn is None and not t.requires_grad for t in states)
    with torch.no_grad():
        expected = float(BinaryAUROC()(net(x), y))
    assert dm.compute()["auroc"] == pytest.approx(expected)


def test_compute_leaves_clones_to_accumulate_and_reads_an_idle_device() -> None:
    """compute() lends a clone as the merge target and gives it its own states back: values
    read between updates are never cached stale, and a device with no rows adds nothing."""
    dm = DeviceMetrics({"acc": MulticlassAccuracy(num_classes=2, average="micro")}, [CPU] * 3)
    right, wrong = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    zero = torch.tensor([0])
    dm.update(0, right, zero)
    dm.update(1, wrong, zero)
    assert dm.compute() == {"acc": 0.5}
    assert dm.compute() == {"acc": 0.5}
    dm.update(1, right, zero)  # only device 1: device 0, the merge target, is unchanged
    assert dm.compute() == pytest.approx({"acc": 2 / 3})
    assert [m["acc"].update_count for m in dm.clones] == [1, 2, 0]


def test_first_device_idle_mean_state() -> None:
    """merge_state's 'mean' rule divides by the target's update count: the target must be a
    clone that was updated, not device 0 when it saw no rows."""
    dm = DeviceMetrics({"psnr": PeakSignalNoiseRatio(data_range=1.0)}, [CPU, CPU])
    preds, target = torch.tensor([0.5, 0.25]), torch.tensor([0.0, 0.0])
    dm.update(1, preds, target)
    expected = float(PeakSignalNoiseRatio(data_range=1.0)(preds, target))
    assert dm.compute() == pytest.approx({"psnr": expected})


def test_merge_state_override_working_in_place_is_accepted_and_exact() -> None:
    """torchmetrics refuses merge_state for full_state_update=True and tells users to
    override it; an override that adds in place must not leak into the clone's own count."""
    dm = DeviceMetrics({"n": InPlaceMergeCount()}, [CPU, CPU])
    for step in range(3):
        dm.update(0, torch.zeros(2), torch.zeros(2))
        dm.update(1, torch.zeros(3), torch.zeros(3))
        assert dm.compute() == {"n": 5.0 * (step + 1)}


@pytest.mark.parametrize("make", [PearsonCorrCoef, Undeclared,
                                  lambda: BinaryAUROC(dist_sync_on_step=True)])
@pytest.mark.parametrize("loads", [[1, 1], [1, 3, 1]])
def test_unmergeable_metric_equals_one_device(make: Callable[[], Metric], loads: list[int]
                                              ) -> None:
    """Regression (issue 17.4): metrics merge_state refuses (full_state_update=True such as
    PearsonCorrCoef, undeclared, dist_sync_on_step=True) were refused on several devices;
    they update once per batch with the slices joined in device order: one device's value."""
    g = torch.Generator().manual_seed(0)
    dm = DeviceMetrics({"m": make()}, [CPU] * len(loads))
    one = make()
    for _ in range(3):
        preds, target = torch.rand(10, generator=g), torch.rand(10, generator=g)
        if isinstance(one, BinaryAUROC):
            target = target.round().long()
        slices = fitdp.executor.split_input_slice(10, loads)
        for d, sl in enumerate(slices):
            dm.update(d, preds[sl], target[sl])
        dm.end_batch()
        one.update(preds, target)
        assert dm.compute() == {"m": float(one.compute())}


@pytest.mark.parametrize("bad", [5, "accuracy", 2.5])
def test_metric_specs_rejects_what_is_not_a_metric_collection(bad: object) -> None:
    """Regression (issue 10.13): metrics=5 failed with a bare "'int' object is not iterable"."""
    with pytest.raises(TypeError, match=r"metrics: got .* expected a torchmetrics.Metric, a list"):
        metric_specs(bad)


def test_metric_specs_hints_keras_accuracy() -> None:
    """Keras' "accuracy" is the fraction of rows whose argmax equals the label: the
    micro-averaged accuracy, not torchmetrics' default macro average over classes."""
    with pytest.raises(TypeError, match=r"average='micro'"):
        metric_specs("accuracy")
    preds = torch.tensor([[1.0, 0.0]] * 3 + [[0.0, 1.0]])
    target = torch.tensor([0, 0, 0, 0])
    micro = MulticlassAccuracy(num_classes=2, average="micro")(preds, target)
    assert float(micro) == 0.75  # 3 of 4 rows right, as Keras reports
    assert float(MulticlassAccuracy(num_classes=2)(preds, target)) != 0.75


def test_binary_metrics_read_logits_per_update() -> None:
    """torchmetrics' binary metrics apply a sigmoid only when some value of one update lies
    outside [0, 1] (its docs: such inputs are considered logits), so a slice of logits inside
    [0, 1] is read as probabilities: the reason docs/metrics.md asks for probabilities."""
    alone = BinaryAccuracy()(torch.tensor([0.3]), torch.tensor([1]))
    with_others = BinaryAccuracy()(torch.tensor([0.3, -3.0]), torch.tensor([1, 0]))
    assert float(alone) == 0.0 and float(with_others) == 1.0


def test_docstring_example_runs() -> None:
    assert doctest.testmod(fitdp.compiled.metrics, extraglobs={"torch": torch}).failed == 0


def _three_metrics(devices: int) -> DeviceMetrics:
    """A sum state, cat states (read once per batch) and a Keras name (built on the first
    update), on ``devices`` CPU devices."""
    return DeviceMetrics({"acc": MulticlassAccuracy(num_classes=3, average="micro"),
                          "auroc": MulticlassAUROC(num_classes=3), "keras": "accuracy"},
                         [CPU] * devices)


def _feed(dm: DeviceMetrics, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each batch split over the devices in order, as a step of the executor manager."""
    for outputs, labels in batches:
        for d, rows in enumerate(torch.arange(len(labels)).tensor_split(len(dm.devices))):
            dm.update(d, outputs[rows], labels[rows])
        dm.end_batch()


@pytest.mark.parametrize("devices", [1, 2])
def test_metric_states_resume_exactly_through_torchmetrics_public_api(devices: int) -> None:
    """Regression (issue 28 item 14): a resume wrote torchmetrics' private ``_update_count``
    and ``_computed``. The states go back through the public API (``reset``, the declared
    states, ``merge_state``) with the updates before the resume counted by fitdp: the
    epoch goes on bit for bit as the uninterrupted one (torchmetrics' own reference: one
    metric updated with every batch), with no "compute before update" warning. A Keras name
    (built on its first update) resumes too: it raised KeyError."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(6, 3, generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in range(4)]
    whole = _three_metrics(devices)
    _feed(whole, data)
    stopped = _three_metrics(devices)
    _feed(stopped, data[:2])
    saved = copy.deepcopy(stopped.state_dict())
    resumed = _three_metrics(devices)
    resumed.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchmetrics warns on a compute it counts no update of
        assert resumed.compute() == stopped.compute()  # a Keras name built from the save
        _feed(resumed, data[2:])
        assert resumed.compute() == whole.compute()
    assert copy.deepcopy(resumed.state_dict())[0]["acc"]["updates"] == 4
    reference = MulticlassAccuracy(num_classes=3, average="micro")
    for outputs, labels in data:
        reference.update(outputs, labels)
    assert resumed.compute()["acc"] == float(reference.compute())


def test_metric_states_of_more_devices_merge_into_fewer_on_resume() -> None:
    """A resume on fewer devices merges the extra devices' states (merge_state) into the
    last clone: the epoch's value equals the uninterrupted run's."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 3, generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in range(4)]
    stopped, whole = _three_metrics(3), _three_metrics(3)
    _feed(stopped, data[:2])
    _feed(whole, data)
    resumed = _three_metrics(1)
    resumed.load_state_dict(copy.deepcopy(stopped.state_dict()))
    _feed(resumed, data[2:])
    assert resumed.compute() == pytest.approx(whole.compute())


def test_metric_states_of_another_metric_are_refused_before_loading() -> None:
    saved = _three_metrics(1)
    _feed(saved, [(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))])
    other = DeviceMetrics({"acc": PeakSignalNoiseRatio(data_range=1.0)}, [CPU])
    problem = other.state_problem(saved.state_dict())
    assert problem is not None and problem.startswith("metric 'acc': the saved states")
