"""fitdp.all_gather across torchrun ranks (issue 19 gap 6): two gloo processes on
127.0.0.1, a contrastive loss over both ranks' rows, against one process on the whole batch.

Under DDP (Lightning, Fabric, Accelerate) each rank's NT-Xent sees only its own rows unless
the user gathers with ``torch.distributed.nn.functional.all_gather``; fitdp's ``all_gather``
is that call across ranks, so the update is the whole-batch one.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.call.test_custom_step import _batches, _net, nt_xent

WORKER = os.path.join(os.path.dirname(__file__), "custom_step_worker.py")
pytestmark = [pytest.mark.distributed, pytest.mark.ranks_script(WORKER)]


def test_all_gather_across_two_ranks_equals_one_process_on_the_whole_batch(shared_ranks):
    """Regression: under torchrun a custom step on fit(x) without y weighed every slice 0
    (counted targets of no labels), so nothing trained; all_gather across ranks untested."""
    run = shared_ranks(WORKER)  # the job's 2 ranks run custom_step_worker.py
    assert run.code == 0, run.output
    weights = torch.load(run.out / "weights.pt", weights_only=True)
    views = torch.randn(40, 2, 6, generator=torch.Generator().manual_seed(7))
    ref = _net(out=4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for sl in _batches(40, 20) * 2:
        opt.zero_grad()
        nt_xent(ref(views[sl, 0]), ref(views[sl, 1])).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=k)
