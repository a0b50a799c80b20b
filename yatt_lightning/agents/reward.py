"""The environment's rewards as a reward function: each turn's reward on the turn's last token."""

from __future__ import annotations

from yatt_lightning.rewards.base import RewardOutput, TokenRewardFunction


class EnvironmentReward(TokenRewardFunction):
    """Each episode's turn rewards (:class:`~yatt_lightning.agents.environment.Observation` ``reward``) on
    the last token of their turn: the per-token reward path, so GAE and REINFORCE++ credit each turn and
    the group estimators add them to the episode's reward. Added by the module when ``model.agent`` is set
    and no reward function of this class is listed.

    Args:
        weight: Multiplies the rewards in the sum of rewards.
        name: Name in logs.
    """

    def __init__(self, weight: float = 1.0, name: str = "environment") -> None:
        super().__init__(weight=weight, name=name)

    def rollout_scores(self, batch) -> RewardOutput:
        tokens, total = [], 0.0
        for k, ids in enumerate(batch.completion_ids):
            values = [0.0] * len(ids)
            if batch.turns is not None:
                turns = batch.turns[k]
                for end, reward in zip(turns.ends, turns.rewards, strict=True):
                    values[end] += reward
            total += sum(values)
            tokens.append(values)
        return RewardOutput([0.0] * len(batch), {f"reward/{self.name}/sum": total}, tokens)
