"""Tier 1: advantage estimators, policy losses, aggregations, corrections, KL estimators, the critic's loss
and the registry, against hand-derived numbers (written in each test's docstring)."""

import math

import pytest
import torch

from yatt_lightning.algorithms import (
    GAE,
    K1,
    K2,
    K3,
    AdvantageEstimator,
    AdvantageInputs,
    Advantages,
    ConstantNormalizer,
    GRPOAdvantage,
    GSPOLoss,
    OverlongPenalty,
    PPOClipLoss,
    ReinforcePlusPlus,
    RLOOAdvantage,
    SequenceMean,
    TokenMean,
    TruncatedIS,
    registered,
)  # fmt: skip
from yatt_lightning.training.critic import Critic


def _inputs(rewards, groups, lengths=None, **kwargs) -> AdvantageInputs:
    rewards = torch.tensor(rewards, dtype=torch.float)
    lengths = lengths or [1] * len(rewards)
    return AdvantageInputs(rewards, torch.tensor(groups), lengths, **kwargs)


def _tokens(advantages: Advantages) -> list[list[float]]:
    return [[round(v, 4) for v in t.tolist()] for t in advantages.tokens]


# ----------------------------------------------------------------------------------- advantage estimators
def test_grpo_advantage_hand_derived():
    """Group 0 rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735, so the
    advantages are +-0.5 / 0.57735 = +-0.866025. Group 1 rewards [2, 2]: all equal, advantage 0."""
    adv = GRPOAdvantage(eps=1e-12)(_inputs([1.0, 0.0, 0.0, 1.0, 2.0, 2.0], [0, 0, 0, 0, 1, 1])).values
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_grpo_advantage_without_std_only_centres():
    """Dr. GRPO: rewards [3, 1] in one group -> mean 2 -> advantages [1, -1]."""
    adv = GRPOAdvantage(normalize_std=False)(_inputs([3.0, 1.0], [7, 7])).values
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))


def test_grpo_groups_are_independent_of_order():
    adv = GRPOAdvantage()(_inputs([0.0, 5.0, 1.0, 7.0], [0, 1, 0, 1])).values
    assert adv[0] < 0 < adv[2] and adv[1] < 0 < adv[3]
    torch.testing.assert_close(adv[0], -adv[2])


def test_rloo_leave_one_out_hand_derived():
    """Group [1, 0, 0, 1]: sample 0's baseline is the mean of (0, 0, 1) = 1/3 -> 2/3; sample 1's is the mean
    of (1, 0, 1) = 2/3 -> -2/3. Group [2, 2]: 0. A group of one sample: 0 (no other sample)."""
    adv = RLOOAdvantage()(_inputs([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0], [0, 0, 0, 0, 1, 1, 2])).values
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0]))


def test_reinforce_pp_returns_normalised_over_the_batch():
    """Rewards [1, 0], lengths [2, 1], gamma 1: per-token returns [1, 1] and [0]. Over the three tokens the
    mean is 2/3 and the population variance 2/3 - 4/9 = 2/9 (std 0.471405): (1 - 2/3) / 0.471405 = 0.707107
    and (0 - 2/3) / 0.471405 = -1.414214.
    With per-token rewards [-0.5, 0] on sample 0 its rewards are [-0.5, 1] -> returns [0.5, 1]; tokens
    [0.5, 1, 0]: mean 0.5, variance 1.25/3 - 0.25 = 1/6 (std 0.408248) -> [0, 1.224745, -1.224745]."""
    adv = ReinforcePlusPlus(eps=1e-12)(_inputs([1.0, 0.0], [0, 1], [2, 1]))
    assert _tokens(adv) == [[0.7071, 0.7071], [-1.4142]]
    adv = ReinforcePlusPlus(eps=1e-12)(
        _inputs([1.0, 0.0], [0, 1], [2, 1], token_rewards=[torch.tensor([-0.5, 0.0]), torch.zeros(1)])
    )
    assert _tokens(adv) == [[0.0, 1.2247], [-1.2247]]


