"""The rollout service: what a step's rollout and reward call, between the module and the machinery.

The module's steps call one object the strategy owns (``strategy.rollout``): :meth:`RolloutService.generate`
for completions and :meth:`RolloutService.score` for rewards. Behind it, the long-tail policy decides
how a request is generated, the placement where engines run, the controller who moves the data. Values
flow down: the module hands the service a :class:`RolloutSetup` once (its policy, tokenizer, reward
functions, long-tail policy, engine settings) and a :class:`RolloutRequest` per rollout; typed values come
back (:class:`~yatt_lightning.rollout.batch.RolloutBatch`, :class:`Scores`). Nothing behind the service calls
back into the module.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from yatt_lightning.rewards.base import RewardFunction, RewardOutput, TokenRewardFunction
from yatt_lightning.rollout.base import Completion, RolloutEngine, SamplingConfig
from yatt_lightning.rollout.batch import RolloutBatch

if TYPE_CHECKING:
    from yatt_lightning.rollout.longtail import LongTailPolicy


@dataclass(frozen=True)
class EngineSpec:
    """What the policy's engine is started with, derived from the module's configuration; the engine's
    own settings and how the two combine: :class:`~yatt_lightning.rollout.vllm_engine.VLLMEngine`."""

    model_path: Path
    seed: int
    max_num_seqs: int
    max_model_len: int
    dtype: str


@dataclass(frozen=True)
class RolloutSetup:
    """What the module hands the service once, when its model exists."""

    policy: Any  # MegatronPolicy: export_hf (weight push), offload / onload (colocation)
    tokenizer: Any
    engine: EngineSpec
    reward_functions: list[RewardFunction]
    long_tail: LongTailPolicy
    run_seed: int
    critic: Any = None  # PPO's critic (a MegatronPolicy with a value head), offloaded with the policy


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout: this rank's rows, their prompt token ids and seeds, the sampling, and the step."""

    rows: list[dict]
    prompt_ids: list[list[int]]
    seeds: list[int]
    sampling: SamplingConfig
    step: int
    weights_version: int


@dataclass(frozen=True)
class Generation:
    """Completions for a request's prompts (``None`` for a prompt whose group was not kept) and the scores
    a placement computed while generating (partial colocation's judges), by reward function name."""

    groups: list[list[Completion] | None]
    judged: dict[str, RewardOutput] = field(default_factory=dict)


@dataclass(frozen=True)
class Scores:
    """A batch's rewards: the weighted sum per sample, metrics to log and, when a reward function gives
    them, the weighted sum of per-token rewards (one tensor per sample over its completion tokens)."""

    total: torch.Tensor
    metrics: dict[str, float]
    token_rewards: list[torch.Tensor] | None = None


def combine(
    functions: list[RewardFunction], batch: RolloutBatch, judged: dict[str, RewardOutput] | None = None
) -> Scores:
    """Every reward function's scores of ``batch`` (or what a placement already judged), weighted and summed."""
    total = torch.zeros(len(batch))
    metrics: dict[str, float] = {}
    tokens = None
    for fn in functions:
        out = (judged or {}).get(fn.name) or fn.rollout_scores(batch)
        scores = torch.tensor(out.scores, dtype=torch.float)
        total += fn.weight * scores
        if out.token_rewards is not None:
            tokens = tokens or [torch.zeros(len(c)) for c in batch.completion_ids]
            for t, values in zip(tokens, out.token_rewards, strict=True):
                t += fn.weight * torch.tensor(values, dtype=torch.float)
        metrics[f"reward/{fn.name}/sum"] = float(scores.sum())
        for key, value in out.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    return Scores(total, metrics, tokens)


class RolloutService:
    """Generation and scoring for a strategy's module: the engine, the placement and the controller."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.setup: RolloutSetup | None = None
        self.engine_weights_version: int | None = 0  # the engine starts from the policy's own folder
        self.judged: dict[str, RewardOutput] = {}  # what the placement scored while generating this step
        self.sync_seconds = 0.0  # the last weight push (wake, push, offload)

    def configure(self, setup: RolloutSetup) -> None:
        self.setup = setup

    def _require_setup(self) -> RolloutSetup:
        if self.setup is None:
            raise RuntimeError("the rollout service was used before the module handed it its setup")
        return self.setup

    @property
    def engine(self) -> RolloutEngine:
        return self.strategy.engine

    def mark_weights_stale(self) -> None:
        """The engine's weights no longer match the policy (restored from a checkpoint, say)."""
        self.engine_weights_version = None

    # ------------------------------------------------------------------ the two calls of a step
    def rollout(self, request: RolloutRequest) -> RolloutBatch:
        """This rank's rollouts for ``request``, generated as the long-tail policy decides."""
        return self._require_setup().long_tail.rollout(self, request)

    def generate(self, request: RolloutRequest, keep: int | None = None) -> Generation:
        """Completions for the request's prompts through the placement and the controller; with ``keep``, only
        the first ``keep`` groups to finish (the others ``None``)."""
        keep = len(request.prompt_ids) if keep is None else keep
        generation = self.strategy.placement.generate(self, request, keep)
        self.judged = generation.judged  # consumed by the step's score()
        return generation

    def score(self, batch: RolloutBatch) -> Scores:
        """This rank's rewards (through the controller), using what the placement already judged while
        generating; the end of the rollout + reward phase."""
        functions = self._require_setup().reward_functions
        placement = self.strategy.placement
        judged, self.judged = self.judged, {}
        with placement.scoring(functions):
            per_token = any(isinstance(fn, TokenRewardFunction) for fn in functions)
            scores = self.strategy.controller.score(
                batch, lambda part: combine(functions, part, judged), token_rewards=per_token
            )
            placement.record_memory("reward")
        return scores

    # ------------------------------------------------------------------ the engine around a rollout
    @contextlib.contextmanager
    def engine_ready(self, weights_version: int) -> Iterator[RolloutEngine]:
        """Engine awake with the policy's current weights; training memory released while inside (GPU).

        Order on a GPU: wake the engine, push the weights (the policy's parameters are still resident),
        offload the training state, generate; then put the engine to sleep. The training state comes back
        in :meth:`prepare_training`, after the reward stage (which may need the device for a judge).
        """
        setup = self._require_setup()
        t0 = time.perf_counter()
        self.engine.wake_up()
        if self.engine_weights_version != weights_version:
            self.engine.push_weights(setup.policy.export_hf())
            self.engine_weights_version = weights_version
        for model in (setup.policy, setup.critic):
            if model is not None:
                model.offload(params=self.strategy.offload_params)
        self.sync_seconds = time.perf_counter() - t0
        try:
            yield self.engine
        finally:
            self.engine.sleep()

    def prepare_training(self) -> None:
        """Before the update (and the critic's values): the training state back on the device (a no-op on
        CPU, and when it is back already)."""
        setup = self._require_setup()
        for model in (setup.policy, setup.critic):
            if model is not None:
                model.onload()

    def groups_to_batch(
        self, rows: list[dict], prompt_ids: list[list[int]], groups: list, metrics: dict[str, float] | None = None
    ) -> RolloutBatch:
        """A batch of the kept groups' samples, in prompt order (the layout every controller relies on);
        ``metrics``: the long-tail policy's figures of how it was generated."""
        samples = [(g, rows[g], prompt_ids[g], c) for g, group in enumerate(groups) if group is not None for c in group]
        return RolloutBatch.from_samples(samples, self._require_setup().tokenizer, metrics)
