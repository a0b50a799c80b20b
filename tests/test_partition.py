"""Tier 1: the Karmarkar-Karp partitioner used by DPLoadBalancer."""

import random

import pytest

from yatt_lightning.training.partition import balanced_partition, greedy_partition, imbalance, karmarkar_karp


def _sums(weights, parts):
    return sorted(sum(weights[i] for i in p) for p in parts)


def test_hand_built_case_is_perfect():
    """[8, 7, 6, 5, 4, 3] into 2 parts of 3: the total is 33, so 17 / 16 is the best possible.
    KK: chunks (8,7), (6,5), (4,3) with spreads 1, 1, 1; merging gives {8,5,4}=17 / {7,6,3}=16 or equal."""
    weights = [8, 7, 6, 5, 4, 3]
    parts = karmarkar_karp(weights, 2)
    assert _sums(weights, parts) == [16, 17]
    assert sorted(len(p) for p in parts) == [3, 3]


def test_equal_weights_split_evenly_and_every_item_once():
    parts = karmarkar_karp([1.0] * 12, 3)
    assert sorted(i for p in parts for i in p) == list(range(12))
    assert [len(p) for p in parts] == [4, 4, 4]


def test_long_tail_is_balanced():
    """One 10x outlier per 8 items on 2 parts: KK pairs the outliers on different parts."""
    weights = [100, 10, 10, 10, 10, 10, 10, 10, 100, 10, 10, 10, 10, 10, 10, 10]
    assert _sums(weights, karmarkar_karp(weights, 2)) == [170, 170]
    assert _sums(weights, balanced_partition(weights, 2)) == [170, 170]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_never_worse_than_greedy_and_sizes_equal(k):
    rng = random.Random(k)
    better = 0
    for _ in range(200):
        n = k * rng.randint(1, 12)
        weights = [int(rng.lognormvariate(4, 1)) + 1 for _ in range(n)]
        parts = balanced_partition(weights, k)
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert all(len(p) == n // k for p in parts)
        greedy = imbalance(weights, greedy_partition(weights, k))
        assert imbalance(weights, parts) <= greedy + 1e-9
        better += imbalance(weights, parts) < greedy - 1e-9
    assert better > 60, f"only {better}/200 long-tailed inputs improved on the greedy split"


def test_unequal_count_is_rejected():
    with pytest.raises(ValueError, match="cannot be split into 2 parts of equal count"):
        karmarkar_karp([1, 2, 3], 2)
