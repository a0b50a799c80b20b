"""Full colocation: rollout, GenRM and training in series, each on every rank.

On GPU each stage releases what the previous one held (engine sleep / wake, training state offload /
onload); on CPU nothing can be released, so it measures and logs what each stage holds (``memory/*``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from yatt_lightning.placement.base import Placement
from yatt_lightning.rewards.base import RewardFunction

if TYPE_CHECKING:
    from yatt_lightning.rollout.service import Generation, RolloutRequest, RolloutService


class FullColocation(Placement):
    """Rollout, GenRM and training in series, each on every rank."""

    def start_engines(self, service: RolloutService) -> None:
        strategy, setup = service.strategy, service.setup
        strategy.start_policy_engine(setup.engine)
        for genrm in self.judges(setup.reward_functions):
            if strategy.tensor_model_parallel_size * strategy.pipeline_model_parallel_size != 1:
                raise ValueError(
                    "a GenerativeRewardModel runs with data parallelism only for now; set "
                    "`trainer.strategy.tensor_model_parallel_size` and `pipeline_model_parallel_size` to 1."
                )
            genrm.start(seed=setup.engine.seed, max_num_seqs=setup.engine.max_num_seqs, dtype=setup.engine.dtype)
            genrm.engine.sleep()

    def generate(self, service: RolloutService, request: RolloutRequest, keep: int) -> Generation:
        from yatt_lightning.rollout.service import Generation

        self.reset_step()
        groups = service.strategy.controller.generate(service, request, keep)
        self.record_memory("rollout")
        return Generation(groups)

    @contextlib.contextmanager
    def scoring(self, reward_functions: list[RewardFunction]) -> Iterator[None]:
        """The judges' engines are awake for the reward stage only: on a GPU they hold memory that the
        policy's engine (asleep by now) and training need at the other stages."""
        judges = self.judges(reward_functions)
        for genrm in judges:
            genrm.engine.wake_up()
        try:
            yield
        finally:
            for genrm in judges:
                genrm.engine.sleep()
