"""Property (issue 37, "Clear errors at the door for round four's arguments"): a bad value
for any argument round four added (``loss_items``, ``loss=None``, ``async_save`` and
``sharded``, ``BackupAndRestore``, ``ModelCheckpoint``'s flags, ``EMA``, ``SWA``,
``find_lr``, ``Profiler``, ``MLflowLogger``, ``CSVLogger``, the reproducible mode, activation
checkpointing, ``forward_kwargs``, a batch size next to a DataLoader) raises a TypeError or
ValueError in the form of ``fitdp/checks.py`` (naming the argument, then "got" what was
received), and changes nothing: weights, buffers (BatchNorm statistics), optimizer state,
the run's position and counters, and the files in the run's folder.

The clear-error rate of a larger draw: ``python tests/model/test_bad_round_four.py 1000``.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fitdp
from fitdp.callbacks import (
    EMA,
    SWA,
    BackupAndRestore,
    CSVLogger,
    MLflowLogger,
    ModelCheckpoint,
    Profiler,
)

G = torch.Generator().manual_seed(5)
X, Y = torch.randn(32, 4, generator=G), torch.randint(0, 3, (32,), generator=G)
FOLDER = Path(tempfile.mkdtemp(prefix="fitdp-bad-round-four-"))
FILE = FOLDER / "a-file"  # a file where a folder is asked for
FILE.write_text("not a folder")
LOADER = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)


class OwnLossNet(nn.Module):
    """A module that computes its own loss from ``labels`` (a Hugging Face model's habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.body(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def _trained(module: nn.Module, **compile_kw: Any) -> fitdp.Model:
    """``module`` compiled and trained one epoch (4 steps): weights, BatchNorm statistics,
    optimizer state and a run position (``epoch_done``) that a bad call must keep."""
    torch.manual_seed(0)
    model = fitdp.Model(module)
    model.compile(optimizer="adam", lr=0.01, **compile_kw)
    data = {"x": X, "labels": Y} if compile_kw.get("loss", "x") is None else X
    model.fit(data, None if isinstance(data, dict) else Y, batch_size=8, verbose=0)
    return model


MLP = _trained(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
OWN = _trained(OwnLossNet(), loss=None)


def state(model: fitdp.Model) -> tuple[Any, ...]:
    files = sorted((str(p.relative_to(FOLDER)), p.stat().st_size) for p in FOLDER.rglob("*"))
    cwd = sorted(os.listdir("."))
    return ({k: v.clone() for k, v in model.module.state_dict().items()},
            repr(model.optimizer.state_dict()), repr(model.run), files, cwd)


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (a[0].keys() == b[0].keys() and all(torch.equal(v, b[0][k]) for k, v in a[0].items())
            and a[1:] == b[1:])


def not_a_bool() -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(), st.text(max_size=3), st.floats(allow_nan=True), st.none(),
                     st.lists(st.booleans(), max_size=1), st.just(np.bool_(True)))


def not_a_count(low: int) -> st.SearchStrategy[Any]:
    return st.one_of(st.integers(max_value=low - 1), st.floats(allow_nan=True),
                     st.text(max_size=2), st.booleans(), st.none(),
                     st.integers(min_value=sys.maxsize + 1))


def not_a_number(low: float, high: float) -> st.SearchStrategy[Any]:
    return st.one_of(st.floats(max_value=low, exclude_max=True), st.floats(
        min_value=high, exclude_min=True), st.sampled_from([math.nan, math.inf, "0.9", None,
                                                            True, [0.5]]))


def bad_folders() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from([str(FILE), str(FILE / "sub"), "", 3, None, b"x"]))


def fit_mlp(**kw: Any) -> None:
    MLP.fit(X, Y, batch_size=8, epochs=2, verbose=0, **kw)


def with_callback(make: Callable[[Any], Any]) -> Callable[[Any], None]:
    """A fit of the trained MLP with the callback ``make(value)`` (made inside the call: a
    bad value may be refused when the callback is made, or when fit checks it)."""
    return lambda v: fit_mlp(callbacks=[make(v)])


def count_returning(value: Any) -> None:
    """Compile the module's own loss weighed by a ``loss_items`` callable returning
    ``value`` (before the snapshot: compile starts a new optimizer state)."""
    OWN.compile(optimizer="adam", lr=0.01, loss=None, loss_items=lambda batch: value)


def fit_own(value: Any) -> None:
    OWN.fit({"x": X, "labels": Y}, batch_size=8, epochs=2, verbose=0, devices=["cpu", "cpu"])


def own_loss_of_plain_module(form: str) -> None:
    plain = fitdp.Model(nn.Linear(4, 3))
    plain.compile(optimizer="adam", loss=None)
    if form == "x, y":
        plain.fit(X, Y, batch_size=8, verbose=0)
    else:
        plain.fit({"input": X, "labels": Y}, batch_size=8, verbose=0)


