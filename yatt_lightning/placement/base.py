"""The placement base class: its hooks around a step's rollout and reward, and the bookkeeping it shares."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psutil

from yatt_lightning.rewards.base import RewardFunction
from yatt_lightning.rewards.genrm import GenerativeRewardModel

if TYPE_CHECKING:
    from yatt_lightning.rollout.service import Generation, RolloutRequest, RolloutService


class Placement:
    """Base class; the strategy owns one, the rollout service drives it."""

    idle = 0.0  # this step's waiting for another rank or for work, in the rollout + reward phase
    memory: dict[str, float] = {}

    def check(self, strategy) -> None:
        """Raise a ValueError naming the key if this placement cannot serve the layout."""

    def start_engines(self, service: RolloutService) -> None:
        raise NotImplementedError

    def generate(self, service: RolloutService, request: RolloutRequest, keep: int) -> Generation:
        """Completions for this rank's prompts (``None`` for groups not kept) and the scores of reward
        functions already computed while generating."""
        raise NotImplementedError

    @contextlib.contextmanager
    def scoring(self, reward_functions: list[RewardFunction]) -> Iterator[None]:
        """Around the reward stage of a step (after generation, before training)."""
        yield

    def shutdown(self, reward_functions: list[RewardFunction]) -> None:
        for genrm in self.judges(reward_functions):
            genrm.shutdown()

    @staticmethod
    def judges(reward_functions: list[RewardFunction]) -> list[GenerativeRewardModel]:
        return [fn for fn in reward_functions if isinstance(fn, GenerativeRewardModel)]

    # -- bookkeeping shared by the placements
    def reset_step(self) -> None:
        self.idle = 0.0
        self.memory = {}

    def record_memory(self, stage: str) -> None:
        self.memory[f"memory/{stage}_rss_gb"] = psutil.Process().memory_info().rss / 2**30
