"""Hugging Face models (issue 29): ``compile(loss=None)`` trains on the module's own loss,
dict batches are passed as ``module(**batch)``, and ``loss_items`` weighs the slices so that
any number of CPU replicas and any work loads train the one-device update.

The reference is what a transformers user writes by hand: ``out = model(**batch)``,
``out.loss.backward()``, ``optimizer.step()`` on every whole batch, on one device. The
model's loss is its mean over the batch (rows for a sequence classifier, tokens that are not
-100 for a tagger or a causal LM), so the epoch's loss over the batches, each weighed by
what it averages over, is the model's loss on the whole data at once (which ``evaluate``
must give), and ``predict`` is its logits on the whole data.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

import fitdp
from fitdp.callbacks import ModelCheckpoint
from fitdp.checks import FitdpWarning
from tests.model.test_resume_epoch import Stop

transformers = pytest.importorskip("transformers")  # the hf extra (a base install skips)

N, T, BATCH, VOCAB = 24, 9, 8, 50
# SGD: Adam divides each parameter's gradient by its own running magnitude, so where the
# true gradient is 0 (an attention key bias: softmax ignores a constant shift) float noise
# of 1e-9 becomes a step of lr, whatever the summation order: two halves of each batch
# summed by hand end 4.7e-5 away from the whole batch after 3 AdamW steps at lr=1e-2, as
# two replicas do. SGD keeps that noise at its size.
OPTIMIZER, LR = "sgd", 0.5


def _bert_config(**kw):
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **kw)


def _classifier():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(_bert_config(num_labels=3))


def _tagger():
    torch.manual_seed(0)
    return transformers.BertForTokenClassification(_bert_config(num_labels=4))


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _padded(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask of sequences of 2..T tokens, padded at the end;
    the short ones gathered in the second half so slices hold different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (N, T), generator=g)
    lengths = torch.randint(2, T + 1, (N,), generator=g)
    lengths = torch.cat([lengths[: N // 2].clamp(min=T - 2), lengths[N // 2:].clamp(max=4)])
    mask = (torch.arange(T) < lengths[:, None]).long()
    return ids * mask, mask


def classification_data() -> dict[str, torch.Tensor]:
    ids, mask = _padded(1)
    labels = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def causal_lm_data() -> dict[str, torch.Tensor]:
    ids, mask = _padded(3)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tagging_data() -> dict[str, torch.Tensor]:
    ids, mask = _padded(4)
    tags = torch.randint(0, 4, (N, T), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "attention_mask": mask,
            "labels": tags.masked_fill(mask == 0, -100)}


def _items(batch: dict[str, torch.Tensor], loss_items: str | None) -> int:
    """What the model's loss averages over in ``batch``."""
    labels = batch["labels"]
    if loss_items == "causal_lm":
        labels = labels[:, 1:]
    return int((labels != -100).sum()) if loss_items else len(labels)


def hand_loop(net, data, loss_items, epochs=1):
    """One device, whole batches in order, the model's own loss: (epoch losses)."""
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    net.train()
    history = []
    for _ in range(epochs):
        total = count = 0.0
        for start in range(0, N, BATCH):
            batch = {k: v[start:start + BATCH] for k, v in data.items()}
            opt.zero_grad()
            loss = net(**batch).loss
            loss.backward()
            opt.step()
            n = _items(batch, loss_items)
            total, count = total + loss.item() * n, count + n
        history.append(total / count)
    net.eval()
    with torch.no_grad():
        whole = net(**data)
    return history, float(whole.loss), whole.logits


CASES = {
    "bert-classification": (_classifier, classification_data, None),
    "gpt2-causal-lm": (_gpt2, causal_lm_data, "causal_lm"),
    "bert-token-classification": (_tagger, tagging_data, "tokens"),
}
LOADS = [0.2, 0.5, 0.3]  # uneven, drawn once: 3 replicas of different work loads


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("devices,loads", [(["cpu"], None), (["cpu", "cpu"], None),
                                           (["cpu"] * 3, LOADS)])
