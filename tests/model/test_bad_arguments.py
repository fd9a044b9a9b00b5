"""Property: any bad argument to compile/fit/evaluate/predict raises a TypeError/ValueError
naming it, and leaves weights, optimizer state, step and data position as they were."""

from __future__ import annotations

import math
import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fitdp

SEQS = [torch.randint(1, 9, (n,)) for n in [2, 3, 4] * 8]
LABELS = torch.tensor([0, 1, 2] * 8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x).mean(1))


def trained() -> tuple[fitdp.Model, fitdp.BucketIterator]:
    torch.manual_seed(0)
    model = fitdp.Model(Net())
    model.compile(optimizer="adam", lr=0.01)
    it = fitdp.BucketIterator(SEQS, LABELS, batch_size=4, buckets=[2, 3, 4], seed=0)
    model.fit(it, steps_per_epoch=2, verbose=0)  # the iterator is now mid-epoch
    return model, it


def state(model: fitdp.Model, it: fitdp.BucketIterator) -> tuple:
    return ({k: v.clone() for k, v in model.module.state_dict().items()},
            repr(model.optimizer.state_dict()), model.global_step, it.state_dict())


# in-memory data for the data cases: the same sequences, of one length
X = torch.randint(1, 9, (24, 3))


def nan_at(row: int) -> torch.Tensor:
    w = torch.ones(24)
    w[row] = float("nan")
    return w


def same(a: tuple, b: tuple) -> bool:
    return (a[0].keys() == b[0].keys() and all(torch.equal(v, b[0][k]) for k, v in a[0].items())
            and a[1:] == b[1:])


not_a_number = st.one_of(st.booleans(), st.text(max_size=3), st.none(), st.just([1]),
                         st.sampled_from([math.nan, math.inf, -math.inf]))
# batch_size=None is the default (32 for data fitdp batches): not a bad value
not_a_size = st.one_of(st.booleans(), st.text(max_size=3), st.just([1]),
                       st.sampled_from([math.nan, math.inf, -math.inf]))
negative = st.one_of(st.integers(max_value=-1), st.floats(max_value=-1e-3, allow_nan=False,
                                                           allow_infinity=False))
BAD = {
    ("compile", "lr"): st.one_of(negative, st.booleans(), st.text(max_size=2),
                                 st.sampled_from([math.nan, math.inf])),
    ("compile", "grad_clip_norm"): st.one_of(negative, st.just(0), st.booleans(),
                                             st.sampled_from([math.nan, math.inf])),
    ("compile", "grad_accum_steps"): st.one_of(st.integers(max_value=0), not_a_number,
                                               st.floats(allow_nan=True),
                                               st.integers(min_value=sys.maxsize + 1)),
    ("compile", "lr_scheduler"): st.sampled_from([
        torch.optim.lr_scheduler.StepLR, lambda opt: torch.optim.lr_scheduler.StepLR(opt),
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1),  # no total_steps
        3, "step", (lambda opt: None, "batch")]),
    ("compile", "precision"): st.text(max_size=4),
    ("compile", "metrics"): st.one_of(st.integers(), st.text(min_size=1, max_size=3)),
    ("compile", "optimizer"): st.one_of(st.integers(), st.text(min_size=1, max_size=3)),
    ("compile", "loss"): st.one_of(st.integers(), st.text(min_size=1, max_size=3)),
    ("fit", "batch_size"): st.one_of(st.integers(max_value=0), not_a_size),
    ("fit", "epochs"): st.one_of(st.integers(max_value=-1), not_a_number),
    ("fit", "steps_per_epoch"): st.one_of(st.integers(max_value=0), st.booleans(),
                                          st.text(max_size=2),
                                          st.integers(min_value=sys.maxsize + 1)),
    ("fit", "validation_split"): st.one_of(st.just([]), st.booleans(), st.text(max_size=2),
                                           st.floats(min_value=1.0), negative,
                                           st.sampled_from([math.nan, math.inf])),
    ("fit", "timeout"): st.one_of(negative, st.just(0), not_a_number),
    ("fit", "validation_freq"): st.one_of(st.integers(max_value=0), st.text(max_size=2)),
    ("fit", "devices"): st.one_of(st.just([]), st.integers(max_value=0),
                                  st.just(["cpu", 1.5]), st.just("tpu")),
    ("fit", "work_load_list"): st.one_of(
        st.lists(st.one_of(negative, not_a_number), min_size=2, max_size=2),
        st.text(min_size=1, max_size=5).filter(lambda s: s != "auto"),
        st.lists(st.floats(min_value=1e308, max_value=1.7e308), min_size=2, max_size=2)),
    ("fit", "verbose"): st.one_of(st.integers(min_value=3), st.text(min_size=2, max_size=3)),
    ("fit", "callbacks"): st.one_of(st.integers(), st.just([print])),
    ("fit", "seed"): st.one_of(st.floats(), st.text(max_size=2),
                               st.integers(min_value=2**64), st.integers(max_value=-2**63 - 1)),
    # in-memory data (x, y and sample_weight of the same rows as the iterator's)
    ("fit", "sample_weight"): st.integers(0, 23).map(nan_at),
    ("fit", "x"): st.sampled_from([X.numpy().astype(object), X.numpy().astype(str)]),
    ("fit", "y"): st.sampled_from([LABELS.numpy().astype(str), LABELS.numpy().astype(object),
                                   torch.full((24,), float("inf"))]),
    ("evaluate", "batch_size"): st.one_of(st.integers(max_value=0), not_a_size),
    ("evaluate", "steps"): st.one_of(st.integers(max_value=0), st.text(max_size=2),
                                     st.integers(min_value=sys.maxsize + 1)),
    ("predict", "batch_size"): st.one_of(st.integers(max_value=0), not_a_size),
    ("predict", "steps"): st.one_of(st.integers(max_value=0), st.text(max_size=2),
                                    st.integers(min_value=sys.maxsize + 1)),
}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bad_arguments_raise_and_change_nothing(data):
    method, name = data.draw(st.sampled_from(sorted(BAD)))
    value = data.draw(BAD[(method, name)])
    model, it = trained()
    before = state(model, it)
    call = getattr(model, method)
    try:
        if method == "compile":
            call(**{name: value})
        elif method == "fit" and name in ("x", "y", "sample_weight"):
            data = {"x": X, "y": LABELS, name: value}
            call(devices=["cpu", "cpu"], verbose=0, **data)
        elif method == "fit":
            call(it, devices=["cpu", "cpu"], verbose=0, **{name: value}) if name != (
                "devices") else call(it, verbose=0, **{name: value})
        elif method == "evaluate":
            call(it, verbose=0, **{name: value})
        else:
            call(it, **{name: value})
    except (TypeError, ValueError) as err:
        assert name.split("_")[0] in str(err) or name in str(err), str(err)
    else:
        raise AssertionError(f"{method}({name}={value!r}) did not raise")
    assert same(state(model, it), before), f"{method}({name}={value!r}) changed the model"
