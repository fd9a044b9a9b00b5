"""What a user passes as data is classified once and converted once (issue 30 item 7): the
kinds ``read_data`` tells apart, the one walk of a fit's data, and the validation split cut
from the converted tensors (Keras 3's ``validation_split``: the last samples, before any
shuffling), with the messages a bad input gets."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import fitdp
from fitdp.data.sources.make import Kind, read_data

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(20, 4, generator=G), torch.randint(0, 3, (20,), generator=G)
DATA = Path(fitdp.__file__).resolve().parent / "data"


class Stream(IterableDataset):
    def __iter__(self):
        yield from zip(X, Y)


def make_model(loss: str | None = "cross_entropy") -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Linear(4, 3))
    model.compile(optimizer="sgd", loss=loss, lr=0.1)
    return model


FORMS = [
    ("tensor", lambda: (X, Y), Kind.TENSORS),
    ("numpy", lambda: (X.numpy(), Y.numpy()), Kind.TENSORS),
    ("(x, y) tuple", lambda: ((X, Y), None), Kind.TENSORS),
    ("dict of tensors", lambda: ({"input_ids": X, "labels": Y}, None), Kind.TENSORS),
    ("Dataset", lambda: (TensorDataset(X, Y), None), Kind.DATASET),
    ("IterableDataset", lambda: (Stream(), None), Kind.STREAM),
    ("DataLoader", lambda: (DataLoader(TensorDataset(X, Y), batch_size=5), None),
     Kind.BATCHES),
    ("list of DataBatch", lambda: ([fitdp.DataBatch(X, Y)], None), Kind.BATCHES),
    ("generator", lambda: ((fitdp.DataBatch(X, Y) for _ in range(2)), None), Kind.GENERATOR),
    ("BucketIterator", lambda: (fitdp.BucketIterator([[1, 2], [3]], [0, 1], batch_size=2),
                                None), Kind.SOURCE),
    ("list of row dicts", lambda: ([{"input_ids": X[i], "labels": Y[i]} for i in range(20)],
                                   None), Kind.DATASET),
]


@pytest.mark.parametrize("form,kind", [(f, k) for _, f, k in FORMS],
                         ids=[name for name, _, _ in FORMS])
def test_every_form_fit_accepts_is_one_kind(form, kind):
    x, y = form()
    data = read_data(x, y, labels_optional=True)
    assert data.kind is kind
    if kind is Kind.TENSORS:  # converted: numpy to tensors, a tuple to inputs and targets
        leaves = data.x.values() if isinstance(data.x, dict) else [data.x]
        assert all(isinstance(t, torch.Tensor) for t in leaves)
        assert data.y is None or torch.equal(data.y, Y)
    else:
        assert data.x is x  # the user's object, read as it is


def trace_data_layer(fit) -> list[str]:
    """Every named function of fitdp/data that runs during ``fit``, in order, with the
    ``name`` argument of each ``as_tensors``."""
    calls: list[str] = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or code.co_name.startswith("<"):
            return
        path = Path(code.co_filename)
        if DATA in path.parents:
            where = f"{path.relative_to(DATA).as_posix()}:{code.co_qualname}"
            if code.co_name == "as_tensors":
                where += f"({frame.f_locals['name']})"
            calls.append(where)

    sys.setprofile(profile)
    try:
        fit()
    finally:
        sys.setprofile(None)
    return calls


def test_validation_split_is_cut_from_the_converted_data_not_read_again():
    """Regression (issue 30 item 7): the split converted x and y, then each half went back
    through make_source to be classified, converted and scanned for NaN again."""
    x, y = X.numpy().astype(np.float64), Y.numpy()
    calls = trace_data_layer(lambda: make_model().fit(
        x, y, validation_split=0.2, batch_size=5, epochs=1, verbose=0, devices=["cpu"]))
    made = [c.split(":")[1] for c in calls if c.startswith("sources/make.py:")]
    assert [c for c in made if c in ("read_data", "_kind", "UserData.split",
                                     "UserData.source")] == [
        "read_data", "_kind", "UserData.split", "UserData.source", "UserData.source"]
    converted = [c for c in calls if c.startswith("sources/convert.py:as_tensors")]
    assert converted == ["sources/convert.py:as_tensors(x)", "sources/convert.py:as_tensors(y)"]
    assert calls.count("sources/convert.py:check_finite") == 2  # x and y, once each


def test_validation_split_validates_on_the_tail_without_class_weights():
    """Keras 3: ``validation_split`` validates on the last ``n - floor(n * (1 - split))``
    samples, and ``class_weight`` weighs training only; the validation loss is then the
    plain mean cross-entropy of the tail under the weights the epoch ends with."""
    model = make_model()
    h = model.fit(X.numpy(), Y.numpy(), validation_split=0.25, class_weight={0: 3.0, 2: 0.5},
                  batch_size=4, epochs=1, shuffle=False, verbose=0, devices=["cpu"])
    with torch.no_grad():
        expected = F.cross_entropy(model.module(X[15:]), Y[15:])
    assert h.history["val_loss"][0] == pytest.approx(float(expected), rel=1e-5)


def test_validation_split_with_rows_that_differ_names_x_and_y():
    """Regression: x of 20 rows and y of 19 with validation_split was cut first, then
    refused as "y: got 3 rows; expected 4 rows, one per sample of validation_data", naming
    data the user never passed."""
    with pytest.raises(ValueError) as err:
        make_model().fit(X, Y[:19], validation_split=0.2, verbose=0)
    assert str(err.value).startswith("y: got 19 rows; expected 20 rows, one per sample of x")


def test_nan_in_the_validation_tail_is_named_by_its_row_of_x():
    """Regression: a NaN in the split-off tail was reported as "validation_data: got nan
    in row 2", a row of a tensor the user never made."""
    bad = X.clone()
    bad[18, 1] = float("nan")
    with pytest.raises(ValueError) as err:
        make_model().fit(bad, Y, validation_split=0.2, verbose=0)
    assert str(err.value).startswith("x: got nan in row 18")


