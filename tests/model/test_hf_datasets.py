"""A Hugging Face user's data as it comes (issue 38 items 1 and 2): a ``datasets.Dataset``
with a text column, tokenized by a tokenizer trained locally, batched by a collator
(``collate_fn=``, as ``Trainer(data_collator=)``), trains, evaluates and predicts as a hand
loop over the same collated batches does, on 1, 2 and 3 CPU replicas; the text column is
dropped once with one note; and a dict key the forward does not name is refused.

The reference is what a user writes by hand: the rows in order, ``collator(rows)`` per
batch, ``model(**batch).loss.backward()``, ``optimizer.step()``, on one device. The
collator runs once per batch on the host before the batch is split over the replicas, so
even a collator that draws random numbers (MLM masking) gives the hand loop's batches.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

import fitdp  # noqa: E402
from fitdp.callbacks import ModelCheckpoint  # noqa: E402
from fitdp.checks import FitdpWarning  # noqa: E402
from tests import hf_data  # noqa: E402
from tests.model.test_huggingface import assert_resumes_bitwise  # noqa: E402
from tests.model.test_resume_epoch import Stop  # noqa: E402

BATCH, LR, SEED = 8, 0.5, 5
TASKS = ["classify", "mlm", "tag"]


def rows(task: str) -> list[dict]:
    """The dataset's rows as a user's hand loop reads them: without the text column."""
    ds = hf_data.dataset(task).remove_columns("text")
    return [ds[i] for i in range(len(ds))]


def items(batch: dict[str, torch.Tensor], task: str) -> int:
    labels = batch["labels"]
    return int((labels != -100).sum()) if hf_data.LOSS_ITEMS[task] else len(labels)


def mean_loss(net, task: str, seed: int, batch_size: int = BATCH) -> float:
    """The model's loss over the collated batches (each weighed by its items)."""
    torch.manual_seed(seed)
    data, collate = rows(task), hf_data.collator(task)
    total = count = 0.0
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            batch = collate(data[start:start + batch_size])
            n = items(batch, task)
            total, count = total + float(net(**batch).loss) * n, count + n
    return total / count


