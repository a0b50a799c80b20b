from yatt_lightning.rewards.base import FunctionReward, RewardError, RewardFunction, load_callable

__all__ = ["FunctionReward", "RewardError", "RewardFunction", "load_callable"]
