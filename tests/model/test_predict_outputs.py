"""``predict`` keeps a transformers model's output class (issue 38, item 6): the per-row
fields of its ``ModelOutput`` joined over batches come back in that class, so
``preds.logits`` works as after ``model(**batch)``; fields of several lengths (a token
classifier over batches padded to different lengths) are padded with -100, as transformers'
``Trainer`` pads predictions across batches (``nested_concat(..., padding_index=-100)``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fitdp

transformers = pytest.importorskip("transformers")

ROWS, CLASSES = 12, 3


def _tagger() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForTokenClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, num_labels=CLASSES))


def _batches() -> list[dict[str, torch.Tensor]]:
    """Three collated batches, each padded to its own longest row (7, 4, 5 tokens)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for length in (7, 4, 5):
        lengths = torch.randint(2, length + 1, (4,), generator=g)
        lengths[0] = length
        mask = (torch.arange(length) < lengths[:, None]).long()
        out.append({"input_ids": torch.randint(1, 40, (4, length), generator=g) * mask,
                    "attention_mask": mask})
    return out


def _by_hand(module: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    module.eval()
    with torch.no_grad():
        return [module(**b).logits for b in batches]


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_a_token_classifiers_predictions_keep_their_class_and_mark_the_padding(devices):
    """Regression: predict gave a plain dict (``preds.logits`` raised AttributeError) and
    padded the batches' logits with 0.0, which reads as real logits (class 0 at argmax)."""
    batches = _batches()
    model = fitdp.Model(_tagger())
    preds = model.predict(iter(batches), devices=devices)
    assert type(preds) is transformers.modeling_outputs.TokenClassifierOutput
    assert preds.loss is None and list(preds.keys()) == ["logits"]
    assert tuple(preds.logits.shape) == (ROWS, 7, CLASSES)
    for i, expected in enumerate(_by_hand(model.module, batches)):
        rows, length = slice(4 * i, 4 * i + 4), expected.shape[1]
        torch.testing.assert_close(preds.logits[rows, :length], expected)
        assert bool((preds.logits[rows, length:] == -100).all())
    nan = model.predict(iter(batches), devices=devices, pad_value=float("nan"))
    assert bool(nan.logits[4:8, 4:].isnan().all()) and not bool(nan.logits[:4].isnan().any())


def test_ragged_predictions_are_one_output_of_the_class_per_sample() -> None:
    """``ragged=True``: a list with one ModelOutput per sample, at its batch's length."""
    batches = _batches()
    model = fitdp.Model(_tagger())
    preds = model.predict(iter(batches), ragged=True)
    second = _by_hand(model.module, batches)[1]  # (4 rows, 4 tokens, classes)
    assert len(preds) == ROWS
    assert all(type(p) is transformers.modeling_outputs.TokenClassifierOutput for p in preds)
    torch.testing.assert_close(preds[4].logits, second[0])


def test_a_causal_lms_predictions_keep_their_class_without_the_cache() -> None:
    """GPT-2's output keeps its class; the cache (not per row) is dropped, its field None."""
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=30, n_embd=16, n_layer=1, n_head=2, n_positions=16))
    ids = torch.randint(0, 30, (ROWS, 6))
    preds = fitdp.Model(gpt2).predict({"input_ids": ids}, batch_size=5,
                                      devices=["cpu", "cpu"])
    assert type(preds) is transformers.modeling_outputs.CausalLMOutputWithCrossAttentions
    assert preds.past_key_values is None and "past_key_values" not in preds
    gpt2.eval()
    with torch.no_grad():
        torch.testing.assert_close(preds.logits, gpt2(ids).logits, atol=1e-5, rtol=1e-5)


class Heads(nn.Module):
    """A plain module returning a dict of outputs of its input's length."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"twice": 2 * x}


def test_a_plain_dict_stays_a_dict_padded_with_zeros() -> None:
    """A module's own plain dict is no ModelOutput: a dict, padded with 0.0 as before."""
    batches = [torch.ones(2, 3), torch.ones(2, 1)]
    preds = fitdp.Model(Heads()).predict(iter(batches))
    assert type(preds) is dict
    torch.testing.assert_close(preds["twice"][2:], torch.tensor([[2.0, 0, 0], [2.0, 0, 0]]))