def test_reinforce_pp_baseline_and_global_normalisation_across_ranks():
    """With the group baseline, rewards [1, 0] of one group become [0.5, -0.5]; returns [0.5, 0.5], [-0.5];
    mean 1/6, std 0.471405 -> [0.707107, 0.707107], [-1.414214].
    Two ranks holding one sample each (an all_reduce that adds the other rank's sums) normalise with the
    statistics of all three tokens, as one rank holding both samples does."""
    adv = ReinforcePlusPlus(group_baseline=True, eps=1e-12)(_inputs([1.0, 0.0], [0, 0], [2, 1]))
    assert _tokens(adv) == [[0.7071, 0.7071], [-1.4142]]
    # rank A holds sample 0 (returns [1, 1]), rank B sample 1 (returns [0]); no baseline
    sums_a = torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64)  # sum, sum of squares, count
    sums_b = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    a = ReinforcePlusPlus(eps=1e-12)(_inputs([1.0], [0], [2], all_reduce=lambda t: t + sums_b))
    b = ReinforcePlusPlus(eps=1e-12)(_inputs([0.0], [1], [1], all_reduce=lambda t: t + sums_a))
    assert _tokens(a) == [[0.7071, 0.7071]] and _tokens(b) == [[-1.4142]]


def test_gae_hand_derived():
    """One sample of 3 tokens, reward 1 at the end, values [0.5, 0.2, 0.4], gamma 1, lambda 0.5:
    deltas: 0 + 0.2 - 0.5 = -0.3, 0 + 0.4 - 0.2 = 0.2, 1 + 0 - 0.4 = 0.6;
    A_2 = 0.6, A_1 = 0.2 + 0.5 * 0.6 = 0.5, A_0 = -0.3 + 0.5 * 0.5 = -0.05; returns A + V = [0.45, 0.7, 1.0].
    With lambda 1 the advantages are the return 1 minus the value: [0.5, 0.8, 0.6], returns all 1."""
    values = [torch.tensor([0.5, 0.2, 0.4])]
    adv = GAE(gamma=1.0, lam=0.5, whiten=False)(_inputs([1.0], [0], [3], values=values))
    assert _tokens(adv) == [[-0.05, 0.5, 0.6]]
    assert [round(v, 4) for v in adv.returns[0].tolist()] == [0.45, 0.7, 1.0]
    assert adv.old_values[0].tolist() == values[0].tolist()
    adv = GAE(gamma=1.0, lam=1.0, whiten=False)(_inputs([1.0], [0], [3], values=values))
    assert _tokens(adv) == [[0.5, 0.8, 0.6]] and [round(v, 4) for v in adv.returns[0].tolist()] == [1.0, 1.0, 1.0]


def test_gae_discount_and_whitening():
    """gamma 0.5, lambda 1, values 0, reward 1 on the last of 2 tokens: A = [0.5, 1]; whitened over the two
    tokens (mean 0.75, std 0.25): [-1, 1]; the value targets stay [0.5, 1]."""
    adv = GAE(gamma=0.5, lam=1.0, whiten=True, eps=1e-12)(_inputs([1.0], [0], [2], values=[torch.zeros(2)]))
    assert _tokens(adv) == [[-1.0, 1.0]] and adv.returns[0].tolist() == [0.5, 1.0]


def test_advantages_are_per_sample_or_per_token():
    with pytest.raises(ValueError, match="either one value per sample"):
        Advantages()
    with pytest.raises(ValueError, match="come together"):
        Advantages(tokens=[torch.zeros(1)], returns=[torch.zeros(1)])
    adv = Advantages(torch.tensor([2.0, -1.0]))
    assert adv.per_token(1, 3).tolist() == [-1.0, -1.0, -1.0] and len(adv.select([1])) == 1


# ----------------------------------------------------------------------------------- policy losses
def test_ppo_clip_loss_hand_derived():
    """eps = 0.2. Token 1: ratio 1.5, A=+1 -> min(1.5, 1.2) = 1.2 -> loss -1.2, clipped.
    Token 2: ratio 1.5, A=-1 -> min(-1.5, -1.2) = -1.5 -> loss 1.5, not clipped.
    Token 3: ratio 0.5, A=+1 -> min(0.5, 0.8) = 0.5 -> loss -0.5, not clipped.
    Token 4: ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped."""
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, metrics = PPOClipLoss(clip_eps=0.2)(logp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.5, -0.5, 0.8]]))
    torch.testing.assert_close(metrics["clip_fraction"], torch.tensor([[1.0, 0.0, 0.0, 1.0]]))


