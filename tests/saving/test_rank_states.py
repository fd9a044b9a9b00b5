"""Entries that are each rank's own under torchrun (its generators, its data position):
gathered before rank 0 saves, and each rank's back on as many ranks (issue 37 item 1)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from fitdp.call.ranks import Ranks
from fitdp.checks import FitdpWarning
from fitdp.saving.entries import RNG, Entry, RankStates


class Gathered:
    """Rank ``rank`` of 2 whose gather returns ``others``, with its own row in its place."""

    enabled, world_size = True, 2

    def __init__(self, rank: int, *others: dict) -> None:
        self.rank, self.is_main, self.others = rank, rank == 0, list(others)

    def gather_rows(self, keyed: list) -> list:
        return self.others[:self.rank] + keyed + self.others[self.rank:]


def box_entry(box: dict) -> Entry:
    return Entry(lambda: dict(box), lambda s: box.update(s))


def test_a_shared_save_holds_every_ranks_state_and_each_rank_takes_its_own():
    box = {"n": 0}
    saver = RankStates(box_entry(box), Gathered(0, {"n": 1}), "states")
    saver.share()
    state = saver.state_dict()
    assert state == {"n": 0, "ranks": [{"n": 0}, {"n": 1}]}
    one = {"n": 9}
    RankStates(box_entry(one), Ranks(1, 2), "states").load_state_dict(state)
    assert one == {"n": 1}


def test_a_share_older_than_the_state_is_not_saved():
    """A rank-0-only save after the state moved on (no share since) holds rank 0's alone,
    not the other ranks' states of an earlier moment."""
    box = {"n": 0}
    saver = RankStates(box_entry(box), Gathered(0, {"n": 1}), "states")
    saver.share()
    box["n"] = 5
    assert saver.state_dict() == {"n": 5}


def test_on_another_world_size_every_rank_takes_rank_0s_and_rank_0_warns_when_they_differ():
    """What is not restored is said (docs/checkpoints.md): the saved ranks' generators
    differed, and 3 ranks (or one process) cannot take 2 ranks' states back."""
    state = {"n": 0, "ranks": [{"n": 0}, {"n": 1}]}
    for rank, world in ((0, 1), (0, 3), (2, 3)):
        box = {"n": 9}
        with pytest.warns(FitdpWarning, match="holds the states of 2 ranks, which differ, and "
                          f"this run has {world}") if rank == 0 else nullcontext():
            RankStates(box_entry(box), Ranks(rank, world), "states").load_state_dict(state)
        assert box == {"n": 0}


def test_equal_states_on_another_world_size_load_without_a_word(recwarn):
    """fit(reproducible=True) draws alike on every rank: a resume on another world size
    loses nothing, and says nothing."""
    box = {"n": 9}
    RankStates(box_entry(box), Ranks(0, 1), "states").load_state_dict(
        {"n": 3, "ranks": [{"n": 3}, {"n": 3}]})
    assert box == {"n": 3} and not recwarn.list


def test_the_rng_entry_checks_this_ranks_part():
    entry = RankStates(RNG, Ranks(1, 2), "random generators")
    good = RNG.state_dict()
    assert entry.problem({**good, "ranks": [good, {"torch": 1}]}, {}) is not None
    assert entry.problem({**good, "ranks": [{"torch": 1}, good]}, {}) is None
    before = torch.get_rng_state()
    torch.rand(3)
    entry.load_state_dict({**good, "ranks": [good, {**good, "torch": before}]})
    assert torch.equal(torch.get_rng_state(), before)
