"""``Ranks.join`` sets the rank's CUDA device whoever initialized the process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fitdp.call.ranks import Ranks


def test_a_group_the_user_initialized_still_gets_the_ranks_device(monkeypatch):
    # join returned before set_device when the user had initialized the group, so NCCL's
    # object collectives (check_even, gather_rows) ran on cuda:0 on every rank.
    chosen: list[torch.device] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    Ranks(rank=1, world_size=2, local_rank=1).join([torch.device("cuda", 1)], timeout=10)
    assert chosen == [torch.device("cuda", 1)]


def test_cpu_ranks_and_a_single_process_leave_the_current_device_alone(monkeypatch):
    chosen: list[torch.device] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    Ranks(0, 2, 0).join([torch.device("cpu")], timeout=10)
    Ranks().join([torch.device("cuda", 1)], timeout=10)
    assert chosen == []


@pytest.mark.requires_cuda
def test_join_makes_the_ranks_device_current_on_a_gpu(monkeypatch):
    """On a GPU: the device join picks is the current one afterwards (with one GPU it is
    cuda:0 either way; two or more GPUs show the move)."""
    last = torch.cuda.device_count() - 1
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    before = torch.cuda.current_device()
    try:
        torch.cuda.set_device(0)
        Ranks(last, 2, last).join([torch.device("cuda", last)], timeout=10)
        assert torch.cuda.current_device() == last
    finally:
        torch.cuda.set_device(before)