def test_ppo_clip_higher_is_asymmetric():
    """DAPO clip-higher: eps_low 0.2, eps_high 0.28; ratio 1.5 with A=+1 clips at 1.28."""
    loss, _ = PPOClipLoss(clip_eps=0.2, clip_eps_high=0.28)(
        torch.log(torch.tensor([[1.5]])), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    )
    torch.testing.assert_close(loss, torch.tensor([[-1.28]]))


def test_ppo_gradient_vanishes_when_clipped():
    logp = torch.log(torch.tensor([[1.5]])).requires_grad_()
    loss, _ = PPOClipLoss(0.2)(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_dual_clip_bounds_negative_advantages():
    """c = 3. Ratio 5, A=-1: PPO's loss is -min(-5, -1.2) = 5, above the bound -c A = 3 -> 3, and no
    gradient. Ratio 2, A=-1: 2 < 3, unchanged, gradient d(2 e^x)/dx = 2 at x = log 2... = ratio * -A = 2.
    Ratio 5, A=+1: -min(5, 1.2) = -1.2, dual-clip does not apply to positive advantages."""
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]])).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, metrics = PPOClipLoss(0.2, dual_clip=3.0)(logp, torch.zeros(1, 3), adv, torch.ones(1, 3))
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2]]), rtol=0, atol=1e-6)
    assert metrics["actor/dual_clip_fraction"].tolist() == [[1.0, 0.0, 0.0]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0, 0.0]]), rtol=0, atol=1e-6)


def test_gspo_uses_the_sequence_ratio():
    """Sequence 0: log-ratios [0.1, 0.3] -> mean 0.2 -> s = e^0.2 = 1.2214 > 1.2 (eps 0.2) with A=+1: clipped,
    loss -1.2 on both tokens, no gradient. Sequence 1: log-ratios [0.05, -0.05] (and a padded position
    with log-ratio 9, masked out) -> s = 1 -> loss -1 per token; d(-s_t A)/dlogp_t = -s = -1 on each token."""
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 0.0], [0.05, -0.05, 9.0]]).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, metrics = GSPOLoss(clip_eps=0.2, clip_eps_high=0.2)(logp, old, torch.ones(2, 3), mask)
    torch.testing.assert_close((loss * mask), torch.tensor([[-1.2, -1.2, 0.0], [-1.0, -1.0, 0.0]]), rtol=0, atol=1e-6)
    assert metrics["ratio"][0, 0].item() == pytest.approx(math.exp(0.2), abs=1e-6)
    (loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [-1.0, -1.0, 0.0]]), rtol=0, atol=1e-6)


