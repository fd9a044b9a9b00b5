"""A ``datasets.Dataset`` of text through a collator on two torchrun ranks (issue 38 item 1):
each rank collates every batch of 4 rows in order (the MLM collator's masks drawn alike on
both) and trains its round-robin share, so the two ranks give the one-process hand loop over
the same collated batches, two at a time (tests/model/test_hf_datasets.py's ``hand_loop``):
weights, History, evaluate and predict. Rows grouped by length (``group_by_length=True``,
shuffled, two epochs) are grouped alike on both ranks and shared round-robin by batch."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("datasets")

from tests.distributed.test_huggingface_ranks import assert_saved_run  # noqa: E402
from tests.model.test_hf_datasets import hand_loop  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "hf_data_worker.py")
pytestmark = [pytest.mark.distributed, pytest.mark.ranks_script(WORKER)]


def test_two_ranks_train_the_hand_loop_over_the_collated_batches(shared_ranks):
    run = shared_ranks(WORKER)  # the shared job's 2 ranks run hf_data_worker.py
    assert run.code == 0, run.output[-3000:]
    for task in ("classify", "mlm"):
        net, history, evaluated, logits = hand_loop(task, batch_size=4, per_step=2)
        assert_saved_run(run.out / f"{task}.pt", net, history, evaluated, logits)
    net, history, evaluated, logits = hand_loop("tag", batch_size=4, per_step=2, epochs=2,
                                                grouped=True)
    assert_saved_run(run.out / "tag_grouped.pt", net, history, evaluated, logits)