def order(task: str, batch_size: int, epoch: int, grouped: bool) -> list[list[int]]:
    """The rows of each batch of ``epoch``: in order, or grouped by length by the sampler
    ``fit(group_by_length=True)`` uses (each row's ``input_ids`` length, seeded as fit)."""
    data = rows(task)
    if not grouped:
        return [list(range(s, min(s + batch_size, len(data))))
                for s in range(0, len(data), batch_size)]
    sampler = fitdp.BucketBatchSampler([len(r["input_ids"]) for r in data], batch_size,
                                       seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def hand_loop(task: str, batch_size: int = BATCH, per_step: int = 1, epochs: int = 1,
              grouped: bool = False
              ) -> tuple[torch.nn.Module, list[float], float, torch.Tensor | None]:
    """One device: each epoch's batches of rows (``order``), collated per batch of
    ``batch_size`` (the collator's draws from torch's generator seeded as ``fit(seed=SEED)``
    seeds it), SGD on the model's own loss over ``per_step`` batches at a time (each weighed
    by its items: the batches of ``per_step`` torchrun ranks), then evaluate and the
    classifier's predicted logits."""
    net = hf_data.model(task)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    data, collate = rows(task), hf_data.collator(task)
    torch.manual_seed(SEED)
    history = []
    for epoch in range(epochs):
        batches = [collate([data[i] for i in index])
                   for index in order(task, batch_size, epoch, grouped)]
        total = count = 0.0
        for start in range(0, len(batches), per_step):
            group = batches[start:start + per_step]
            counts = [items(b, task) for b in group]
            opt.zero_grad()
            losses = [net(**b).loss for b in group]
            loss = sum(v * n for v, n in zip(losses, counts)) / sum(counts)
            loss.backward()
            opt.step()
            total, count = total + loss.item() * sum(counts), count + sum(counts)
        history.append(total / count)
    net.eval()
    evaluated = mean_loss(net, task, seed=1, batch_size=batch_size)
    torch.manual_seed(2)
    with torch.no_grad():
        logits = torch.cat([net(**collate(data[s:s + BATCH])).logits
                            for s in range(0, len(data), BATCH)]) if task == "classify" else None
    return net, history, evaluated, logits


def compiled(task: str, **kw) -> fitdp.Model:
    model = fitdp.Model(hf_data.model(task, **kw))
    model.compile("sgd", lr=LR, loss=None, loss_items=hf_data.LOSS_ITEMS[task])
    return model


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("devices", [["cpu"], ["cpu"] * 2, ["cpu"] * 3])
def test_a_dataset_through_each_collator_equals_the_hand_loop(task, devices) -> None:
    """DataCollatorWithPadding (a classifier), DataCollatorForLanguageModeling (masked LM,
    random masking) and DataCollatorForTokenClassification (a tagger) on 1-3 CPU replicas:
    weights, History, evaluate and predict equal the hand loop over the same batches."""
    net, history, evaluated, logits = hand_loop(task)
    model, ds, collate = compiled(task), hf_data.dataset(task), hf_data.collator(task)
    got = model.fit(ds, batch_size=BATCH, shuffle=False, seed=SEED, verbose=0,
                    devices=devices, collate_fn=collate)
    for (name, p), q in zip(model.module.named_parameters(), net.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=name)
    assert got.history["loss"] == pytest.approx(history, abs=1e-5)
    torch.manual_seed(1)
    logs = model.evaluate(ds, batch_size=BATCH, verbose=0, devices=devices,
                          collate_fn=collate, return_dict=True)
    assert logs["loss"] == pytest.approx(evaluated, abs=1e-5)
    if logits is not None:
        torch.manual_seed(2)
        predicted = model.predict(ds, batch_size=BATCH, devices=devices, collate_fn=collate)
        torch.testing.assert_close(predicted["logits"], logits, atol=1e-5, rtol=1e-5)


def test_the_text_column_is_dropped_once_with_one_note() -> None:
    """Trainer's ``_remove_unused_columns`` (transformers/trainer.py) drops the columns
    ``model.forward`` has no argument for, once per dataset, and logs one line naming them:
    here one FitdpWarning per dataset (training and validation data), naming ``text``."""
    model, ds = compiled("classify"), hf_data.dataset("classify")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(ds, batch_size=BATCH, epochs=2, verbose=0, devices=["cpu"],
                  collate_fn=hf_data.collator("classify"), validation_data=ds)
    notes = [str(w.message) for w in seen if "dropped" in str(w.message)]
    assert len(notes) == 2, notes
    assert notes[0].startswith("x: the columns 'text' ")
    assert notes[1].startswith("validation_data: the columns 'text' ")
    assert "text" in ds.column_names  # the user's dataset is left as it was


def test_shuffled_a_dataset_trains_as_the_same_rows_in_a_list() -> None:
    """Shuffling draws the same order from (seed, epoch) as for a list of row dicts (a
    map-style dataset): the same weights and History, bit for bit, on 2 replicas."""
    def run(x):
        model = compiled("tag")
        history = model.fit(x, batch_size=BATCH, epochs=2, seed=SEED, verbose=0,
                            devices=["cpu", "cpu"], collate_fn=hf_data.collator("tag"))
        return model, history.history

    (a, ha), (b, hb) = run(hf_data.dataset("tag")), run(rows("tag"))
    assert ha == hb
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)


def test_a_stream_trains_as_the_dataset() -> None:
    """A ``datasets.IterableDataset`` (its columns unknown after ``map``: dropped row by
    row) trains as the map-style dataset does unshuffled."""
    def run(x):
        model = compiled("classify")
        with pytest.warns(FitdpWarning, match="'text'"):
            model.fit(x, batch_size=BATCH, shuffle=False, verbose=0, devices=["cpu", "cpu"],
                      collate_fn=hf_data.collator("classify"))
        return model

    ds = hf_data.dataset("classify")
    stream = ds.to_iterable_dataset().map(lambda r: {"n": len(r["text"])})
    assert stream.column_names is None
    a, b = run(ds), run(stream)
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)


