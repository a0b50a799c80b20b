"""Partial colocation: the policy's engine on the rollout ranks, the judge on the judge ranks, at once.

The judge ranks send their prompts to the rollout ranks; as each prompt's samples finish, the rollout rank
streams them to a judge rank, which scores whatever has arrived while generation continues; scores go back
to the rank that owns the prompt. Then every rank trains (data parallel over all of them). Its engines run
inside the trainers' processes, like full colocation's (each rank starts its first engine at the same
point: vLLM's process groups hang off the trainer's). The two sides: ``rollout_side.py`` and
``judge_side.py``; their messages: ``stream.py``.
"""

from __future__ import annotations

import dataclasses

import torch

from yatt_lightning.distributed import collectives, wire
from yatt_lightning.placement.base import Placement, rank, world
from yatt_lightning.placement.judge_side import judge_side
from yatt_lightning.placement.pairing import Pairing
from yatt_lightning.placement.rollout_side import rollout_side
from yatt_lightning.placement.stream import JudgeWork
from yatt_lightning.rollout.types import EngineStart, Generation, RolloutRequest, RolloutSetup


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
        self.pairing: Pairing | None = None
        self.tokenizer = None  # and the judges: what generate needs of the setup, kept at start_engines
        self.reward_functions: list = []

    def check(self, layout) -> None:
        world = layout.world
        if world < 2:
            raise ValueError(
                "`trainer.strategy.placement`: PartialColocation needs at least 2 processes (`trainer.devices`)."
            )
        if layout.model_parallel != 1 or layout.ep != 1:
            raise ValueError(
                "`trainer.strategy.placement`: PartialColocation supports data parallelism only; set "
                "tensor_model_parallel_size, pipeline_model_parallel_size and expert_model_parallel_size to 1."
            )
        rollout = self.rollout_ranks or list(range(world // 2))
        if not rollout or len(rollout) >= world or any(r < 0 or r >= world for r in rollout):
            raise ValueError(f"`placement.rollout_ranks` {rollout} must name some, not all, of the {world} ranks.")
        if 2 * len(set(rollout)) > world:
            raise ValueError(
                f"`placement.rollout_ranks` {rollout}: each rollout rank needs a judge rank of its own; name at most "
                f"half of the {world} ranks."
            )
        judge = [r for r in range(world) if r not in rollout]
        self.pairing = Pairing(sorted(rollout), judge, self.min_judge_batch)

    def hosts_policy_engine(self) -> bool:
        return rank() in self.pairing.rollout

    # -- a step
    def start_engines(self, setup: RolloutSetup, policy_engine: EngineStart) -> None:
        from yatt_lightning.rollout.longtail import PartialRollout

        if isinstance(setup.long_tail, PartialRollout):
            raise ValueError("`model.long_tail`: PartialRollout works with FullColocation; use OverProvision here.")
        if not self.judges(setup.reward_functions):
            raise ValueError(
                "PartialColocation overlaps generation with a GenerativeRewardModel; add one to `model.rewards`."
            )
        self.tokenizer, self.reward_functions = setup.tokenizer, setup.reward_functions
        # A separate group carries the stream, so it never interleaves with the trainer's collectives.
        self.pairing = dataclasses.replace(self.pairing, group=torch.distributed.new_group(backend="gloo"))
        # In-process engines join the trainer's process group: vLLM's groups are created by whichever engine
        # starts first on each rank, so every rank starts one here, at the same point.
        if self.hosts_policy_engine():
            policy_engine.start(setup.engine, batch_scale=len(self.pairing.partner_judges(rank())) + 1)
        else:
            spec = setup.engine
            for genrm in self.judges(setup.reward_functions):
                genrm.start(seed=spec.seed, max_num_seqs=spec.max_num_seqs * 2, dtype=spec.dtype)

    def generate(self, request: RolloutRequest, keep: int, engine) -> Generation:
        me, pairing = rank(), self.pairing
        # 1. Judge ranks hand their prompts to their rollout rank.
        outgoing: list = [None] * world()
        if me in pairing.judge:
            outgoing[pairing.partner_rollout(me)] = JudgeWork(
                request.prompt_ids, request.rows, request.seeds, keep, request.max_new_tokens
            )
        with wire.category("rollout"):
            received, _ = collectives.exchange_objects(outgoing)
        judges = self.judges(self.reward_functions)
        if me in pairing.rollout:
            work = [(src, w) for src, w in enumerate(received) if isinstance(w, JudgeWork)]
            return rollout_side(pairing, engine, self.tokenizer, request, keep, work)
        return judge_side(pairing, judges, request)
