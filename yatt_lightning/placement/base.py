"""The placement base class: where the engines and judges run, and its hooks around a step's rollout and
reward. A placement receives values (the setup, the request, the engine), never the service or the
strategy; what it measured (idle seconds, memory) comes back in the values it returns."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psutil
import torch

from yatt_lightning.distributed.layout import Layout
from yatt_lightning.placement.role import Role
from yatt_lightning.rewards.base import RewardFunction
from yatt_lightning.rewards.genrm import GenerativeRewardModel
from yatt_lightning.rollout.types import EngineStart, Generation, RolloutRequest, RolloutSetup


class Placement:
    """Base class; the strategy owns one and hands it its controller, the rollout service drives it."""

    controller = None  # who talks to engines (handed over by the strategy)

    def check(self, layout: Layout) -> None:
        """Raise a ValueError naming the key if this placement cannot serve the layout (in preflight)."""

    @property
    def role(self) -> Role:
        """What this rank does here: every rank does the whole step in a colocated placement."""
        return Role.COLOCATED

    def roles(self, world: int) -> list[list[int]]:
        """The groups of ranks whose steps run together (one: every rank does every stage)."""
        return [list(range(world))]

    def training_world(self, world: int) -> int:
        """How many ranks train (the first ones)."""
        return world

    def hosts_policy_engine(self) -> bool:
        """True on ranks that run the policy's engine (the service readies it there before generating)."""
        return True

    def start_engines(self, setup: RolloutSetup, policy_engine: EngineStart) -> None:
        raise NotImplementedError

    def generate(self, request: RolloutRequest, keep: int, engine) -> Generation:
        """Completions for this rank's prompts (``None`` for groups not kept) on ``engine`` (``None`` where
        this rank hosts none), the scores of reward functions already computed while generating, and this
        rank's figures of it."""
        raise NotImplementedError

    @contextlib.contextmanager
    def scoring(self, reward_functions: list[RewardFunction]) -> Iterator[dict[str, float]]:
        """Around the reward stage of a step (after generation, before training); yields this rank's
        figures of the stage, filled when it ends."""
        figures: dict[str, float] = {}
        yield figures
        figures.update(memory("reward"))

    def shutdown(self, reward_functions: list[RewardFunction]) -> None:
        for genrm in self.judges(reward_functions):
            genrm.shutdown()

    @staticmethod
    def judges(reward_functions: list[RewardFunction]) -> list[GenerativeRewardModel]:
        return [fn for fn in reward_functions if isinstance(fn, GenerativeRewardModel)]


def memory(stage: str) -> dict[str, float]:
    """This process's resident memory after ``stage``, as a rank figure."""
    return {f"memory/{stage}_rss_gb": psutil.Process().memory_info().rss / 2**30}


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
