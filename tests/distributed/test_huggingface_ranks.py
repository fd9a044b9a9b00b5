"""Hugging Face models under torchrun (issue 29 item 6): two gloo ranks on 127.0.0.1 train
the module's own loss on dict batches, DDP and FSDP2 (each transformer block sharded), and
give the one-process hand loop's weights, History, evaluate and predict.

The reference is tests/model/test_huggingface.py's hand loop: ``model(**batch).loss`` on
each whole global batch of 8 rows in order, one process. Each rank holds 4 of the rows; the
``loss_items`` counts (GPT-2's shifted labelled tokens, the tagger's labelled tokens) are
all-reduced over the ranks, so each rank's slice weighs its share of the global count.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("transformers")  # the ranks run hf_worker.py, which imports it

from tests.model.test_huggingface import CASES, hand_loop  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "hf_worker.py")
pytestmark = [pytest.mark.distributed, pytest.mark.ranks_script(WORKER)]


def test_two_ranks_train_the_one_process_update_on_dict_batches(shared_ranks):
    """DDP and FSDP2 on 2 ranks, BERT classification, GPT-2 with padding and token
    classification, and GPT-2 from a DataLoader of dicts: allclose 1e-5 with the hand loop;
    accuracy (per row, per labelled token, over the shifted pairs) and GPT-2's perplexity
    exact over the ranks."""
    job = shared_ranks(WORKER)  # the shared job's 2 ranks run hf_worker.py
    assert job.code == 0, job.output[-3000:]
    runs = {f"{case}-{tag}": case for case in CASES for tag in ("ddp", "fsdp")}
    runs["gpt2-loader-ddp"] = "gpt2-causal-lm"
    for run, case in runs.items():
        make, data_of, loss_items = CASES[case]
        ref = make()
        history, whole_loss, whole_logits = hand_loop(ref, data_of(), loss_items)
        got = assert_saved_run(job.out / f"{run}.pt", ref, history, whole_loss, whole_logits)
        # Token metrics over the ranks (issue 38): what the hand computes on the logits
        logits, labels = got["logits"], data_of()["labels"]
        if loss_items == "causal_lm":  # transformers' causal LM loss pairs them shifted
            logits, labels = logits[:, :-1], labels[:, 1:]
        kept = labels != -100
        accuracy = (logits.argmax(-1)[kept] == labels[kept]).float().mean().item()
        assert got["evaluate"]["accuracy"] == pytest.approx(accuracy, abs=1e-6), run
        if "perplexity" in got["evaluate"]:
            assert got["evaluate"]["perplexity"] == pytest.approx(
                math.exp(got["evaluate"]["loss"]), rel=1e-5), run


def assert_saved_run(path, ref, history, loss, logits) -> dict:
    """What rank 0 saved (weights, History, evaluate, predicted logits) equals the hand
    loop's ``ref`` model and numbers (1e-5); returns it."""
    got = torch.load(path, weights_only=False)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got["weights"][k], v, atol=1e-5, rtol=1e-5,
                                   msg=f"{path}: {k}")
    assert got["history"]["loss"] == pytest.approx(history, abs=1e-5), path
    assert got["evaluate"]["loss"] == pytest.approx(loss, abs=1e-5), path
    if logits is not None:
        torch.testing.assert_close(got["logits"], logits, atol=1e-5, rtol=1e-5, msg=str(path))
    return got
