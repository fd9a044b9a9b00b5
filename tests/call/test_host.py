"""A call's fixed work on the host module: its tree read in one walk at the call's start and
one at its end (``fitdp.call.host``), the forward's signature read once per function
(``fitdp.checks.forward_signature``), and the one-replica load and store that copy nothing."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

import fitdp
from fitdp.call.first_batch import ForwardArguments
from fitdp.call.host import HostTree
from fitdp.checks import forward_signature
from fitdp.executor.batchnorm_rows import check_batchnorm_rows
from fitdp.executor.manager import DataParallelExecutorManager


class Counted(nn.Module):
    """Counts the walks of its tree: torch's named_parameters, named_buffers, modules and
    the mode switches all go through ``named_modules``."""

    def __init__(self) -> None:
        super().__init__()
        self.walks = 0
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 3))

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:
        self.walks += 1
        return super().named_modules(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_fit_call_walks_the_host_module_three_times() -> None:
    """Regression: each fit walked the module's tree nine times (modes, the BatchNorm check,
    the requires_grad list, parameters and buffers in and out, modes back), 30-60 us each on
    a small transformer: most of a call's fixed cost. Now: once as the call starts, once
    for the first training pass's modes, once as it ends."""
    net = Counted()
    model = fitdp.Model(net)
    model.compile("adam", loss="cross_entropy")
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model.fit(x, y, batch_size=8, verbose=0, devices=["cpu"])  # builds the replicas
    net.walks = 0
    model.fit(x, y, batch_size=8, verbose=0, devices=["cpu"])
    assert net.walks == 3


def _tangled() -> nn.Module:
    """Shared parameters, a shared submodule, a None parameter and a None buffer: torch's
    naming keeps each tensor once, under its first name."""
    shared = nn.Linear(3, 3)
    net = nn.Sequential(shared, nn.BatchNorm1d(3), shared, nn.Linear(3, 2, bias=False))
    net[3].register_buffer("gone", None)
    extra = nn.Linear(2, 2)
    extra.weight = shared.weight  # the same tensor under a second module
    net.append(extra)
    return net


def test_the_one_walk_names_tensors_as_torch_does() -> None:
    net = _tangled()
    tree = HostTree.read(net)
    assert list(tree.params.items()) == list(net.named_parameters())
    assert list(tree.buffers.items()) == list(net.named_buffers())
    assert tree.modules == list(net.named_modules())


def test_a_tree_holding_its_own_named_modules_is_asked() -> None:
    """A submodule that lists its submodules its own way (here: hiding one) is walked as
    torch's named_modules walks it, through that method."""
    class Hiding(nn.Sequential):
        def named_modules(self, memo: Any = None, prefix: str = "",
                          remove_duplicate: bool = True) -> Any:
            for name, m in super().named_modules(memo, prefix, remove_duplicate):
                if not name.endswith(".1"):
                    yield name, m

    net = nn.Sequential(nn.Linear(2, 2), Hiding(nn.Linear(2, 2), nn.ReLU()))
    assert HostTree.read(net).modules == list(net.named_modules())
    assert [name for name, _ in HostTree.read(net).modules] == ["", "0", "1", "1.0"]


def test_a_module_naming_its_own_tensors_is_asked() -> None:
    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
            for name, p in super().named_parameters(*args, **kwargs):
                yield name.removeprefix("inner."), p

    net = Renamed()
    assert list(HostTree.read(net).params) == ["weight", "bias"]


def test_forward_signature_is_read_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The signature of a class's forward is read once for every instance; a forward set on
    the instance is another function, read anew (a stale signature would check a dict
    batch's keys against the wrong arguments)."""
    reads: list[Any] = []
    real = inspect.signature

    def counted(fn: Any, *args: Any, **kwargs: Any) -> inspect.Signature:
        reads.append(fn)
        return real(fn, *args, **kwargs)

    class Net(nn.Linear):
        def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None
                    ) -> torch.Tensor:
            return super().forward(input_ids)

    monkeypatch.setattr(inspect, "signature", counted)
    a, b = Net(2, 2), Net(2, 2)
    assert ForwardArguments.read(a).names == ("input_ids", "mask")  # type: ignore[union-attr]
    assert ForwardArguments.read(b).names == ("input_ids", "mask")  # type: ignore[union-attr]
    assert len(reads) == 1

    def own(features: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return features

    b.forward = own  # type: ignore[method-assign, assignment]
    args = ForwardArguments.read(b)
    assert args is not None and args.names == ("features",) and args.open
    assert forward_signature(a) == real(a.forward)
    assert len(reads) == 2


def test_batchnorm_check_walks_the_module_only_for_a_one_row_piece() -> None:
    """Regression: the one-row BatchNorm1d check walked the module on every fit, though the
    sizes alone show that no piece has one row."""
    net = Counted()
    net.body.append(nn.BatchNorm1d(3))
    cpu = [torch.device("cpu")]
    check_batchnorm_rows(net, samples=64, batch_size=16, devices=cpu, loads=[1.0],
                         micro_batch_size=None)
    assert net.walks == 0
    with pytest.raises(ValueError, match="batch_size: got 16.*'body.4'"):
        check_batchnorm_rows(net, samples=65, batch_size=16, devices=cpu, loads=[1.0],
                             micro_batch_size=None)
    assert net.walks == 1


def test_one_replica_load_and_store_of_its_own_tensors_copy_nothing() -> None:
    """With one device the replica is the host module: handing the manager its own tensors
    is nothing to check or copy; anything else still is checked and copied."""
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    mgr = DataParallelExecutorManager(net, [torch.device("cpu")])
    try:
        params, buffers = dict(net.named_parameters()), dict(net.named_buffers())
        versions = [t._version for t in (*params.values(), *buffers.values())]
        mgr.set_params(params, buffers)
        mgr.copy_to(params, buffers)
        assert [t._version for t in (*params.values(), *buffers.values())] == versions
        with pytest.raises(ValueError, match="unknown names"):
            mgr.set_params({**params, "nope": torch.zeros(1)}, buffers)
        fresh = {k: torch.full_like(v, 2.0) for k, v in params.items()}
        mgr.set_params(fresh, {})
        assert all(bool((p == 2.0).all()) for p in net.parameters())
    finally:
        mgr.close()