def test_invalid_loss_settings_name_the_key():
    for kwargs, match in (({"clip_eps": 0.0}, "model.algorithm.clip_eps"),
                          ({"clip_eps": 0.2, "clip_eps_high": -1}, "clip_eps_high"),
                          ({"dual_clip": 1.0}, "model.algorithm.dual_clip")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            PPOClipLoss(**kwargs)


# ----------------------------------------------------------------------------------- aggregation
def test_aggregations_hand_derived():
    """Masks [[1, 1, 1, 0], [1, 0, 0, 0]] and per-token loss [[1, 2, 3, 100], [4, 0, 0, 0]] (the 100 is padding):
    token mean (1 + 2 + 3 + 4) / 4 = 2.5; sequence mean ((1 + 2 + 3) / 3 + 4 / 1) / 2 = 3;
    Dr. GRPO's constant with max_new_tokens 4: (6 + 4) / (2 sequences x 4) = 1.25."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 0.0, 0.0, 0.0]])
    for aggregation, expected in ((TokenMean(), 2.5), (SequenceMean(), 3.0), (ConstantNormalizer(), 1.25)):
        weights, count = aggregation.weights(mask, 4)
        assert ((loss * weights).sum() / count).item() == pytest.approx(expected), type(aggregation).__name__
    weights, count = ConstantNormalizer(max_tokens=8).weights(mask, 4)
    assert ((loss * weights).sum() / count).item() == pytest.approx(0.625)


# ----------------------------------------------------------------------------------- corrections, KL, shaping
def test_truncated_importance_sampling_hand_derived():
    """old - engine logprobs [log 3, log 0.5]: ratios [3, 0.5]; capped at 2 -> weights [2, 0.5]; one of two
    tokens truncated."""
    weight, metrics = TruncatedIS(cap=2.0)(torch.log(torch.tensor([3.0, 0.5])), torch.zeros(2))
    torch.testing.assert_close(weight, torch.tensor([2.0, 0.5]))
    assert metrics["off_policy/tis_truncated"].tolist() == [1.0, 0.0]
    assert not weight.requires_grad


def test_kl_estimators_hand_derived():
    """logp = log 0.5, ref = log 0.25: k1 = log 0.5 - log 0.25 = 0.693147; k2 = 0.693147^2 / 2 = 0.240227;
    log_ratio = ref - logp = -0.693147, k3 = 0.5 + 0.693147 - 1 = 0.193147."""
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert K1()(logp, ref).item() == pytest.approx(math.log(2), abs=1e-6)
    assert K2()(logp, ref).item() == pytest.approx(math.log(2) ** 2 / 2, abs=1e-6)
    assert K3()(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert K3()(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0


def test_overlong_penalty_hand_derived():
    """max_new_tokens 8, cache 2: no penalty up to 6 tokens; 7 tokens (6 - 7) / 2 = -0.5; 8 tokens -1."""
    penalty = OverlongPenalty(cache=2)(torch.tensor([3.0, 6.0, 7.0, 8.0]), 8)
    assert penalty.tolist() == [0.0, 0.0, -0.5, -1.0]
    assert OverlongPenalty(cache=2, weight=0.1)(torch.tensor([8.0]), 8).item() == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="model.reward_shaping.cache"):
        OverlongPenalty(cache=8)(torch.tensor([1.0]), 8)


def test_critic_value_loss_hand_derived():
    """c = 0.2. V 1.0, V_old 0.5, R 0: unclipped (1 - 0)^2 = 1, clipped V 0.7 -> 0.49; max 1 -> 0.5.
    V 1.2, V_old 0.5, R 1: unclipped 0.04, clipped V 0.7 -> 0.09 is larger -> 0.045, clipped, and no
    gradient (the clipped value does not move with V)."""
    values = torch.tensor([1.0, 1.2]).requires_grad_()
    loss, clipped = Critic(value_clip=0.2).loss(values, torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(loss, torch.tensor([0.5, 0.045]))
    assert clipped.tolist() == [0.0, 1.0]
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([1.0, 0.0]))
    unclipped, _ = Critic(value_clip=None).loss(torch.tensor([1.2]), torch.tensor([1.0]), torch.tensor([0.5]))
    assert unclipped.item() == pytest.approx(0.02)


# ----------------------------------------------------------------------------------- registry and refusals
def test_every_family_registers_its_classes_by_name():
    assert {"GRPOAdvantage", "RLOOAdvantage", "ReinforcePlusPlus", "GAE"} <= set(registered("advantage estimator"))
    assert {"PPOClipLoss", "GSPOLoss"} <= set(registered("policy loss"))
    assert {"TokenMean", "SequenceMean", "ConstantNormalizer"} <= set(registered("loss aggregation"))


def test_two_classes_with_one_name_are_refused_naming_both():
    with pytest.raises(TypeError, match=r"named 'RLOOAdvantage': yatt_lightning\.algorithms\.advantage\.RLOOAdvantage and "
                       r"tests\.test_algorithms\..*RLOOAdvantage"):  # fmt: skip

        class RLOOAdvantage(AdvantageEstimator):
            pass

    class Renamed(AdvantageEstimator):
        name = "my-rloo"

    assert registered("advantage estimator")["my-rloo"] is Renamed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"advantage_estimator": GAE()}, r"`model.critic` is not set"),
        ({"critic": Critic()}, r"does not use its values"),
        (
            {"advantage_estimator": ReinforcePlusPlus(group_baseline=True), "sampling": {"n": 1}},
            r"`model.sampling.n`=1",
        ),
        ({"advantage_estimator": RLOOAdvantage(), "sampling": {"n": 1}}, r"`model.sampling.n`=1"),
        ({"kl_in_reward": True}, r"`model.kl_in_reward` is true but `model.kl_coef` is 0"),
    ],
    ids=["gae-without-critic", "critic-without-gae", "baseline-group-of-one", "rloo-group-of-one", "kl-in-reward-0"],
)
def test_combinations_that_cannot_work_are_refused_at_construction(kwargs, match):
    from yatt_lightning.engines.base import SamplingConfig
    from yatt_lightning.module import RLHFModule

    if "sampling" in kwargs:
        kwargs["sampling"] = SamplingConfig(**kwargs["sampling"])
    with pytest.raises(ValueError, match=match):
        RLHFModule(**kwargs)