def test_fit_evaluate_predict_equal_the_hand_loop(case, devices, loads) -> None:
    """The module's own loss on 1, 2 and 3 CPU replicas (uneven loads) trains the
    one-device whole-batch update: weights, History, evaluate and predict (fp32, 1e-5)."""
    make, data_of, loss_items = CASES[case]
    data = data_of()
    ref = make()
    expected, whole_loss, whole_logits = hand_loop(ref, data, loss_items)
    model = fitdp.Model(make())
    model.compile(OPTIMIZER, lr=LR, loss=None, loss_items=loss_items,
                  forward_kwargs={"use_cache": False} if "gpt2" in case else None)
    history = model.fit(data, batch_size=BATCH, shuffle=False, verbose=0, devices=devices,
                        work_load_list=loads)
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=name)
    assert history.history["loss"] == pytest.approx(expected, abs=1e-5)
    logs = model.evaluate(data, batch_size=BATCH, verbose=0, devices=devices,
                          work_load_list=loads, return_dict=True)
    assert logs["loss"] == pytest.approx(whole_loss, abs=1e-5)
    inputs = {k: v for k, v in data.items() if k != "labels"}
    predicted = model.predict(inputs, batch_size=BATCH, verbose=0, devices=devices,
                              work_load_list=loads)
    assert isinstance(predicted, dict) and "past_key_values" not in predicted
    torch.testing.assert_close(predicted["logits"], whole_logits, atol=1e-5, rtol=1e-5)


def test_without_loss_items_two_replicas_train_another_update_and_it_is_said() -> None:
    """Regression: GPT-2's own loss (shifted labels, -100 on padding) on 2 replicas was
    weighed by rows, not tokens, without a word: now a FitdpWarning names loss_items before
    the first step, and the weights are the ones rows give (not the hand loop's)."""
    data = causal_lm_data()
    ref = _gpt2()
    hand_loop(ref, data, "causal_lm")
    model = fitdp.Model(_gpt2())
    model.compile(OPTIMIZER, lr=LR, loss=None)
    with pytest.warns(FitdpWarning, match="loss_items"):
        model.fit(data, batch_size=BATCH, shuffle=False, verbose=0, devices=["cpu", "cpu"])
    gap = max((p - q).abs().max().item()
              for p, q in zip(model.module.parameters(), ref.parameters()))
    assert gap > 1e-4


def loader_of_dicts(data, batch_size=BATCH):
    """A DataLoader of per-sample dicts, collated into dict batches in order."""
    rows = [{k: v[i] for k, v in data.items()} for i in range(N)]
    return torch.utils.data.DataLoader(rows, batch_size=batch_size)


@pytest.mark.parametrize("form", ["dataloader", "generator", "dataset"])
def test_batches_of_dicts_train_like_a_dict_in_memory(form) -> None:
    """A DataLoader, a generator or a Dataset yielding dicts (what collators give) is the
    same data as the dict of tensors: the same weights on two replicas."""
    data = causal_lm_data()
    expected = fitdp.Model(_gpt2())
    expected.compile(OPTIMIZER, lr=LR, loss=None, loss_items="causal_lm")
    expected.fit(data, batch_size=BATCH, shuffle=False, verbose=0, devices=["cpu", "cpu"])
    if form == "dataloader":
        x = loader_of_dicts(data)
    elif form == "generator":
        x = (b for b in list(loader_of_dicts(data)))
    else:
        x = [{k: v[i] for k, v in data.items()} for i in range(N)]
        x = torch.utils.data.Subset(x, range(N))
    model = fitdp.Model(_gpt2())
    model.compile(OPTIMIZER, lr=LR, loss=None, loss_items="causal_lm")
    model.fit(x, batch_size=BATCH, shuffle=False, verbose=0, devices=["cpu", "cpu"])
    for p, q in zip(model.module.parameters(), expected.module.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)


def test_metrics_read_the_batch_labels_and_the_output_logits() -> None:
    """``y`` stays None: accuracy reads batch["labels"] and outputs.logits (as a hand
    computation on the predicted logits gives)."""
    data = classification_data()
    model = fitdp.Model(_classifier())
    model.compile(OPTIMIZER, lr=LR, loss=None, metrics=["accuracy"])
    model.fit(data, batch_size=BATCH, verbose=0, devices=["cpu", "cpu"])
    logs = model.evaluate(data, batch_size=BATCH, verbose=0, return_dict=True)
    logits = model.predict({k: v for k, v in data.items() if k != "labels"}, verbose=0)["logits"]
    assert logs["accuracy"] == pytest.approx(
        (logits.argmax(1) == data["labels"]).float().mean().item(), abs=1e-6)


