"""Full colocation: rollout, GenRM and training in series, each on every rank.

On GPU each stage releases what the previous one held (engine sleep / wake, training state offload /
onload); on CPU nothing can be released, so it measures and logs what each stage holds (``memory/*``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from yatt_lightning.placement.base import Placement, memory
from yatt_lightning.rewards.base import RewardFunction
from yatt_lightning.rollout.types import EngineStart, Generation, RolloutRequest, RolloutSetup


class FullColocation(Placement):
    """Rollout, GenRM and training in series, each on every rank."""

    def check(self, layout) -> None:
        self.model_parallel = layout.model_parallel

    def start_engines(self, setup: RolloutSetup, policy_engine: EngineStart) -> None:
        policy_engine.start(setup.engine)
        for genrm in self.judges(setup.reward_functions):
            if self.model_parallel != 1:
                raise ValueError(
                    "a GenerativeRewardModel runs with data parallelism only for now; set "
                    "`trainer.strategy.tensor_model_parallel_size` and `pipeline_model_parallel_size` to 1."
                )
            genrm.start(seed=setup.engine.seed, max_num_seqs=setup.engine.max_num_seqs, dtype=setup.engine.dtype)
            genrm.engine.sleep()

    def generate(self, request: RolloutRequest, keep: int, engine) -> Generation:
        groups = self.controller.generate(request, keep, engine)
        return Generation(groups, rank_figures=memory("rollout"))

    @contextlib.contextmanager
    def scoring(self, reward_functions: list[RewardFunction]) -> Iterator[dict[str, float]]:
        """The judges' engines are awake for the reward stage only: on a GPU they hold memory that the
        policy's engine (asleep by now) and training need at the other stages."""
        judges = self.judges(reward_functions)
        for genrm in judges:
            genrm.engine.wake_up()
        figures: dict[str, float] = {}
        try:
            yield figures
            figures.update(memory("reward"))
        finally:
            for genrm in judges:
                genrm.engine.sleep()
