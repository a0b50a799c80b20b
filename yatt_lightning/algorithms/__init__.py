from yatt_lightning.algorithms.advantage import AdvantageEstimator, Advantages, GRPOAdvantage
from yatt_lightning.algorithms.kl import K1, K2, K3, KLEstimator
from yatt_lightning.algorithms.policy_loss import PolicyLoss, PPOClipLoss

__all__ = [
    "AdvantageEstimator", "Advantages", "GRPOAdvantage", "KLEstimator", "K1", "K2", "K3", "PolicyLoss", "PPOClipLoss",
]  # fmt: skip