def test_a_custom_step_declares_its_items_with_loss_items() -> None:
    """Regression: a train_step returning GPT-2's own loss was weighed by compile's unused
    default loss (labels != -100, unshifted). Slice weights now come only from what is
    declared: compile(loss=None, loss_items="causal_lm") gives the hand loop's update."""

    class OwnStep(fitdp.Model):
        def train_step(self, data):
            (batch,) = data
            return self(**batch).loss

    data = causal_lm_data()
    ref = _gpt2()
    hand_loop(ref, data, "causal_lm")
    model = OwnStep(_gpt2())
    model.compile(OPTIMIZER, lr=LR, loss=None, loss_items="causal_lm")
    model.fit(data, batch_size=BATCH, shuffle=False, verbose=0, devices=["cpu", "cpu"])
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_a_custom_step_is_weighed_by_rows_not_by_a_loss_it_does_not_call() -> None:
    """Regression: with compile's default loss ("cross_entropy", never called by the step)
    the slices were weighed by its count of labels != -100; now by rows, as documented."""

    class OwnStep(fitdp.Model):
        def train_step(self, data):
            x, y = data
            return self(**x, labels=y).loss

    data = causal_lm_data()
    x = {k: v for k, v in data.items() if k != "labels"}
    y = data["labels"]
    rows = fitdp.Model(_gpt2())
    rows.compile(OPTIMIZER, lr=LR, loss=None)  # the built-in step, slices weighed by rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FitdpWarning)
        rows.fit(data, batch_size=BATCH, shuffle=False, verbose=0, devices=["cpu", "cpu"])
    model = OwnStep(_gpt2())
    model.compile(OPTIMIZER, lr=LR)
    with pytest.warns(FitdpWarning, match="weigh by rows"):  # and says how to declare
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, devices=["cpu", "cpu"])
    for p, q in zip(model.module.parameters(), rows.module.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_a_mid_epoch_checkpoint_of_a_dict_fit_resumes_bitwise(tmp_path) -> None:
    """A dict-batch fit (shuffled, 2 replicas) stopped mid-epoch and resumed from its
    checkpoint ends with the uninterrupted run's weights and History, bit for bit."""
    data = tagging_data()

    def run(callbacks, **kw):
        model = fitdp.Model(_tagger())
        model.compile(OPTIMIZER, lr=LR, loss=None, loss_items="tokens")
        history = model.fit(data, batch_size=BATCH, epochs=2, seed=3, verbose=0,
                            devices=["cpu", "cpu"], callbacks=callbacks, **kw).history
        return model, history

    assert_resumes_bitwise(run, tmp_path)


def assert_resumes_bitwise(run, tmp_path) -> None:
    """``run(callbacks, **fit_kwargs) -> (model, history)`` stopped after its 4th batch and
    resumed from its checkpoint ends with the uninterrupted run's weights and History."""
    reference, expected = run([])
    ckpt = str(tmp_path / "c-{step:03d}.ckpt")
    with pytest.raises(KeyboardInterrupt):
        run([ModelCheckpoint(ckpt, save_freq=1, monitor="loss"), Stop(4)])
    resumed, history = run([ModelCheckpoint(ckpt, save_freq=1, monitor="loss")],
                           resume="latest")
    for (k, v), w in zip(resumed.module.state_dict().items(),
                         reference.module.state_dict().values()):
        assert torch.equal(v, w), k
    assert history == expected


def _state(model):
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def _unchanged(model, before) -> None:
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_module_without_a_loss_is_a_clear_error_before_any_weight_moves() -> None:
    """compile(loss=None) on a module that returns no loss (no labels in the batch): a
    ValueError saying what to pass; the weights are unchanged."""
    data = classification_data()
    model = fitdp.Model(_classifier())
    model.compile(OPTIMIZER, lr=LR, loss=None)
    before = _state(model)
    inputs = {k: v for k, v in data.items() if k != "labels"}
    with pytest.raises(ValueError, match=r"compile\(loss=None\).*no 'loss'.*labels"):
        model.fit(inputs, batch_size=BATCH, verbose=0, devices=["cpu", "cpu"])
    _unchanged(model, before)


def test_an_unknown_loss_items_is_refused_at_compile() -> None:
    """An unknown loss_items, or one with a compile loss, names it; the compile before
    stays."""
    model = fitdp.Model(_classifier())
    with pytest.raises(ValueError, match="loss_items: got 'token'.*'tokens', 'causal_lm'"):
        model.compile("adamw", loss=None, loss_items="token")
    with pytest.raises(ValueError, match="loss_items: got 'tokens'.*loss=None"):
        model.compile("adamw", loss="cross_entropy", loss_items="tokens")
    with pytest.raises(TypeError, match="loss_items: got 3"):
        model.compile("adamw", loss=None, loss_items=3)
    with pytest.raises(TypeError, match="forward_kwargs"):
        model.compile("adamw", loss=None, forward_kwargs=["use_cache"])


def test_a_batch_missing_a_key_the_forward_needs_names_it() -> None:
    """A batch without input_ids: the error names the missing input and the batch's keys;
    the weights are unchanged. (A key close to input_ids is a misspelling, refused before:
    ``tests/model/test_hf_datasets.py``.)"""
    model = fitdp.Model(_classifier())
    model.compile(OPTIMIZER, lr=LR, loss=None)
    before = _state(model)
    data = classification_data()
    data["tokens"] = data.pop("input_ids")
    message = r"input_ids.*dict batch is passed as module\(\*\*batch\)"
    with pytest.raises(ValueError, match=message) as info:
        model.fit(data, batch_size=BATCH, verbose=0, devices=["cpu", "cpu"])
    assert "tokens" in str(info.value)
    _unchanged(model, before)


def test_dict_items_without_loss_none_say_to_compile_it() -> None:
    """A DataLoader of dicts with a compile loss: the error says to compile(loss=None)."""
    model = fitdp.Model(_classifier())
    model.compile(OPTIMIZER, lr=LR)
    with pytest.raises(ValueError, match=r"compile\(loss=None\)"):
        model.fit(loader_of_dicts(classification_data()), verbose=0)


def test_fitdp_never_imports_transformers() -> None:
    """transformers is an optional extra (fitdp[hf]): no fitdp module imports it, not even
    inside a function; fitdp reads a model's outputs by their keys. (torchmetrics, a core
    dependency, imports it on its own where it is installed.)"""
    root = Path(fitdp.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert not found


def test_a_bucket_iterator_feeds_a_causal_lm_its_labels() -> None:
    """Bucketing where it fits: a BucketIterator's padded ids (labels padded with -100) go
    to GPT-2 as ``model(ids, labels=labels)``; two replicas train the hand loop's update on
    the same buckets (causal attention: the padding after a line changes none of its
    tokens)."""
    g = torch.Generator().manual_seed(6)
    lines = [torch.randint(1, VOCAB, (int(n),), generator=g)
             for n in torch.randint(2, T + 1, (N,), generator=g)]

    def buckets():
        return fitdp.BucketIterator(lines, lines, batch_size=BATCH, buckets=[4, T],
                                    label_pad=-100, shuffle=False)

    ref = _gpt2()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for batch in buckets():
        opt.zero_grad()
        ref(batch.data, labels=batch.label).loss.backward()
        opt.step()
    model = fitdp.Model(_gpt2())
    model.compile(OPTIMIZER, lr=LR, loss=None, loss_items="causal_lm")
    model.fit(buckets(), verbose=0, devices=["cpu", "cpu"])
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


def test_a_custom_step_on_a_model_output_feeds_metrics_and_predict() -> None:
    """Regression: a ModelOutput from a custom step reached the metrics whole ("'dict' object
    has no attribute 'ndim'") and predict raw (its loss a scalar, its cache no tensor): both
    now read its per-row tensor fields, as on the built-in path."""

    class OwnStep(fitdp.Model):
        def train_step(self, data):
            (batch,) = data
            return self(**batch).loss

    data = classification_data()
    model = OwnStep(_classifier())
    model.compile(OPTIMIZER, lr=LR, loss=None, metrics=["accuracy"])
    logs = model.fit(data, batch_size=BATCH, verbose=0, devices=["cpu", "cpu"]).history
    assert 0.0 <= logs["accuracy"][0] <= 1.0
    predicted = model.predict({k: v for k, v in data.items() if k != "labels"}, verbose=0)
    assert sorted(predicted) == ["logits"] and predicted["logits"].shape == (N, 3)


def test_a_custom_step_on_an_undeclared_ignore_index_is_warned_about() -> None:
    """A train_step returning compile's "cross_entropy" on per-token labels padded with -100
    weighs its slices by rows on two replicas (compile's loss is not read for weights): a
    FitdpWarning says so and names the declarations that fix it."""

    class Tagger(fitdp.Model):
        def train_step(self, data):
            x, y = data
            logits = self(**x).logits
            return self.compute_loss(x, y.reshape(-1), logits.reshape(-1, logits.shape[-1]))

    data = tagging_data()
    x = {k: v for k, v in data.items() if k != "labels"}
    model = Tagger(_tagger())
    model.compile(OPTIMIZER, lr=LR)
    with pytest.warns(FitdpWarning, match=r"TokenMean.*loss_items='tokens'"):
        model.fit(x, data["labels"], batch_size=BATCH, verbose=0, devices=["cpu", "cpu"])