# name: (the model the call may change, the call, bad values, what the message names)
CASES: dict[str, tuple[fitdp.Model, Callable[[Any], Any], st.SearchStrategy[Any], str]] = {
    "compile(loss_items=<callable>)": (
        OWN, fit_own,
        st.one_of(st.integers(max_value=0), st.sampled_from(
            ["3", 2.5, math.nan, None, True, [4], torch.tensor(2.0), torch.tensor([1, 2]),
             torch.tensor(0)])), "loss_items"),
    "compile(loss_items=<name>)": (
        OWN, lambda v: OWN.compile(optimizer="adam", loss=None, loss_items=v),
        st.one_of(st.text(max_size=8).filter(lambda s: s not in ("tokens", "causal_lm")),
                  st.integers(), st.just(["tokens"])), "loss_items"),
    "compile(loss=None) without labels in the forward": (
        MLP, own_loss_of_plain_module, st.sampled_from(["x, y", "dict"]), "compile(loss=None)"),
    "evaluate(x=<dict without labels>)": (
        OWN, lambda v: OWN.evaluate({"x": X[:v]}, batch_size=4, verbose=0),
        st.integers(4, 32), "x"),
    "save(async_save=)": (MLP, lambda v: MLP.save(FOLDER / "m.ckpt", async_save=v),
                          not_a_bool(), "async_save"),
    "save(sharded=)": (MLP, lambda v: MLP.save(FOLDER / "m.ckpt", sharded=v),
                       not_a_bool().filter(lambda v: v is not None), "sharded"),
    "ModelCheckpoint(async_save=)": (
        MLP, with_callback(lambda v: ModelCheckpoint(str(FOLDER / "c.ckpt"), async_save=v)),
        not_a_bool(), "async_save"),
    "ModelCheckpoint(save_best_only=)": (
        MLP, with_callback(lambda v: ModelCheckpoint(str(FOLDER / "c.ckpt"),
                                                     save_best_only=v)),
        not_a_bool(), "save_best_only"),
    "ModelCheckpoint(filepath=)": (
        MLP, with_callback(lambda v: ModelCheckpoint(str(FOLDER / v))),
        st.sampled_from(["{val_loss:.2f}.ckpt", "{batch}.ckpt", "{loss:d}.ckpt",
                         "a-file/{epoch}.ckpt", "{}.ckpt", "{epoch.x}.ckpt"]), "filepath"),
    "BackupAndRestore(backup_dir=)": (MLP, with_callback(BackupAndRestore), bad_folders(),
                                      "backup_dir"),
    "BackupAndRestore(save_freq=)": (
        MLP, with_callback(lambda v: BackupAndRestore(str(FOLDER / "b"), save_freq=v)),
        st.one_of(st.integers(max_value=0), st.text(max_size=4).filter(lambda s: s != "epoch"),
                  st.floats(allow_nan=True)), "save_freq"),
    "BackupAndRestore(async_save=)": (
        MLP, with_callback(lambda v: BackupAndRestore(str(FOLDER / "b"), async_save=v)),
        not_a_bool(), "async_save"),
    "BackupAndRestore(double_checkpoint=)": (
        MLP, with_callback(lambda v: BackupAndRestore(str(FOLDER / "b"),
                                                      double_checkpoint=v)),
        not_a_bool(), "double_checkpoint"),
    "EMA(decay=)": (MLP, with_callback(lambda v: EMA(decay=v)), not_a_number(0, 1), "decay"),
    "EMA(update_every_n_steps=)": (MLP, with_callback(lambda v: EMA(update_every_n_steps=v)),
                                   not_a_count(1), "update_every_n_steps"),
    "SWA(swa_lr=)": (MLP, with_callback(lambda v: SWA(swa_lr=v)),
                     st.one_of(st.floats(max_value=0), st.sampled_from(
                         [math.nan, "0.1", None, [0.1, 0.2], []])), "swa_lr"),
    "SWA(swa_epoch_start=)": (MLP, with_callback(lambda v: SWA(swa_lr=0.01, swa_epoch_start=v)),
                              st.one_of(st.integers(min_value=2), st.integers(max_value=-1),
                                        st.floats(min_value=1.0), st.sampled_from(
                                            [math.nan, "1", None])), "swa_epoch_start"),
    "SWA(annealing_strategy=)": (
        MLP, with_callback(lambda v: SWA(swa_lr=0.01, annealing_strategy=v)),
        st.one_of(st.text(max_size=4), st.integers(), st.none()), "annealing_strategy"),
    "find_lr(num_steps=)": (MLP, lambda v: MLP.find_lr(X, Y, num_steps=v, batch_size=8),
                            st.one_of(not_a_count(2), st.integers(min_value=10**7)),
                            "num_steps"),
    "find_lr(min_lr=)": (MLP, lambda v: MLP.find_lr(X, Y, min_lr=v, num_steps=3),
                         st.one_of(st.floats(max_value=0), st.floats(min_value=1.0),
                                   st.sampled_from([math.nan, "1e-7", None])), "min_lr"),
    "find_lr(beta=)": (MLP, lambda v: MLP.find_lr(X, Y, beta=v, num_steps=3),
                       st.one_of(st.floats(max_value=0, exclude_max=True),
                                 st.floats(min_value=1), st.just(math.nan)), "beta"),
    "Profiler(dir=)": (MLP, with_callback(Profiler), bad_folders(), "dir"),
    "Profiler(wait=)": (MLP, with_callback(lambda v: Profiler(str(FOLDER / "p"), wait=v)),
                        not_a_count(0), "wait"),
    "Profiler(record_shapes=)": (
        MLP, with_callback(lambda v: Profiler(str(FOLDER / "p"), record_shapes=v)),
        not_a_bool(), "record_shapes"),
    "MLflowLogger(tracking_uri=)": (
        MLP, with_callback(MLflowLogger),
        st.sampled_from(["not a uri://x", "://x", "1http://x", str(FILE), str(FILE / "m"), 3,
                         b"sqlite:///x", ""]), "tracking_uri"),
    "MLflowLogger(update_freq=)": (
        MLP, with_callback(lambda v: MLflowLogger(str(FOLDER / "ml"), update_freq=v)),
        st.one_of(st.integers(max_value=0), st.text(max_size=3)), "update_freq"),
    "MLflowLogger(log_checkpoint=)": (
        MLP, with_callback(lambda v: MLflowLogger(str(FOLDER / "ml"), log_checkpoint=v)),
        not_a_bool(), "log_checkpoint"),
    "CSVLogger(filename=)": (MLP, with_callback(CSVLogger),
                             st.sampled_from([str(FOLDER), str(FILE / "log.csv"), "", 5]),
                             "filename"),
    "CSVLogger(append=)": (MLP, with_callback(lambda v: CSVLogger(str(FOLDER / "l.csv"),
                                                                   append=v)),
                           not_a_bool(), "append"),
    "fit(reproducible=)": (MLP, lambda v: fit_mlp(reproducible=v, micro_batch_size=4),
                           not_a_bool(), "reproducible"),
    "fit(micro_batch_size=)": (MLP, lambda v: fit_mlp(reproducible=True, micro_batch_size=v),
                               st.one_of(not_a_count(1), st.sampled_from([3, 5, 7, 16])),
                               "micro_batch_size"),
    "fit(batch_size=) with a DataLoader": (
        MLP, lambda v: MLP.fit(LOADER, batch_size=v, epochs=2, verbose=0),
        st.integers(1, 64).filter(lambda v: v != 8), "batch_size"),
    "compile(activation_checkpointing=)": (
        MLP, lambda v: MLP.compile(optimizer="adam", activation_checkpointing=v),
        st.sampled_from([nn.Linear, [nn.Conv2d], ["Linear"], [3], [nn.Linear(1, 1)], "x"]),
        "activation_checkpointing"),
    "compile(forward_kwargs=)": (
        MLP, lambda v: MLP.compile(optimizer="adam", forward_kwargs=v),
        st.sampled_from([3, "x", [("a", 1)], {1: 2}]), "forward_kwargs"),
}


