"""The algorithm library: one small class per estimator, loss, aggregation, correction and shaping.

Each family's classes register by name (:mod:`~yatt_lightning.algorithms.registry`); a YAML file picks one
with ``class_path``, and a user's own subclass in the user's own file is picked the same way.
"""

from yatt_lightning.algorithms.advantage import (
    GAE,
    AdvantageEstimator,
    AdvantageInputs,
    Advantages,
    GRPOAdvantage,
    ReinforcePlusPlus,
    RLOOAdvantage,
)
from yatt_lightning.algorithms.aggregation import ConstantNormalizer, LossAggregation, SequenceMean, TokenMean
from yatt_lightning.algorithms.kl import K1, K2, K3, KLEstimator
from yatt_lightning.algorithms.off_policy import OffPolicyCorrection, TruncatedIS
from yatt_lightning.algorithms.overlong import OverlongPenalty, RewardShaping
from yatt_lightning.algorithms.policy_loss import GSPOLoss, PolicyLoss, PPOClipLoss
from yatt_lightning.algorithms.registry import registered

__all__ = [
    "GAE", "AdvantageEstimator", "AdvantageInputs", "Advantages", "GRPOAdvantage", "ReinforcePlusPlus",
    "RLOOAdvantage", "ConstantNormalizer", "LossAggregation", "SequenceMean", "TokenMean", "KLEstimator", "K1",
    "K2", "K3", "OffPolicyCorrection", "TruncatedIS", "OverlongPenalty", "RewardShaping", "GSPOLoss",
    "PolicyLoss", "PPOClipLoss", "registered",
]  # fmt: skip