def test_mlm_masks_are_the_same_on_any_devices() -> None:
    """The collator runs once per batch on the host, before the split: its masking (drawn
    from torch's generator) gives the same batches on 1, 2 and 3 replicas, with dropout
    drawing from the same generator in the model."""
    def batches(devices):
        seen = []
        collate = hf_data.collator("mlm")

        def recording(rows):
            batch = collate(rows)
            seen.append({k: v.clone() for k, v in batch.items()})
            return batch

        model = compiled("mlm", dropout=0.1)
        model.fit(hf_data.dataset("mlm"), batch_size=BATCH, seed=SEED, verbose=0,
                  devices=devices, collate_fn=recording)
        return seen

    one = batches(["cpu"])
    assert len(one) == 3 and not torch.equal(one[0]["labels"], one[1]["labels"])
    for devices in (["cpu"] * 2, ["cpu"] * 3):
        for a, b in zip(one, batches(devices), strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_mid_epoch_checkpoint_resumes_bitwise(tmp_path) -> None:
    """An MLM fit from a dataset (random masks, shuffled), stopped in epoch 1 (its 4th batch
    of 3 per epoch) and resumed from its checkpoint, ends with the uninterrupted run's
    weights and History, bit for bit: the batches trained before the stop are collated
    again from the epoch's saved generator state, the next ones draw from the state the
    checkpoint saved, and the sampler gets epoch 1's order back."""
    def run(callbacks, **kw):
        model = compiled("mlm")
        history = model.fit(hf_data.dataset("mlm"), batch_size=BATCH, epochs=2, seed=SEED,
                            shuffle=True, verbose=0, devices=["cpu", "cpu"], callbacks=callbacks,
                            collate_fn=hf_data.collator("mlm"), **kw).history
        return model, history

    assert_resumes_bitwise(run, tmp_path)


def test_collate_fn_for_data_that_comes_batched_is_refused() -> None:
    """collate_fn batches rows; with tensors (or a DataLoader) it could only be ignored."""
    model = compiled("classify")
    with pytest.raises(TypeError, match=r"^collate_fn: .*DataLoader"):
        model.fit({"input_ids": torch.ones(4, 3, dtype=torch.long)}, verbose=0,
                  collate_fn=hf_data.collator("classify"))
    with pytest.raises(TypeError, match=r"^collate_fn: got 'pad'"):
        model.fit(hf_data.dataset("classify"), verbose=0, collate_fn="pad")


def test_rows_of_different_lengths_without_a_collator_name_one() -> None:
    model = compiled("classify")
    with pytest.raises(ValueError, match=r"^collate_fn: .*DataCollatorWithPadding"):
        model.fit(hf_data.dataset("classify"), batch_size=BATCH, verbose=0, devices=["cpu"])


def _state(model):
    return {k: v.clone() for k, v in model.module.state_dict().items()}


@pytest.mark.parametrize("where,key,closest", [
    ("x", "atention_mask", "attention_mask"), ("forward_kwargs", "use_cahce", "use_cache"),
    ("x", "label", "labels")])
def test_a_misspelt_key_is_refused_though_the_forward_takes_kwargs(where, key, closest):
    """Regression (issue 38 item 2): transformers' forward takes **kwargs and swallowed a
    misspelt key (a BERT trained without its attention mask, a GPT-2 with its cache on),
    silently. Now a ValueError names the key and the closest argument before any step."""
    import transformers

    torch.manual_seed(0)
    if where == "x":
        net: torch.nn.Module = hf_data.model("classify")
        forward_kwargs = None
    else:
        net = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=30, n_embd=16, n_layer=1, n_head=2, n_positions=16))
        forward_kwargs = {key: False}
    model = fitdp.Model(net)
    model.compile("sgd", lr=LR, loss=None, forward_kwargs=forward_kwargs)
    ids = torch.randint(1, 20, (8, 6))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if where == "x":
        batch["labels"] = torch.randint(0, 2, (8,))
        batch[key] = batch.pop(closest if closest != "labels" else "labels")
    before = _state(model)
    with pytest.raises(ValueError, match=rf"^{where}: got the key '{key}'.*"
                                         rf"did you mean '{closest}'"):
        model.fit(batch, batch_size=4, verbose=0, devices=["cpu", "cpu"])
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_key_no_argument_is_close_to_goes_to_the_forwards_kwargs() -> None:
    """A forward with **kwargs reads what it likes (output_hidden_states here): only a key
    close to an argument it names is taken for a misspelling."""
    model = fitdp.Model(hf_data.model("classify"))
    model.compile("sgd", lr=LR, loss=None, forward_kwargs={"output_hidden_states": True})
    ids = torch.randint(1, 20, (8, 6))
    out = model.predict({"input_ids": ids}, batch_size=4)
    assert "hidden_states" in out or "logits" in out


def test_a_misspelt_column_is_named_not_dropped() -> None:
    """A column close to a forward argument (``atention_mask``) is not dropped as unused
    (the model would train without its mask, silently): it is refused, naming both."""
    ds = hf_data.dataset("classify").rename_column("attention_mask", "atention_mask")
    with pytest.raises(ValueError, match=r"^x: got the column 'atention_mask'.*did you mean "
                                         r"'attention_mask'"):
        compiled("classify").fit(ds, batch_size=BATCH, verbose=0, devices=["cpu"],
                                 collate_fn=hf_data.collator("classify"))


