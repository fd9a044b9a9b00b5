"""``TokenView`` (what the metrics of ``compile(loss=None)`` read) and ``head_of`` (a
transformers head known by its class name), without a model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from fitdp.compiled.own_loss import head_of
from fitdp.compiled.token_view import TokenView


def test_per_token_pairs_are_rows_shifted_for_a_causal_lm() -> None:
    """transformers' ForCausalLMLoss pairs logits[:, :-1] with labels[:, 1:]."""
    logits = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)
    labels = torch.tensor([[0, 1, 2], [3, -100, -100]])
    rows, targets = TokenView(shift=True)(logits, labels)
    assert rows.data_ptr() == logits.data_ptr()  # a view: an LM's logits are not copied
    rows, targets = TokenView(shift=False).kept(None, rows, targets)
    torch.testing.assert_close(rows, torch.stack([logits[0, 0], logits[0, 1]]))
    assert targets.tolist() == [1, 2]


def test_row_labels_and_metrics_ignoring_minus_100_are_left_as_they_are() -> None:
    logits, labels = torch.zeros(3, 4), torch.tensor([0, -100, 2])
    assert TokenView(shift=True)(logits, labels) == (logits, labels)
    metric = MulticlassAccuracy(num_classes=4, ignore_index=-100)
    kept = TokenView(shift=False).kept(metric, logits, labels)
    assert kept[1] is labels  # the metric skips -100 itself: no boolean indexing


def test_per_token_labels_of_another_length_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"labels of shape \(2, 5\).*DataCollatorForToken"):
        TokenView(shift=False)(torch.zeros(2, 6, 3), torch.zeros(2, 5, dtype=torch.long))


def _transformers_class(name: str) -> type:
    return type(name, (nn.Module,), {"__module__": "transformers.models.x.modeling_x"})


@pytest.mark.parametrize("name,items", [
    ("GPT2LMHeadModel", "causal_lm"), ("LlamaForCausalLM", "causal_lm"),
    ("BertForMaskedLM", "tokens"), ("BertForTokenClassification", "tokens"),
    ("BertForSequenceClassification", None)])
def test_known_heads_by_class_name(name, items) -> None:
    head = _transformers_class(name)
    subclass = type("Mine", (head,), {})  # a user's subclass: its transformers base counts
    assert head_of(head()) == head_of(subclass()) == (name, items)


def test_other_modules_have_no_head() -> None:
    assert head_of(_transformers_class("BertModel")()) is None
    assert head_of(type("MyForCausalLM", (nn.Module,), {})()) is None  # not transformers'
