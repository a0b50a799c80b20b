"""Tier 1: packing sequences into micro-batches under a token budget (yatt_lightning.training.packing)."""

import random

import pytest

from yatt_lightning.training.packing import pack_by_tokens, packed_cost


def _fill_to_budget(lengths, budget, pad=8):
    """The packer this replaced: longest first, each micro-batch filled up to the budget."""
    plan, longest = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        if plan and (len(plan[-1]) + 1) * longest[-1] <= budget:
            plan[-1].append(i)
        else:
            plan.append([i])
            longest.append(-(-lengths[i] // pad) * pad)
    return plan


def _long_tailed(rng, n):
    return [min(216, max(3, int(16 * rng.lognormvariate(0, 1)))) for _ in range(n)]


@pytest.mark.parametrize("overhead", [0, 64, 256, 10_000])
def test_every_sequence_once_within_budget_and_never_costlier_than_filling(overhead):
    rng = random.Random(overhead)
    for _ in range(50):
        lengths = _long_tailed(rng, rng.randint(1, 80))
        plan = pack_by_tokens(lengths, 512, overhead)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        for mb in plan:
            padded = len(mb) * (-(-max(lengths[i] for i in mb) // 8) * 8)
            assert padded <= 512 or len(mb) == 1
        greedy = _fill_to_budget(lengths, 512)
        assert packed_cost(lengths, plan, overhead) <= packed_cost(lengths, greedy, overhead)


def test_a_long_sequence_does_not_pad_the_short_ones():
    """One 200-token sequence and twenty 10-token ones, budget 2048: filling pads nine short ones to 200
    (1 800 padded tokens wasted); the packer gives the long one its own micro-batch."""
    lengths = [200] + [10] * 20
    plan = pack_by_tokens(lengths, 2048, overhead_tokens=256)
    assert plan[0] == [0]
    assert packed_cost(lengths, plan, 256) == 200 + 20 * 16 + 2 * 256
    assert packed_cost(lengths, _fill_to_budget(lengths, 2048), 256) == 10 * 200 + 11 * 16 + 2 * 256


def test_no_overhead_means_no_padding_and_a_huge_one_means_fewest_micro_batches():
    lengths = [17, 40, 40, 64, 9, 120]
    assert all(len({-(-lengths[i] // 8) for i in mb}) == 1 for mb in pack_by_tokens(lengths, 4096, 0))
    assert len(pack_by_tokens(lengths, 4096, 10**9)) == 1
    assert pack_by_tokens([], 64) == []
    with pytest.raises(ValueError, match="token_budget"):
        pack_by_tokens([5], 0)
