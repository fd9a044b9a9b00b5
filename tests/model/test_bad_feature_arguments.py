"""Property (issue 28, done-when): a bad argument to a feature of round three
(``compile(strategy=...)``, optimizer dicts, ``fitdp.all_gather``, ``TokenMean``,
``BucketIterator(layout=...)``, ``predict(ragged=...)``, ``export(precision=...)``,
``save(sharded=...)``) raises a TypeError/ValueError naming the argument, and leaves the
weights, the optimizer state and ``global_step`` as they were (compared with
``torch.equal``), as the rule for bad input says (COMMON rules; Keras raises before
training too)."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fitdp
from fitdp import DDP, FSDP
from fitdp.compiled.optimizers import OPTIMIZERS
from fitdp.compiled.setup import PRECISIONS
from fitdp.executor.engines import STRATEGIES

SEQS = [torch.randint(1, 9, (n,), generator=torch.Generator().manual_seed(n))
        for n in [2, 3, 4] * 4]
LABELS = torch.tensor([0, 1, 2] * 4)
X = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
FOLDER = Path(tempfile.mkdtemp(prefix="fitdp-bad-features-"))


def _model() -> fitdp.Model:
    """Two optimizers by name, trained one epoch: weights, optimizer state and a step."""
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    model.compile(optimizer={"d": torch.optim.SGD(model.module[0].parameters(), lr=0.1),
                             "g": torch.optim.Adam(model.module[2].parameters(), lr=0.01)},
                  loss="cross_entropy")
    model.fit(X, LABELS, batch_size=6, epochs=1, verbose=0)
    return model


MODEL = _model()  # every call must leave it as it is: one model serves every example


def snapshot(model: fitdp.Model) -> tuple[dict[str, torch.Tensor], Any, int]:
    return ({k: v.clone() for k, v in model.module.state_dict().items()},
            _cloned(model.optimizer.state_dict()), model.global_step)


def _cloned(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(v) for v in tree)
    return tree


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k])
                                                                    for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(equal(u, v) for u, v in zip(a, b)))
    return bool(a == b)


def others(choices: Any) -> st.SearchStrategy[Any]:
    """Values that are not one of ``choices``: other strings, numbers, containers, arrays."""
    return st.one_of(
        st.text(max_size=6).filter(lambda s: s not in choices), st.integers(),
        st.floats(allow_nan=True), st.none(), st.booleans(),
        st.lists(st.sampled_from(sorted(choices)), min_size=1, max_size=2),
        st.sampled_from([np.array(sorted(choices)), torch.tensor([1.0]), {"a": 1}, object()]))


def not_a_bool(allow_none: bool = False) -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(), st.text(max_size=3), st.floats(allow_nan=True),
                     st.lists(st.booleans(), max_size=1), st.just(np.bool_(True)),
                     *([] if allow_none else [st.none()]))


def _foreign_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)


bad_optimizer_dicts = st.one_of(
    st.just({}), st.just([]),
    st.dictionaries(st.integers(), st.just("sgd"), min_size=1, max_size=2),
    st.dictionaries(st.text(min_size=1, max_size=3),
                    st.one_of(st.integers(), st.none(), st.text(max_size=4).filter(
                        lambda s: s.lower() not in OPTIMIZERS)), min_size=1, max_size=2),
    st.lists(st.one_of(st.integers(), st.just("nope")), min_size=1, max_size=2),
    st.builds(lambda: {"d": "sgd", "g": _foreign_optimizer()}))

bad_strategies = st.one_of(
    others(STRATEGIES),
    st.builds(DDP, static_graph=not_a_bool()),
    st.builds(DDP, bucket_cap_mb=st.one_of(
        st.floats(max_value=0.0), st.sampled_from([math.nan, math.inf]), st.text(max_size=2),
        st.none())),
    st.builds(FSDP, blocks=st.lists(st.one_of(st.integers(), st.just("Linear"),
                                              st.just(nn.Linear(1, 1))),
                                    min_size=1, max_size=2).map(tuple)),
    st.builds(FSDP, min_params=st.one_of(st.integers(max_value=-1), st.floats(),
                                         st.text(max_size=2), st.booleans())),
    st.builds(FSDP, reshard_after_forward=not_a_bool()))

Call = Callable[[fitdp.Model, Any], Any]
# (call, bad values, what the message must name)
CASES: dict[str, tuple[Call, st.SearchStrategy[Any], str]] = {
    "compile(strategy=)": (lambda m, v: m.compile(optimizer="adam", strategy=v),
                           bad_strategies, "strategy"),
    "compile(optimizer={...})": (lambda m, v: m.compile(optimizer=v), bad_optimizer_dicts,
                                 "optimizer"),
    "all_gather": (lambda m, v: fitdp.all_gather(v),
                   st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.none(),
                             st.lists(st.integers(), max_size=2),
                             st.sampled_from([np.ones(2), torch.tensor(1.0)])),  # 0-d
                   "all_gather(tensor)"),
    "TokenMean(fn)": (lambda m, v: fitdp.TokenMean(v),
                      st.one_of(st.integers(), st.text(max_size=3), st.none(),
                                st.just(torch.tensor([1.0]))), "fn"),
    "TokenMean(ignore_index)": (lambda m, v: fitdp.TokenMean(lambda o, t: o.sum(), v),
                                st.one_of(st.floats(), st.text(max_size=3), st.none(),
                                          st.booleans(), st.just(np.int64(-100))),
                                "ignore_index"),
    "BucketIterator(layout=)": (lambda m, v: fitdp.BucketIterator(SEQS, LABELS, 4, layout=v),
                                others(("NT", "TN")), "layout"),
    "predict(ragged=)": (lambda m, v: m.predict(X, ragged=v), not_a_bool(), "ragged"),
    "export(precision=)": (lambda m, v: m.export(FOLDER / "p.pt2", X[:2], precision=v),
                           others(tuple(PRECISIONS)), "precision"),
    "save(sharded=)": (lambda m, v: m.save(FOLDER / "s.ckpt", sharded=v),
                       not_a_bool(allow_none=True), "sharded"),
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bad_arguments_of_round_three_raise_naming_them_and_change_nothing(data):
    case = data.draw(st.sampled_from(sorted(CASES)), label="call")
    call, values, name = CASES[case]
    value = data.draw(values, label="value")
    before = snapshot(MODEL)
    try:
        call(MODEL, value)
    except (TypeError, ValueError) as err:
        assert name in str(err), f"{case} with {value!r}: {err}"
    else:
        raise AssertionError(f"{case} accepted {value!r}")
    after = snapshot(MODEL)
    assert equal(after, before), f"{case} with {value!r} changed the model"
