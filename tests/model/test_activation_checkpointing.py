"""compile(activation_checkpointing=[Block]) and an HF model's own gradient checkpointing on
replicas: the same weights as without (recomputing a deterministic block in backward gives
the activations it would have kept), the blocks really recomputed, the module unchanged."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fitdp


class Block(nn.TransformerEncoderLayer):
    """A transformer layer that counts its forward runs (recomputes included)."""

    runs: list[int] = []  # (append is atomic: replicas run on several threads)

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        Block.runs.append(1)
        return super().forward(*args, **kwargs)


def encoder(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layer = Block(16, 2, 32, dropout=dropout, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Flatten(), nn.Linear(16 * 6, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, 16, generator=g), torch.randint(0, 3, (32,), generator=g)


def trained(net: nn.Module, devices: list[str], **compile_kw) -> fitdp.Model:
    model = fitdp.Model(net)
    model.compile("adam", "cross_entropy", **compile_kw)
    model.fit(*data(), batch_size=8, epochs=2, shuffle=False, verbose=0, devices=devices)
    return model


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_checkpointed_transformer_trains_the_same_weights(devices):
    plain = trained(encoder(), devices)
    Block.runs.clear()
    ckpt = trained(encoder(), devices, activation_checkpointing=[Block])
    assert_same_weights(plain.module, ckpt.module)
    # 2 layers x 2 epochs x 4 batches on each replica, run in forward and again in backward
    assert len(Block.runs) == 2 * 2 * 4 * len(devices) * 2
    # the module as it was: no forward left on the instances, the same names
    assert not any("forward" in m.__dict__ for m in ckpt.module.modules())
    assert list(ckpt.module.state_dict()) == list(plain.module.state_dict())


def test_evaluate_and_predict_do_not_recompute():
    model = trained(encoder(), ["cpu"], activation_checkpointing=[Block])
    Block.runs.clear()
    model.evaluate(*data(), batch_size=8, verbose=0)
    model.predict(data()[0], batch_size=8)
    assert len(Block.runs) == 2 * 4 * 2  # one run per layer and batch


def test_dropout_inside_a_block_is_replayed_on_one_device():
    """torch's checkpoint restores the generator for the recompute: the same masks."""
    torch.manual_seed(3)
    plain = trained(encoder(dropout=0.2), ["cpu"])
    torch.manual_seed(3)
    ckpt = trained(encoder(dropout=0.2), ["cpu"], activation_checkpointing=[Block])
    assert_same_weights(plain.module, ckpt.module)


def test_dropout_module_in_a_block_on_cpu_replicas_trains_as_without_checkpointing():
    """Was refused: the replicas share the CPU generator, which a recompute resets."""
    torch.manual_seed(3)
    plain = trained(encoder(dropout=0.1), ["cpu", "cpu"])
    torch.manual_seed(3)
    ckpt = trained(encoder(dropout=0.1), ["cpu", "cpu"], activation_checkpointing=[Block])
    assert_same_weights(plain.module, ckpt.module)
    assert not any("forward" in m.__dict__ for m in ckpt.module.modules())


class FunctionalDropout(nn.Module):
    """A residual MLP block that draws through ``F.dropout`` (no ``nn.Dropout`` module)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.dropout(torch.relu(self.a(x)), 0.3, self.training))


def functional_fit(blocks: list | None, devices: list[str], epochs: int = 2,
                   **fit_kw) -> fitdp.Model:
    torch.manual_seed(0)
    net = nn.Sequential(FunctionalDropout(), nn.Dropout(0.2), FunctionalDropout(),
                        nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 3, (64,), generator=g)
    model = fitdp.Model(net)
    model.compile("adam", "cross_entropy", activation_checkpointing=blocks)
    model.fit(x, y, batch_size=16, epochs=epochs, seed=0, shuffle=False, verbose=0,
              devices=devices, **fit_kw)
    return model


def test_functional_dropout_block_on_cpu_replicas_is_exact_and_the_same_every_run():
    """Issue 37 item 5: a block drawing through F.dropout on 2 CPU replicas trained weights
    0.006-0.24 off the run without checkpointing, different every run (a recompute reset
    the shared CPU generator while the other replica drew from it)."""
    plain = functional_fit(None, ["cpu", "cpu"])
    ckpt = functional_fit([FunctionalDropout], ["cpu", "cpu"])
    again = functional_fit([FunctionalDropout], ["cpu", "cpu"])
    assert_same_weights(plain.module, ckpt.module)
    for name, value in ckpt.module.state_dict().items():
        assert torch.equal(value, again.module.state_dict()[name]), name


def test_checkpointed_random_blocks_in_reproducible_mode_are_bitwise_on_any_device_list():
    """Issue 37 item 5 in reproducible mode: a recompute reset the CPU generator during
    another replica's seeded forward (0.01 off one device)."""
    one = functional_fit([FunctionalDropout], ["cpu"], 1, reproducible=True, micro_batch_size=4)
    three = functional_fit([FunctionalDropout], ["cpu"] * 3, 1, reproducible=True,
                           micro_batch_size=4, work_load_list=[1, 2, 1])
    for name, value in one.module.state_dict().items():
        assert torch.equal(value, three.module.state_dict()[name]), name