DL = DataLoader(TensorDataset(X, Y), batch_size=5)
REFUSED = [  # the messages before the data layer classified its input once
    ("y with a DataLoader", dict(x=DL, y=Y), ValueError,
     "y: got a value together with x of type DataLoader; expected y=None: that DataLoader "
     "yields its own targets."),
    ("sample_weight with a Dataset", dict(x=TensorDataset(X, Y), sample_weight=torch.ones(20)),
     ValueError, "sample_weight: got a value together with x of type TensorDataset; expected "
     "sample_weight=None: that TensorDataset yields its own weights."),
    ("an empty Dataset", dict(x=TensorDataset(X[:0], Y[:0])), ValueError,
     "x: got an empty Dataset; expected at least one sample."),
    ("an empty list", dict(x=[]), TypeError, "x: got [] (list); expected a tensor, a numpy "
     "array, or a tuple/list/dict of them."),
    ("a split of a Dataset", dict(x=TensorDataset(X, Y), validation_split=0.2), ValueError,
     "validation_split: got 0.2; expected in-memory x and y (tensors or arrays). Fix: pass "
     "validation_data= for Datasets, DataLoaders and iterators."),
    ("a split of a stream", dict(x=Stream(), validation_split=0.2), ValueError,
     "validation_split: got 0.2; expected in-memory x and y"),
    ("a split and validation_data", dict(x=X, y=Y, validation_split=0.2,
                                         validation_data=(X, Y)), ValueError,
     "validation_split: got 0.2; expected validation_split or validation_data, not both."),
    ("a split too small to cut", dict(x=X[:1], y=Y[:1], validation_split=0.2), ValueError,
     "validation_split: got 0.2; expected a fraction that leaves at least one of the 1 "
     "samples on each side (it gives 0 to train, 1 to validate)"),
    ("a generator for 2 epochs", dict(x=(fitdp.DataBatch(X, Y) for _ in range(2)), epochs=2),
     ValueError, "x: got a one-shot iterator (generator); expected data that can be iterated "
     "2 times, or steps_per_epoch."),
    ("y with a loader as validation_data", dict(x=X, y=Y, validation_data=(DL, Y)), ValueError,
     "y: got a value together with validation_data of type DataLoader;"),
    ("NaN in validation targets", dict(x=X, y=Y, validation_data=(
        X, torch.full((20,), float("nan")))), ValueError,
     "validation_data targets: got nan in row 0"),
]


@pytest.mark.parametrize("kwargs,exc,words", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_bad_data_is_refused_with_the_same_words(kwargs, exc, words):
    with pytest.raises(exc) as err:
        make_model().fit(verbose=0, batch_size=5, devices=["cpu"], **kwargs)
    assert str(err.value).startswith(words), str(err.value)


class CountingLoader(DataLoader):
    """A DataLoader that counts its iterators (each starts its workers when it has some)."""

    iterators = 0

    def __iter__(self):
        CountingLoader.iterators += 1
        return super().__iter__()


def test_reading_a_dataloader_starts_no_iterator():
    """Regression: the source of a DataLoader asked ``iter(loader) is loader`` to tell a
    generator from it, which starts and drops the loader's worker processes (0.2 s for two
    workers on this project's CPU) before the first epoch starts them again."""
    loader = CountingLoader(TensorDataset(X, Y), batch_size=5)
    source = fitdp.data.sources.make_source(loader, batch_size=5, shuffle=False, seed=0)
    assert CountingLoader.iterators == 0
    assert [b.batch_size for b in source] == [5, 5, 5, 5]
    assert CountingLoader.iterators == 1


def test_a_list_of_dicts_is_rows_and_trains_as_the_same_dataset() -> None:
    """The list-of-dicts ambiguity, decided in ``KINDS``: each dict is one sample (as torch's
    DataLoader and transformers' Trainer read a list), batched and shuffled as a Dataset of
    the same dicts; not several inputs (a tuple) nor dict batches (a DataLoader)."""
    rows = [{"input": X[i], "target": Y[i]} for i in range(20)]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return rows[i]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, input, target):
            return {"loss": F.cross_entropy(self.lin(input), target), "logits": self.lin(input)}

    def fit(x):
        torch.manual_seed(0)
        model = fitdp.Model(Net())
        model.compile(optimizer="sgd", loss=None, lr=0.1)
        return model, model.fit(x, batch_size=6, epochs=2, seed=1, verbose=0,
                                devices=["cpu", "cpu"]).history

    (a, ha), (b, hb) = fit(rows), fit(Rows())
    assert ha == hb
    assert all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))


def test_the_first_kind_whose_test_holds_is_the_datas() -> None:
    """``KINDS`` is tried in order: a Hugging Face dataset (its stream is a torch
    IterableDataset too) is read as one before the stream and Dataset entries."""
    from fitdp.data.sources.make import KINDS

    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["a", "b"], "input_ids": [[1], [2]]})
    order = [k.kind for k in KINDS]
    assert order.index(Kind.HF) < order.index(Kind.STREAM) < order.index(Kind.DATASET)
    for x in (ds, ds.to_iterable_dataset()):
        assert read_data(x, labels_optional=True).kind is Kind.HF
        assert [k.kind for k in KINDS if k.test(x)][0] is Kind.HF
