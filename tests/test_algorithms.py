"""Tier 1: advantage estimators, policy losses and KL estimators against hand-derived numbers."""

import math

import pytest
import torch

from yatt_lightning.algorithms import K1, K3, GRPOAdvantage, PPOClipLoss


def test_grpo_advantage_hand_derived():
    """Group 0 rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735, so the
    advantages are +-0.5 / 0.57735 = +-0.866025. Group 1 rewards [2, 2]: all equal, advantage 0."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = GRPOAdvantage(eps=1e-12)(rewards, groups)
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_grpo_advantage_without_std_only_centres():
    """Dr. GRPO: rewards [3, 1] in one group -> mean 2 -> advantages [1, -1]."""
    adv = GRPOAdvantage(normalize_std=False)(torch.tensor([3.0, 1.0]), torch.tensor([7, 7]))
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))


def test_grpo_groups_are_independent_of_order():
    rewards = torch.tensor([0.0, 5.0, 1.0, 7.0])
    groups = torch.tensor([0, 1, 0, 1])
    adv = GRPOAdvantage()(rewards, groups)
    assert adv[0] < 0 < adv[2] and adv[1] < 0 < adv[3]
    torch.testing.assert_close(adv[0], -adv[2])


def test_ppo_clip_loss_hand_derived():
    """eps = 0.2. Token 1: ratio 1.5, A=+1 -> min(1.5, 1.2) = 1.2 -> loss -1.2, clipped.
    Token 2: ratio 1.5, A=-1 -> min(-1.5, -1.2) = -1.5 -> loss 1.5, not clipped.
    Token 3: ratio 0.5, A=+1 -> min(0.5, 0.8) = 0.5 -> loss -0.5, not clipped.
    Token 4: ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped."""
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, metrics = PPOClipLoss(clip_eps=0.2)(logp, old, adv, torch.ones(1, 4))
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


def test_k3_hand_derived():
    """logp = log 0.5, ref = log 0.25: log_ratio = log 0.5 = -0.693147; k3 = 0.5 + 0.693147 - 1 = 0.193147."""
    kl = K3()(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert kl.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert K3()(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0
    assert K1()(torch.tensor([-1.0]), torch.tensor([-3.0])).item() == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"clip_eps": 0.0}, "model.algorithm.clip_eps"), ({"clip_eps": 0.2, "clip_eps_high": -1}, "clip_eps_high")],
)
def test_invalid_loss_settings_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOClipLoss(**kwargs)
