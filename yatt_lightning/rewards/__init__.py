from yatt_lightning.rewards.base import RewardError, RewardFunction, RewardOutput, RuleReward, load_callable
from yatt_lightning.rewards.genrm import GenerativeRewardModel
from yatt_lightning.rewards.math import BoxedFormatReward, MathReward
from yatt_lightning.rewards.parsers import JsonParser, NumberParser, RegexParser, ScoreParser
from yatt_lightning.rewards.reward_model import RewardModel

__all__ = [
    "BoxedFormatReward", "GenerativeRewardModel", "MathReward", "JsonParser", "NumberParser", "RegexParser", "RewardError", "RewardFunction",
    "RewardModel", "RewardOutput", "RuleReward", "ScoreParser", "load_callable",
]  # fmt: skip