@pytest.mark.parametrize("value,error,match", [
    (Block, TypeError, "a list of nn.Module classes"),
    (["Block"], TypeError, "a list of nn.Module classes"),
    ([nn.LSTM], ValueError, "holds no LSTM"),
])
def test_bad_activation_checkpointing_is_refused_and_keeps_the_compile(value, error, match):
    model = fitdp.Model(encoder())
    model.compile("sgd", "cross_entropy")
    optimizer = model.optimizer
    with pytest.raises(error, match=r"compile\(activation_checkpointing=\.\.\.\).*" + match):
        model.compile("adam", "cross_entropy", activation_checkpointing=value)
    assert model.optimizer is optimizer


# -- Hugging Face ---------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


class TinyBert(nn.Module):
    """BertForSequenceClassification from a config (no download), fed input_ids
    positionally, returning the logits."""

    def __init__(self, gradient_checkpointing: bool = False) -> None:
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16, num_labels=3,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        torch.manual_seed(0)
        self.bert = transformers.BertForSequenceClassification(config)
        if gradient_checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5
                self.bert.gradient_checkpointing_enable()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids).logits


def bert_fit(net: nn.Module, **compile_kw) -> fitdp.Model:
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(1, 50, (32, 8), generator=g), torch.randint(0, 3, (32,), generator=g)
    model = fitdp.Model(net)
    model.compile("adamw", "cross_entropy", **compile_kw)
    model.fit(ids, y, batch_size=8, epochs=1, shuffle=False, verbose=0, devices=["cpu", "cpu"])
    return model


def count_layer_runs(net: TinyBert) -> list[int]:
    """A list that grows by one each time a BertLayer's feed-forward part runs, forward or
    recompute (a hook on a submodule: HF wraps the layer's own forward), on every replica
    (the replicas' copies keep the hook)."""
    runs: list[int] = []
    for layer in net.bert.bert.encoder.layer:
        layer.intermediate.register_forward_hook(lambda *_: runs.append(1))
    return runs


@pytest.mark.parametrize("how", ["compile", "gradient_checkpointing_enable"])
def test_tiny_bert_checkpointed_on_two_replicas_trains_the_same_weights(how):
    from transformers.models.bert.modeling_bert import BertLayer

    plain = bert_fit(TinyBert())
    net = TinyBert(gradient_checkpointing=how != "compile")
    runs = count_layer_runs(net)
    ckpt = bert_fit(net, activation_checkpointing=[BertLayer] if how == "compile" else None)
    assert_same_weights(plain.module, ckpt.module)
    assert len(runs) == 2 * 4 * 2 * 2  # 2 layers, 4 batches, 2 replicas, twice each


def gpt2_fit(blocks: list | None, devices: list[str]) -> tuple[fitdp.Model, dict]:
    """A tiny GPT2LMHeadModel from a config (no download; its dropouts 0.1) on a padded
    batch with its own causal-LM loss."""
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2)
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (16, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, 5:] = 0  # every other row padded after 5 tokens
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    model = fitdp.Model(net)
    model.compile("adamw", loss=None, loss_items="causal_lm", activation_checkpointing=blocks)
    history = model.fit(batch, batch_size=8, epochs=2, seed=0, shuffle=False, verbose=0,
                        devices=devices)
    return model, history.history


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_gpt2_blocks_checkpointed_on_a_padded_batch_train_with_the_cache_off(devices):
    """Issue 38 item 5: [GPT2Block] failed on its first batch (the recompute appended its keys
    to the DynamicCache a second time; the error blamed the dict keys). transformers' own
    checkpointing passes its layers use_cache=False and no cache (GradientCheckpointingLayer
    in modeling_layers.py): so does fitdp's, and the weights are those of the plain run."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    plain, plain_logs = gpt2_fit(None, devices)
    ckpt, ckpt_logs = gpt2_fit([GPT2Block], devices)
    assert_same_weights(plain.module, ckpt.module)
    assert ckpt_logs["loss"] == pytest.approx(plain_logs["loss"], rel=1e-6)
