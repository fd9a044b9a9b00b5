"""The equivalence harness (issue 37): a drawn run (data kind, devices and work loads, where it
is interrupted and how it resumes, what draws random numbers, the loss, the callbacks)
against one uninterrupted run, with what docs/ promises (harness_promises.py). The CI
profile draws a few runs; ``--hypothesis-profile=long`` draws many (docs/design.md,
"The equivalence harness")."""

from __future__ import annotations

import tempfile

import pytest
import torch
from harness_compare import assert_refusal_allowed, judge
from harness_runner import interrupted, uninterrupted
from harness_runs import Run, Stop, runs
from hypothesis import example, given


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The bits belong to a thread count (reproducible.md); one is also the fastest here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check(run: Run) -> None:
    """Run ``run`` in this process and hold it to every promise that applies."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            drawn = interrupted(run, folder) if run.stop else uninterrupted(run)
        except ValueError as err:
            assert_refusal_allowed(run, err)
            return
    judge(run, drawn)


# Issue 37's silent wrong numbers that one process shows, pinned so every profile runs them.
ITEM2_DATASET = Run(kind="dataset", epochs=2, stop=Stop(step=6))  # epoch 1, batch 2
ITEM2_SAMPLER = Run(kind="loader_sampler", epochs=2, stop=Stop(step=5))
ITEM3_STATEFUL_GENERATOR = Run(kind="stateful_generator", epochs=2, stop=Stop(step=2))
ITEM4_SHORT_DATA = Run(kind="tensors", epochs=2, stop=Stop(step=2, short=True))
ITEM5_FUNCTIONAL_DROPOUT = Run(kind="tensors", devices=2, randomness="functional",
                               checkpointing=True, epochs=2)

# Found by this harness beyond issue 37 (reported, not fixed here; they fail on today's main):
# a BucketIterator resumed from the checkpoint of an epoch's last batch (before the epoch's
# end) trains that epoch again (global_step 12 against 8);
NEW_BUCKETS_LAST_BATCH = Run(kind="buckets", epochs=2, stop=Stop(step=4))
# a DataLoader that pads each batch to its longest sequence (as Hugging Face's
# DataCollatorWithPadding) is refused as validation_data when its first batch is longer
# than the first training batch ("expected inputs shaped like the training inputs").
NEW_VARLEN_VALIDATION = Run(kind="loader_generator", varlen=True, epochs=1, validation=True)


@given(run=runs())
@example(run=ITEM2_DATASET)
@example(run=ITEM2_SAMPLER)
@example(run=ITEM3_STATEFUL_GENERATOR)
@example(run=ITEM4_SHORT_DATA)
@example(run=ITEM5_FUNCTIONAL_DROPOUT)
@example(run=NEW_BUCKETS_LAST_BATCH)
@example(run=NEW_VARLEN_VALIDATION)
def test_a_drawn_run_keeps_what_the_docs_promise(run: Run) -> None:
    check(run)
