"""Token-level metrics of transformers models (issue 38, item 3) and ``loss_items`` checked
against the labels (item 4).

A token classifier's or an LM's logits are ``(batch, length, classes)``, class last;
torchmetrics reads the classes on axis 1. With ``compile(loss=None)`` fitdp reads the
model's logits as transformers does: one row per labelled position, -100 dropped, a causal
LM's pairs shifted (``logits[:, :-1]`` against ``labels[:, 1:]``, as transformers'
``ForCausalLMLoss`` shifts). The reference is the hand computation a transformers user
writes on ``model(**batch).logits`` (Trainer's ``compute_metrics`` on
``predictions[labels != -100]``).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

import fitdp
from fitdp.checks import FitdpWarning

transformers = pytest.importorskip("transformers")

ROWS, BATCH = 16, 8


def _tagger(classes: int) -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForTokenClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, num_labels=classes))


def _gpt2(vocab: int = 30) -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0,
        eos_token_id=0))


def _padded(length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and attention mask of rows of 2..length tokens, padded at the end; the short rows
    in the second half, so two replicas' slices hold different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.cat([torch.full((ROWS // 2,), length),
                         torch.randint(2, 4, (ROWS // 2,), generator=g)])
    mask = (torch.arange(length) < lengths[:, None]).long()
    return torch.randint(1, vocab, (ROWS, length), generator=g) * mask, mask


def tagging(length: int, classes: int) -> dict[str, torch.Tensor]:
    ids, mask = _padded(length, 40, 1)
    tags = torch.randint(0, classes, ids.shape, generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "attention_mask": mask, "labels": tags.masked_fill(mask == 0, -100)}


def causal(length: int, vocab: int = 30) -> dict[str, torch.Tensor]:
    ids, mask = _padded(length, vocab, 3)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _logits(module: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        return module(**{k: v for k, v in data.items() if k != "labels"}).logits


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """By hand: the labelled positions whose argmax is the label."""
    keep = labels != -100
    return (logits.argmax(-1)[keep] == labels[keep]).float().mean().item()


def _macro_f1(logits: torch.Tensor, labels: torch.Tensor, classes: int) -> float:
    """By hand: the mean over the classes of 2 TP / (2 TP + FP + FN) on the labelled
    positions (torchmetrics' macro F1)."""
    keep = labels != -100
    pred, true = logits.argmax(-1)[keep], labels[keep]
    f1 = []
    for c in range(classes):
        tp = ((pred == c) & (true == c)).sum().item()
        fp = ((pred == c) & (true != c)).sum().item()
        fn = ((pred != c) & (true == c)).sum().item()
        f1.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return sum(f1) / classes


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_a_padded_length_equal_to_the_classes_is_no_longer_read_as_them(devices) -> None:
    """Regression: a token classifier's class-last logits (8, 6, 6) were read with the
    length as the class axis, and "accuracy" and MulticlassAccuracy(ignore_index=-100) gave
    wrong numbers without a word (issue 38: 0.26 against 0.985)."""
    data = tagging(6, 6)
    model = fitdp.Model(_tagger(6))
    model.compile("sgd", loss=None, loss_items="tokens", metrics={
        "accuracy": "accuracy",
        "ignoring": MulticlassAccuracy(num_classes=6, average="micro", ignore_index=-100)})
    logs = model.evaluate(data, batch_size=BATCH, devices=devices, verbose=0)
    expected = _accuracy(_logits(model.module, data), data["labels"])
    assert logs == pytest.approx({"loss": logs["loss"], "accuracy": expected,
                                  "ignoring": expected}, abs=1e-6)


@pytest.mark.parametrize("length,classes", [(6, 6), (7, 5)])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_a_taggers_metrics_equal_the_hand_computation(length, classes, devices) -> None:
    """Regression: a token classifier's class-last logits failed torchmetrics' check (classes
    on axis 1) with a fix pointing at num_classes. Now a Keras name and torchmetrics objects
    with and without ignore_index equal the hand computation on the labelled tokens (-100
    dropped), with the padded length equal to the classes or not, on 1 and 2 replicas."""
    data = tagging(length, classes)
    model = fitdp.Model(_tagger(classes))
    model.compile("sgd", loss=None, loss_items="tokens", metrics={
        "accuracy": "accuracy",
        "micro": MulticlassAccuracy(num_classes=classes, average="micro"),
        "ignoring": MulticlassAccuracy(num_classes=classes, average="micro", ignore_index=-100),
        "f1": MulticlassF1Score(num_classes=classes, average="macro"),
    })
    logs = model.evaluate(data, batch_size=BATCH, devices=devices, verbose=0)
    logits = _logits(model.module, data)
    expected = _accuracy(logits, data["labels"])
    assert logs["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert logs["micro"] == pytest.approx(expected, abs=1e-6)
    assert logs["ignoring"] == pytest.approx(expected, abs=1e-6)
    assert logs["f1"] == pytest.approx(_macro_f1(logits, data["labels"], classes), abs=1e-6)


@pytest.mark.parametrize("loss_items", ["causal_lm", None])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_a_causal_lms_metrics_see_the_shifted_pairs(loss_items, devices) -> None:
    """A causal LM's accuracy is over (logits[:, :-1], labels[:, 1:]) as transformers'
    ForCausalLMLoss pairs them, and "perplexity" is exp of the token-mean loss (the logged
    loss, weighed by the shifted tokens), on 1 and 2 replicas; GPT2LMHeadModel is known to
    shift without loss_items too (its fit is then warned about)."""
    data = causal(8)
    model = fitdp.Model(_gpt2())
    model.compile("sgd", lr=0.1, loss=None, loss_items=loss_items,
                  metrics=["accuracy", "perplexity"], forward_kwargs={"use_cache": False})
    logs = model.evaluate(data, batch_size=BATCH, devices=devices, verbose=0)
    logits = _logits(model.module, data)
    labels = data["labels"][:, 1:]
    assert logs["accuracy"] == pytest.approx(_accuracy(logits[:, :-1], labels), abs=1e-6)
    token_mean = F.cross_entropy(logits[:, :-1].reshape(-1, 30), labels.reshape(-1)).item()
    assert logs["perplexity"] == pytest.approx(math.exp(token_mean), rel=1e-5)
    if loss_items is not None:  # the logged loss is the token mean only when weighed so
        assert logs["perplexity"] == pytest.approx(math.exp(logs["loss"]), rel=1e-5)
    context = pytest.warns(FitdpWarning, match="loss_items='causal_lm'") if loss_items is None \
        else warnings.catch_warnings()
    with context:
        if loss_items is not None:
            warnings.simplefilter("error", FitdpWarning)
        history = model.fit(data, batch_size=BATCH, devices=devices, verbose=0)
    assert history.history["perplexity"][0] > 1.0


def test_a_sequence_classifier_reads_its_rows_as_before() -> None:
    """Row labels (one per sequence) against (batch, classes) logits stay rows."""
    torch.manual_seed(0)
    module = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, num_labels=3))
    ids, mask = _padded(6, 40, 4)
    data = {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(ROWS) % 3}
    model = fitdp.Model(module)
    model.compile("sgd", loss=None, metrics=["accuracy", MulticlassAccuracy(3, average="micro")])
    logs = model.evaluate(data, batch_size=BATCH, devices=["cpu", "cpu"], verbose=0)
    expected = _accuracy(_logits(module, data), data["labels"])
    assert logs["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert logs["multiclass_accuracy"] == pytest.approx(expected, abs=1e-6)


class ClassLast(nn.Module):
    """A plain tagger returning class-last logits (batch, length, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x)


def test_class_last_outputs_with_a_compile_loss_say_how_to_fix_them() -> None:
    """Regression: a metric failing on class-last logits said to set num_classes to the size
    of the last layer (what it already was); now it names the layout and the two fixes."""
    ids, tags = torch.randint(0, 40, (ROWS, 7)), torch.randint(0, 5, (ROWS, 7))
    model = fitdp.Model(ClassLast())
    model.compile("sgd", loss=fitdp.TokenMean(
        lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())),
        metrics=[MulticlassAccuracy(num_classes=5)])
    with pytest.raises(ValueError, match=r"class-last .*logits.transpose\(1, 2\)"):
        model.evaluate(ids, tags, batch_size=BATCH, verbose=0)


def _weights(model: fitdp.Model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.parametrize("loss_items", ["tokens", "causal_lm"])
def test_token_loss_items_on_one_label_per_row_is_refused(loss_items) -> None:
    """Regression: loss_items='causal_lm' on a sequence classifier's labels (one per row)
    counted labels[..., 1:] (one row fewer per slice) and trained another update without a
    word; now the first batch is refused, naming loss_items=None, before any weight moves."""
    torch.manual_seed(0)
    module = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, num_labels=3))
    ids, mask = _padded(6, 40, 5)
    model = fitdp.Model(module)
    model.compile("sgd", loss=None, loss_items=loss_items)
    before = _weights(model)
    with pytest.raises(ValueError, match=r"loss_items: .*one per row.*loss_items=None"):
        model.fit({"input_ids": ids, "attention_mask": mask,
                   "labels": torch.arange(ROWS) % 3}, batch_size=BATCH,
                  devices=["cpu", "cpu"], verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


@pytest.mark.parametrize("make,data,loss_items,needed", [
    (lambda: _tagger(4), lambda: tagging(6, 4), None, "tokens"),
    (_gpt2, lambda: causal(6), None, "causal_lm"),
    (_gpt2, lambda: causal(6), "tokens", "causal_lm"),
    (lambda: _tagger(4), lambda: tagging(6, 4), "causal_lm", "tokens"),
])
def test_a_known_heads_loss_items_are_named(make, data, loss_items, needed) -> None:
    """transformers' heads are known by their class name (no import of transformers): a
    token classifier or causal LM given no or another loss_items is warned about, naming the
    one its loss needs, even when its labels hold no -100."""
    batch = data()
    batch["labels"] = batch["labels"].clamp(min=0)  # no -100: the old warning's only trigger
    model = fitdp.Model(make())
    model.compile("sgd", loss=None, loss_items=loss_items)
    with pytest.warns(FitdpWarning, match=f"loss_items={needed!r}"):
        model.fit(batch, batch_size=BATCH, verbose=0)
