"""choose_buckets: the exact dynamic program over bucket plans, its cost model (each
bucket's short last batch) and its padding cap."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fitdp.data.length_groups
from fitdp.data.bucketing import BucketIterator
from fitdp.data.length_groups import StepCost, choose_buckets


def lognormal_lengths(n: int = 4000, seed: int = 0) -> list[int]:
    """The workload of the padding target: log-normal, clipped to [4, 256], mean ~40."""
    sigma = 0.8
    mu = float(np.log(40.0)) - sigma**2 / 2  # E[lognormal] = exp(mu + sigma^2 / 2) = 40
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 4, 256).astype(int).tolist()



def test_automatic_buckets_keep_padding_under_5_percent_on_lognormal_lengths():
    lengths = lognormal_lengths()
    assert 35 <= np.mean(lengths) <= 45 and min(lengths) >= 4 and max(lengths) <= 256
    seqs = [torch.full((n,), 7) for n in lengths]
    it = BucketIterator(seqs, None, 32, seed=0)
    assert it.buckets == sorted(it.buckets) and it.buckets[-1] == max(lengths)
    assert it.default_bucket_key == max(lengths)
    assert it.padding_fraction <= 0.05
    assert len(it.buckets) <= fitdp.data.length_groups.AUTO_MAX_BUCKETS
    counts = np.bincount(np.searchsorted(it.buckets, lengths), minlength=len(it.buckets))
    assert counts.min() >= 32  # no bucket is only a tiny batch
    pad = sum(b.data.numel() for b in it) - it.num_tokens
    assert pad / (pad + it.num_tokens) == pytest.approx(it.padding_fraction)


def test_choose_buckets_with_many_distinct_lengths_and_few_samples():
    lengths = np.random.default_rng(1).integers(1, 5000, 3000).tolist()  # > 512 distinct
    buckets = choose_buckets(lengths, batch_size=16)
    assert buckets == sorted(buckets) and buckets[-1] == max(lengths)
    counts = np.bincount(np.searchsorted(buckets, lengths), minlength=len(buckets))
    assert counts.min() >= 16
    assert choose_buckets([5, 3, 9], batch_size=8) == [9]  # fewer samples than one batch


def modelled(lengths: list[int], b: int, buckets: list[int], c: StepCost) -> tuple[float, float]:
    """Modelled epoch time and padding share of ``buckets``, bucket by bucket."""
    lens = np.array(lengths)
    of, time, pad = np.searchsorted(buckets, lens), 0.0, 0.0
    for k, w in enumerate(buckets):
        p = int((of == k).sum())
        time += math.ceil(p / b) * (c.fixed + c.per_timestep * w) + c.per_token * p * w
        pad += p * w - lens[of == k].sum()
    return time, pad / (pad + lens.sum())


def every_plan(lengths: list[int], batch_size: int, max_buckets: int) -> list[list[int]]:
    """Every allowed bucket choice: at most max_buckets, each with min(batch_size, n) samples."""
    cand = sorted(set(lengths))
    plans = [[*inner, cand[-1]] for r in range(min(len(cand), max_buckets))
             for inner in itertools.combinations(cand[:-1], r)]
    return [p for p in plans if np.bincount(np.searchsorted(p, lengths), minlength=len(p)).min()
            >= min(batch_size, len(lengths))]


@settings(max_examples=80, deadline=None, database=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=40), st.integers(1, 6),
       st.integers(1, 4), st.sampled_from([fitdp.data.length_groups.GRU_CPU_STEP_COST,
                                           StepCost(0, 0, 1), StepCost(5, 1, 0.1)]),
       st.sampled_from([0.0, 0.05, 0.2, 1.0]))
def test_choose_buckets_is_the_exact_least_modelled_time(lengths, batch_size, max_buckets, cost,
                                                        target):
    got = choose_buckets(lengths, batch_size, target, max_buckets, cost)
    plans = every_plan(lengths, batch_size, max_buckets)
    assert got in plans
    (time, pad), best = modelled(lengths, batch_size, got, cost), min(
        modelled(lengths, batch_size, p, cost) for p in plans)
    if best[1] <= target:  # the cheapest plan pads little enough: it is the answer
        assert time == pytest.approx(best[0], rel=1e-9)
    least_pad = min(modelled(lengths, batch_size, p, cost)[1] for p in plans)
    assert pad <= max(target, least_pad) + 1e-12  # within the target, or least padding


def test_choose_buckets_weighs_each_buckets_short_last_batch():
    lengths = [1] * 5 + [2] * 7  # two buckets: 4 steps, no padding; one: 3 steps, 5 pad tokens
    assert choose_buckets(lengths, 4, step_cost=StepCost(0, 0, 1)) == [1, 2]  # padding only
    assert choose_buckets(lengths, 4, padding_target=1.0) == [2]  # a GRU step's real cost
    assert choose_buckets(lengths, 4) == [1, 2]  # 21% padding is over the 5% target
