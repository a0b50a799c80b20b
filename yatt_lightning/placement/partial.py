"""Partial colocation: the policy's engine on the rollout ranks, the judge on the judge ranks, at once.

The judge ranks send their prompts to the rollout ranks; as each prompt's samples finish, the rollout rank
streams them to a judge rank, which scores whatever has arrived while generation continues; scores go back
to the rank that owns the prompt. Then every rank trains (data parallel over all of them). Its engines run
inside the trainers' processes, like full colocation's (each rank starts its first engine at the same
point: vLLM's process groups hang off the trainer's). The two sides: ``partial_rollout.py`` and
``partial_judge.py``; their messages: ``stream.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from yatt_lightning.distributed import collectives, wire
from yatt_lightning.placement.base import Placement
from yatt_lightning.placement.stream import JudgeWork

if TYPE_CHECKING:
    from yatt_lightning.rollout.service import Generation, RolloutRequest, RolloutService


class PartialColocation(Placement):
    """Rollout ranks generate while judge ranks score, streaming each finished group.

    Args:
        rollout_ranks: Global ranks that host the policy engine (default: the first half); the others
            host the judge's engine. Each judge rank is paired with rollout rank ``index % len(rollout)``.
        min_judge_batch: While the judge's engine is idle, arriving samples are held until this many are
            waiting (or the stream ends), then judged as one batch; samples arriving meanwhile form the
            next. An engine step has a fixed cost, so judging each sample the moment it arrives spends
            the judge's time on tiny batches, while waiting for a large batch delays the overlap. ``None``
            (default): a quarter of the samples the judge rank receives per step.
    """

    def __init__(self, rollout_ranks: list[int] | None = None, min_judge_batch: int | None = None) -> None:
        if min_judge_batch is not None and min_judge_batch < 1:
            raise ValueError(f"`placement.min_judge_batch` must be >= 1, got {min_judge_batch}.")
        self.rollout_ranks = rollout_ranks
        self.min_judge_batch = min_judge_batch
        self.group = None  # the stream's own process group

    def check(self, strategy) -> None:
        world = strategy.world_size
        if world < 2:
            raise ValueError(
                "`trainer.strategy.placement`: PartialColocation needs at least 2 processes (`trainer.devices`)."
            )
        if strategy.tensor_model_parallel_size * strategy.pipeline_model_parallel_size != 1:
            raise ValueError(
                "`trainer.strategy.placement`: PartialColocation supports data parallelism only; set "
                "tensor_model_parallel_size and pipeline_model_parallel_size to 1."
            )
        rollout = self.rollout_ranks or list(range(world // 2))
        if not rollout or len(rollout) >= world or any(r < 0 or r >= world for r in rollout):
            raise ValueError(f"`placement.rollout_ranks` {rollout} must name some, not all, of the {world} ranks.")
        if 2 * len(set(rollout)) > world:
            raise ValueError(
                f"`placement.rollout_ranks` {rollout}: each rollout rank needs a judge rank of its own; name at most "
                f"half of the {world} ranks."
            )
        self.rollout = sorted(rollout)
        self.judge = [r for r in range(world) if r not in self.rollout]

    # -- roles
    def partner_rollout(self, rank: int) -> int:
        return self.rollout[self.judge.index(rank) % len(self.rollout)]

    def partner_judges(self, rank: int) -> list[int]:
        return [j for j in self.judge if self.partner_rollout(j) == rank]

    def judge_for(self, owner: int, own_turns: Iterator[int]) -> int:
        """The judge rank a finished group goes to: its owner when that is a judge rank (its scores and
        samples are then where it trains), else the next of the rollout rank's judges in turn."""
        return owner if owner in self.judge else next(own_turns)

    def judge_batch(self, rank: int, n_prompts: int, n_samples: int) -> int:
        """Samples the judge on ``rank`` holds before judging while idle (see ``min_judge_batch``)."""
        if self.min_judge_batch is not None:
            return self.min_judge_batch
        source = self.partner_rollout(rank)
        judges = len(self.partner_judges(source))
        expected = n_prompts * n_samples * (judges + 1) / judges  # its own groups and a share of the source's
        return max(1, int(expected) // 4)

    # -- a step
    def start_engines(self, service: RolloutService) -> None:
        from yatt_lightning.rollout.longtail import PartialRollout

        strategy, setup = service.strategy, service.setup
        self.check(strategy)
        if isinstance(setup.long_tail, PartialRollout):
            raise ValueError("`model.long_tail`: PartialRollout works with FullColocation; use OverProvision here.")
        if not self.judges(setup.reward_functions):
            raise ValueError(
                "PartialColocation overlaps generation with a GenerativeRewardModel; add one to `model.rewards`."
            )
        # A separate group carries the stream, so it never interleaves with the trainer's collectives.
        self.group = torch.distributed.new_group(backend="gloo")
        rank = strategy.global_rank
        # In-process engines join the trainer's process group: vLLM's groups are created by whichever engine
        # starts first on each rank, so every rank starts one here, at the same point.
        if rank in self.rollout:
            strategy.start_policy_engine(setup.engine, batch_scale=len(self.partner_judges(rank)) + 1)
        else:
            spec = setup.engine
            for genrm in self.judges(setup.reward_functions):
                genrm.start(seed=spec.seed, max_num_seqs=spec.max_num_seqs * 2, dtype=spec.dtype)

    def generate(self, service: RolloutService, request: RolloutRequest, keep: int) -> Generation:
        from yatt_lightning.placement.partial_judge import judge_side
        from yatt_lightning.placement.partial_rollout import rollout_side

        self.reset_step()
        rank, world = service.strategy.global_rank, service.strategy.world_size
        # 1. Judge ranks hand their prompts to their rollout rank.
        outgoing: list = [None] * world
        if rank in self.judge:
            outgoing[self.partner_rollout(rank)] = JudgeWork(request.prompt_ids, request.rows, request.seeds, keep)
        with wire.category("rollout"):
            received, _ = collectives.exchange_objects(outgoing)
        if rank in self.rollout:
            return rollout_side(self, service, request, keep, [w for w in received if isinstance(w, JudgeWork)],
                                [src for src, w in enumerate(received) if isinstance(w, JudgeWork)])  # fmt: skip
        return judge_side(self, service, request)