def test_a_bucket_iterator_takes_a_datasets_columns() -> None:
    """Length grouping goes through the bucketing: a BucketIterator over a dataset's columns
    (``datasets`` Column objects, not lists) batches as over the same lists."""
    ds = hf_data.dataset("tag")
    a = fitdp.BucketIterator(ds["input_ids"], ds["labels"], batch_size=4, seed=0)
    b = fitdp.BucketIterator(list(ds["input_ids"]), list(ds["labels"]), batch_size=4, seed=0)
    assert a.buckets == b.buckets and a.per_token_labels
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.data, y.data) and torch.equal(x.label, y.label)


@pytest.mark.parametrize("task", ["mlm", "tag"])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu"] * 2, ["cpu"] * 3])
def test_rows_grouped_by_length_train_as_the_hand_loop_over_the_grouped_batches(task, devices):
    """``fit(group_by_length=True)`` (Trainer's ``group_by_length``: each row's length from
    its ``input_ids``, as transformers' LengthGroupedSampler reads it) batches rows of similar
    length through the bucketing's sampler, shuffled by (seed, epoch): two epochs on 1-3
    replicas equal the hand loop over the same batches (masked LM: random masks; tagger)."""
    net, history, _, _ = hand_loop(task, epochs=2, grouped=True)
    model, ds, collate = compiled(task), hf_data.dataset(task), hf_data.collator(task)
    got = model.fit(ds, batch_size=BATCH, epochs=2, seed=SEED, verbose=0, devices=devices,
                    collate_fn=collate, group_by_length=True)
    for (name, p), q in zip(model.module.named_parameters(), net.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=name)
    assert got.history["loss"] == pytest.approx(history, abs=1e-5)


def test_rows_grouped_by_length_resume_mid_epoch_bitwise(tmp_path) -> None:
    """Grouped MLM batches stopped in epoch 1 and resumed from the checkpoint: the
    uninterrupted run's weights and History, bit for bit (the grouped order is drawn from
    (seed, epoch) again, the masks of the batches before the stop collated again)."""
    def run(callbacks, **kw):
        model = compiled("mlm")
        history = model.fit(hf_data.dataset("mlm"), batch_size=BATCH, epochs=2, seed=SEED,
                            verbose=0, devices=["cpu", "cpu"], callbacks=callbacks,
                            collate_fn=hf_data.collator("mlm"), group_by_length=True,
                            **kw).history
        return model, history

    assert_resumes_bitwise(run, tmp_path)


def test_a_grouped_mid_epoch_checkpoint_refuses_another_grouping(tmp_path) -> None:
    """Batches grouped by length depend on the batch size: a mid-epoch checkpoint resumed
    with another one (or without grouping) would train another order of the rows, some
    twice; it is refused, naming both, before any weight moves."""
    ckpt = str(tmp_path / "c-{step:03d}.ckpt")
    model = compiled("tag")
    fit = functools.partial(model.fit, hf_data.dataset("tag"), epochs=2, seed=SEED,
                            verbose=0, devices=["cpu"], collate_fn=hf_data.collator("tag"))
    with pytest.raises(KeyboardInterrupt):
        fit(batch_size=BATCH, group_by_length=True,
            callbacks=[ModelCheckpoint(ckpt, save_freq=1, monitor="loss"), Stop(2)])
    saved = str(tmp_path / "c-002.ckpt")
    for kw, now in (({"batch_size": 4, "group_by_length": True}, "rows grouped by length into "
                                                                  "batches of 4"),
                    ({"batch_size": BATCH}, "rows batched in order")):
        resumed = compiled("tag")
        before = _state(resumed)
        with pytest.raises(fitdp.CheckpointError, match=rf"grouped by length into batches of "
                                                  rf"{BATCH} .*this fit has {now}"):
            resumed.fit(hf_data.dataset("tag"), epochs=2, seed=SEED, verbose=0,
                        devices=["cpu"], collate_fn=hf_data.collator("tag"), resume=saved,
                        **kw)
        for k, v in resumed.module.state_dict().items():
            assert torch.equal(v, before[k]), k


def test_find_lr_takes_a_dataset_with_its_collator_and_grouping() -> None:
    """find_lr reads data as fit does: a ``datasets.Dataset`` with ``collate_fn`` (it took
    no collator before: a Hugging Face user could not sweep from the dataset), grouped by
    length too; every step's loss is recorded and the model is put back as it was."""
    model = compiled("tag")
    before = _state(model)
    finder = model.find_lr(hf_data.dataset("tag"), batch_size=BATCH, num_steps=5,
                           devices=["cpu", "cpu"], seed=SEED, early_stop_threshold=None,
                           collate_fn=hf_data.collator("tag"), group_by_length=True)
    assert len(finder.lrs) == len(finder.losses) == 5
    assert all(torch.isfinite(torch.tensor(finder.losses)))
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, before[k]), k
