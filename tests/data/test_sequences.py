"""Variable-length data end to end (issue 22): a per-token tagger (batch-first) and a
time-major GRU language model train, evaluate, predict and export through a BucketIterator
with automatic buckets, on one and two CPU replicas, each number equal to a hand-written loop
over the same batches."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

import fitdp

VOCAB, CLASSES, EPOCHS = 30, 3, 2


def _sentences(n: int = 120) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (int(k),), generator=g)
            for k in torch.randint(3, 30, (n,), generator=g)]


class Tagger(nn.Module):
    """(batch, time) tokens -> (batch, classes, time) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(tokens))
        return self.head(h).transpose(1, 2)


class TimeMajorLM(nn.Module):
    """(time, batch) tokens -> (time, batch, vocab) next-token logits (nn.GRU's own layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.gru = nn.GRU(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(tokens))
        return self.head(h)


def _lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100)


CASES = {
    # name: (module class, iterator layout, loss, labels of a sentence, class axis, batch axis)
    "tagger": (Tagger, "NT", "cross_entropy", lambda s: (s + F.pad(s[:-1], (1, 0))) % CLASSES,
               1, 0),
    "lm": (TimeMajorLM, "TN", fitdp.TokenMean(_lm_loss), lambda s: torch.cat(
        [s[1:], torch.tensor([-100])]), -1, 1),
}


def _data(case: str, shuffle: bool = True) -> fitdp.BucketIterator:
    _, layout, _, labels, _, _ = CASES[case]
    sentences = _sentences()
    return fitdp.BucketIterator(sentences, [labels(s) for s in sentences], batch_size=16,
                                seed=3, layout=layout, shuffle=shuffle)


def _hand(case: str) -> tuple[nn.Module, list[float], float, float]:
    """One device by hand: weights, per-epoch token-mean loss, token accuracy of evaluate."""
    cls, _, _, _, cdim, _ = CASES[case]
    torch.manual_seed(1)
    net = cls()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    it, losses = _data(case), []
    for epoch in range(EPOCHS):
        it.set_epoch(epoch)
        total = tokens = 0.0
        for batch in it:
            logits = net(batch.data)
            loss = F.cross_entropy(logits.movedim(cdim, 1), batch.label)  # mean over tokens
            opt.zero_grad()
            loss.backward()
            opt.step()
            n = int((batch.label != -100).sum())
            total, tokens = total + loss.item() * n, tokens + n
        losses.append(total / tokens)
    right = seen = 0
    with torch.no_grad():
        for batch in _data(case, shuffle=False):
            pred = net(batch.data).argmax(cdim)
            kept = batch.label != -100
            right, seen = right + int((pred == batch.label)[kept].sum()), seen + int(kept.sum())
    return net, losses, right / seen, 0.0


def _model(case: str) -> fitdp.Model:
    cls, _, loss, _, _, _ = CASES[case]
    torch.manual_seed(1)
    model = fitdp.Model(cls())
    model.compile(optimizer="adam", lr=0.01, loss=loss, metrics={"acc": MulticlassAccuracy(
        num_classes=VOCAB if case == "lm" else CLASSES, ignore_index=-100, average="micro")})
    return model


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
@pytest.mark.parametrize("case", sorted(CASES))
def test_train_evaluate_predict_equal_a_hand_loop(case: str, devices: list[str]) -> None:
    """Regression (issue 22.1-22.4): predict of a tagger over several buckets crashed,
    time-major predict reordered the time axis, a custom per-token loss on 2 replicas trained
    another update, the logged loss depended on the device count, metrics failed on (T, N, C)."""
    net, losses, accuracy, _ = _hand(case)
    model = _model(case)
    assert len(_data(case).buckets) > 1  # automatic buckets, several of them
    history = model.fit(_data(case), epochs=EPOCHS, devices=devices, verbose=0).history
    for name, p in net.state_dict().items():
        torch.testing.assert_close(model.module.state_dict()[name], p, atol=2e-6, rtol=1e-5)
    assert history["loss"] == pytest.approx(losses, rel=1e-5)
    logs = model.evaluate(_data(case, shuffle=False), devices=devices, verbose=0)
    assert logs["acc"] == pytest.approx(accuracy, abs=1e-6)

    _, _, _, _, cdim, axis = CASES[case]
    sentences = _sentences()
    preds = model.predict(_data(case), devices=devices, pad_value=float("nan"))
    ragged = model.predict(_data(case), devices=devices, ragged=True)
    assert preds.shape[axis] == len(sentences) == len(ragged)
    longest = max(len(s) for s in sentences)
    buckets = torch.tensor(_data(case).buckets)
    with torch.no_grad():
        for i, s in enumerate(sentences):
            x = s[None] if axis == 0 else s[:, None]
            want = net(x).select(axis, 0)  # (classes, time) or (time, vocab)
            t = 1 if cdim == 1 else 0  # the time axis of one sample's output
            got = preds.select(axis, i)
            assert got.shape[t] == longest
            torch.testing.assert_close(got.narrow(t, 0, len(s)), want, atol=1e-5, rtol=1e-5)
            width = int(buckets[torch.searchsorted(buckets, len(s))])  # its batch's length
            assert bool(got.narrow(t, width, longest - width).isnan().all())  # the pad value
            assert ragged[i].shape[t] == width
            torch.testing.assert_close(ragged[i].narrow(t, 0, len(s)), want, atol=1e-5,
                                       rtol=1e-5)


def test_predict_time_major_index_follows_the_batch_axis() -> None:
    """Regression (issue 22.2): time-major batches that carry `index` were reordered along
    the time axis (T >= N: wrong rows; T < N: IndexError)."""
    model = fitdp.Model(TimeMajorLM())
    seqs = [torch.arange(1, 3 + i % 5) for i in range(10)]  # T < N and T >= N batches
    for batch_size in (2, 8):
        it = fitdp.BucketIterator(seqs, None, batch_size=batch_size, buckets=[3, 7],
                                  layout="TN", seed=0)
        preds = model.predict(it, devices=["cpu"], ragged=True)
        with torch.no_grad():
            for s, got in zip(seqs, preds):
                torch.testing.assert_close(got[: len(s)], model.module(s[:, None])[:, 0])


def test_layout_tn_batches_are_time_major() -> None:
    """Issue 22.5: layout="TN" as MXNet's BucketSentenceIter (apache/mxnet,
    python/mxnet/rnn/io.py: ``major_axis = layout.find('N')``; data and label ``.T``;
    ``provide_data`` ``(default_bucket_key, batch_size)``)."""
    seqs = [torch.arange(1, n + 1) for n in (3, 5, 2, 7)]
    tn = fitdp.BucketIterator(seqs, [s % 2 for s in seqs], 2, buckets=[4, 8], shuffle=False,
                              layout="TN", include_lengths=True)
    nt = fitdp.BucketIterator(seqs, [s % 2 for s in seqs], 2, buckets=[4, 8], shuffle=False,
                              include_lengths=True)
    for a, b in zip(tn, nt):
        assert a.layout == "TN" and a.axis == 1
        torch.testing.assert_close(a.data[0], b.data[0].T)
        torch.testing.assert_close(a.label, b.label.T)
        torch.testing.assert_close(a.data[1], b.data[1])  # lengths stay (batch,)
    assert tn.provide_data[0].shape == (8, 2) and tn.provide_label[0].shape == (8, 2)
    with pytest.raises(ValueError, match="layout"):
        fitdp.BucketIterator(seqs, None, 2, layout="NTC")
    with pytest.raises(ValueError, match="layout='TN'"):
        fitdp.BucketIterator(seqs, torch.zeros(4, 3), 2, layout="TN")


class ConvTagger(nn.Module):
    """A tagger torch.export can trace at any length: (batch, time) -> (batch, classes, time)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.conv = nn.Conv1d(8, CLASSES, 3, padding=1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.conv(self.emb(tokens).transpose(1, 2))


def test_export_keeps_the_sequence_axis_dynamic(tmp_path: Path) -> None:
    """Regression (issue 22.6): an export fixed every dim but the batch (exported at T=12, a
    tagger refused T=20); a model trained on buckets exports its sequence axis dynamic."""
    model = fitdp.Model(ConvTagger())
    model.compile(optimizer="adam", loss="cross_entropy")
    model.fit(_data("tagger"), epochs=1, devices=["cpu"], verbose=0)
    model.export(tmp_path / "m.pt2", torch.randint(1, VOCAB, (4, 12)))
    predictor = fitdp.load_predictor(tmp_path / "m.pt2")
    for n, t in ((3, 20), (7, 5)):
        x = torch.randint(1, VOCAB, (n, t))
        with torch.no_grad():
            torch.testing.assert_close(predictor(x), model.module.eval()(x))


def test_export_of_a_time_major_gru(tmp_path: Path) -> None:
    """Issue 22.6: a time-major GRU exports with its batch (axis 1) dynamic; torch.export
    unrolls nn.GRU over time (pytorch/pytorch#115092), so the length stays the example's,
    and the export says so."""
    model = _model("lm")
    model.fit(_data("lm"), epochs=1, devices=["cpu", "cpu"], verbose=0)
    with pytest.warns(fitdp.checks.FitdpWarning, match="length 12 only"):
        model.export(tmp_path / "m.pt2", torch.randint(1, VOCAB, (12, 1)))
    predictor = fitdp.load_predictor(tmp_path / "m.pt2")
    x = torch.randint(1, VOCAB, (12, 5))
    with torch.no_grad():
        torch.testing.assert_close(predictor(x), model.module.eval()(x), atol=1e-5, rtol=1e-5)


def test_export_dynamic_shapes_by_argument(tmp_path: Path) -> None:
    """Issue 22.6: Model.export(dynamic_shapes=...) follows torch.export's semantics."""
    model = fitdp.Model(ConvTagger())
    seq = torch.export.Dim("seq", min=2, max=64)
    model.export(tmp_path / "t.pt2", torch.randint(1, VOCAB, (4, 12)),
                 dynamic_shapes=({0: torch.export.Dim("batch"), 1: seq},))
    predictor = fitdp.load_predictor(tmp_path / "t.pt2")
    x = torch.randint(1, VOCAB, (3, 40))
    with torch.no_grad():
        torch.testing.assert_close(predictor(x), model.module.eval()(x))
    with pytest.raises(TypeError, match="dynamic_shapes"):
        model.export(tmp_path / "u.pt2", torch.randint(1, VOCAB, (4, 12)), dynamic_shapes=3)


class TimeMajorWithLengths(nn.Module):
    """(time, batch) tokens and (batch,) lengths -> (batch, vocab): the last valid step."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TimeMajorLM()

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out = self.lm(tokens)
        return out[lengths - 1, torch.arange(out.shape[1])]


def test_predictor_of_time_major_inputs_with_lengths(tmp_path: Path) -> None:
    """Issue 22.6: the predictor checked the batch size on dim 0 of every input, which for
    (time, batch) tokens and (batch,) lengths is the time; it compares the shared dims."""
    model = fitdp.Model(TimeMajorWithLengths())
    sentences = _sentences()
    it = fitdp.BucketIterator(sentences, torch.zeros(len(sentences), dtype=torch.long), 16,
                              layout="TN", include_lengths=True, seed=0)
    model.compile(optimizer="sgd", loss="cross_entropy")
    model.fit(it, epochs=1, devices=["cpu"], verbose=0)
    x = (torch.randint(1, VOCAB, (12, 4)), torch.tensor([12, 3, 5, 1]))
    with pytest.warns(fitdp.checks.FitdpWarning, match="length 12 only"):
        model.export(tmp_path / "m.pt2", x)
    predictor = fitdp.load_predictor(tmp_path / "m.pt2")
    y = (torch.randint(1, VOCAB, (12, 6)), torch.tensor([1, 2, 3, 4, 5, 12]))
    with torch.no_grad():
        torch.testing.assert_close(predictor(*y), model.module.eval()(*y))
    with pytest.raises(ValueError, match="disagree on the batch size"):
        predictor(torch.randint(1, VOCAB, (12, 6)), torch.tensor([1, 2]))



@pytest.mark.parametrize("devices", [["cpu"], ["cpu"] * 3])
def test_time_major_classifier_gets_batch_first_metrics_and_predict_rows(
        devices: list[str]) -> None:
    """Issue 28 item 6: with (time, batch) tokens and one label per sequence, a classifier's
    (N, C) outputs reached metrics as (C, N) and predict reordered them on C (an index error
    on 1 replica, a cat size mismatch on 3); bucketing.md promises batch-first outputs for
    metrics and rows back in order on N. Each number equals the module run per sentence."""
    sentences = _sentences(60)
    labels = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(5))

    def batches(shuffle: bool) -> fitdp.BucketIterator:
        return fitdp.BucketIterator(sentences, labels, 8, layout="TN", include_lengths=True,
                                    seed=0, shuffle=shuffle)

    torch.manual_seed(1)
    model = fitdp.Model(TimeMajorWithLengths())
    model.compile(optimizer="sgd", loss="cross_entropy", lr=0.1, metrics={
        "acc": MulticlassAccuracy(num_classes=VOCAB, average="micro")})
    history = model.fit(batches(True), epochs=1, devices=devices, verbose=0)
    assert 0.0 <= history.history["acc"][0] <= 1.0
    preds = model.predict(batches(False), devices=devices)
    logs = model.evaluate(batches(False), devices=devices, verbose=0)
    net = model.module.eval()
    with torch.no_grad():
        ref = torch.cat([net(s[:, None], torch.tensor([len(s)])) for s in sentences])
    torch.testing.assert_close(preds, ref, atol=1e-5, rtol=1e-5)
    assert logs["acc"] == pytest.approx(float((ref.argmax(1) == labels).float().mean()))
    assert logs["loss"] == pytest.approx(float(F.cross_entropy(ref, labels)), rel=1e-5)

def test_custom_loss_on_padded_tokens_without_a_declaration_warns() -> None:
    """Regression (issue 22.3): a custom per-token loss on 2 replicas silently trained another
    update (weighed by rows); undeclared, it now warns, and TokenMean does not."""
    with pytest.warns(fitdp.checks.FitdpWarning, match="TokenMean"):
        model = fitdp.Model(TimeMajorLM())
        model.compile(optimizer="sgd", loss=_lm_loss)
        model.fit(_data("lm"), epochs=1, devices=["cpu", "cpu"], verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fitdp.checks.FitdpWarning)
        model = fitdp.Model(TimeMajorLM())
        model.compile(optimizer="sgd", loss=fitdp.TokenMean(_lm_loss))
        model.evaluate(_data("lm"), devices=["cpu"], verbose=0)


def test_onnx_export_keeps_the_sequence_axis_dynamic(tmp_path: Path) -> None:
    """Issue 22.6: the ONNX file made from a bucketed tagger's exported program runs at
    sequence lengths other than the example's (onnxruntime against the module)."""
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model = fitdp.Model(ConvTagger())
    model.compile(optimizer="adam", loss="cross_entropy")
    model.fit(_data("tagger"), epochs=1, devices=["cpu"], verbose=0)
    model.export(tmp_path / "m.pt2", torch.randint(1, VOCAB, (4, 12)))
    program = fitdp.load_predictor(tmp_path / "m.pt2").program
    torch.onnx.export(program, f=str(tmp_path / "m.onnx"), dynamo=True)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    for n, t in ((3, 20), (7, 5)):
        x = torch.randint(1, VOCAB, (n, t))
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            want = model.module.eval()(x)
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1e-5)