PREPARE = {"compile(loss_items=<callable>)": count_returning}  # run before the snapshot


def outcome(case: str, value: Any) -> str:
    """``"clear"``, or what went wrong: ``accepted``, ``unclear: <error>`` (another kind of
    error, or a message without the argument or what it got) or ``changed``."""
    model, call, _, name = CASES[case]
    if case in PREPARE:
        PREPARE[case](value)
    before = state(model)
    try:
        call(value)
    except (TypeError, ValueError) as err:
        text = str(err)
        if name not in text or ": got " not in text:
            return f"unclear: {type(err).__name__}: {text[:200]}"
    except Exception as err:  # noqa: BLE001 - the probe counts what escapes
        return f"unclear: {type(err).__name__}: {str(err)[:200]}"
    else:
        return "accepted"
    return "clear" if same(state(model), before) else "changed"


@pytest.fixture(scope="module", autouse=True)
def _release_replicas():
    """The module's trained models let their device threads go when its tests end
    (tests/model/test_lifecycle.py counts the threads left)."""
    yield
    for model in (MLP, OWN):
        model.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bad_arguments_of_round_four_raise_naming_them_and_change_nothing(data):
    case = data.draw(st.sampled_from(sorted(CASES)), label="call")
    value = data.draw(CASES[case][2], label="value")
    result = outcome(case, value)
    assert result == "clear", f"{case} with {value!r}: {result}"


def main(examples: int) -> None:
    """Draw ``examples`` bad calls and print the clear-error rate, and every other outcome."""
    results: list[tuple[str, Any, str]] = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def draw(data: Any) -> None:
        case = data.draw(st.sampled_from(sorted(CASES)))
        value = data.draw(CASES[case][2])
        results.append((case, value, outcome(case, value)))

    draw()
    clear = sum(r == "clear" for _, _, r in results)
    for case, value, result in results:
        if result != "clear":
            print(f"{case} = {value!r}: {result}")
    print(f"{clear}/{len(results)} clear ({100 * clear / len(results):.1f}%) over "
          f"{len({c for c, _, _ in results})} arguments")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
