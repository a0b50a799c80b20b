"""The values that cross the rollout stack: what the module hands the service, what each part returns.

Data flows down as these values and comes back as these values; no part below the service receives the
service (or the strategy) to call back into. Figures a part measured travel in the value it returns
(``figures``: the same on every rank, logged as named; ``rank_figures``: this rank's own, gathered per
rank by :func:`~yatt_lightning.training.step_metrics.step_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from yatt_lightning.engines.base import Completion, RolloutEngine, SamplingConfig
from yatt_lightning.rewards.base import RewardFunction, RewardOutput


@dataclass(frozen=True)
class EngineSpec:
    """What the policy's engine is started with, derived from the module's configuration; the engine's
    own settings and how the two combine: :class:`~yatt_lightning.engines.vllm_engine.VLLMEngine`."""

    model_path: Path
    seed: int
    max_num_seqs: int
    max_model_len: int
    dtype: str
    lora_rank: int | None = None  # the policy trains LoRA adapters and the engine serves them (not merged)


@dataclass(frozen=True)
class EngineStart:
    """How this rank starts the policy's engine (the strategy builds it; the placement decides whether
    this rank calls :meth:`start`): the engine, its tensor parallelism and how many ranks' prompts it may
    be asked for at once."""

    engine: RolloutEngine
    tensor_parallel_size: int
    batch_scale: int = 1

    def start(self, spec: EngineSpec, batch_scale: int = 1) -> None:
        self.engine.start(
            spec.model_path,
            tensor_parallel_size=self.tensor_parallel_size,
            seed=spec.seed,
            max_num_seqs=spec.max_num_seqs * self.batch_scale * batch_scale,
            max_model_len=spec.max_model_len,
            dtype=spec.dtype,
            **({"lora_rank": spec.lora_rank} if spec.lora_rank is not None else {}),
        )


@dataclass(frozen=True)
class RolloutSetup:
    """What the module hands the service once, when its model exists."""

    policy: Any  # MegatronPolicy: export_hf (weight push), offload / onload (colocation)
    tokenizer: Any
    engine: EngineSpec
    reward_functions: list[RewardFunction]
    long_tail: Any  # a LongTailPolicy (rollout/longtail.py, which imports these types)
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
    max_new_tokens: list[int] | None = None  # a budget per prompt instead of ``sampling.max_new_tokens``
    agent: Any = None  # an Agent (yatt_lightning.agents): each sample is an episode of its environment


@dataclass(frozen=True)
class Plan:
    """What the long-tail policy asks the engines for: ``request`` (``None``: nothing to generate this
    step), of which the first ``keep`` groups to finish are kept; ``state``: the policy's own, handed back
    to it with the results (:meth:`~yatt_lightning.rollout.longtail.LongTailPolicy.collect`)."""

    request: RolloutRequest | None
    keep: int
    state: Any = None


@dataclass(frozen=True)
class Generation:
    """Completions for a request's prompts (``None`` for a prompt whose group was not kept), the scores
    a placement computed while generating (partial colocation's judges), by reward function name, and
    this rank's figures of the generation (idle seconds, memory)."""

    groups: list[list[Completion] | None]
    judged: dict[str, RewardOutput] = field(default_factory=dict)
    rank_figures: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Scores:
    """A batch's rewards: the weighted sum per sample, metrics to log and, when a reward function gives
    them, the weighted sum of per-token rewards (one tensor per sample over its completion tokens);
    ``rank_figures``: this rank's figures of the reward stage (memory)."""

    total: torch.Tensor
    metrics: dict[str, float]
    token_rewards: list[torch.Tensor] | None = None
    rank_figures: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def of(value: Scores | torch.Tensor | list[float]) -> Scores:
        """What a ``reward`` hook returned, as scores: an override may return a plain ``[N]`` tensor (or list),
        in every placement (the colocated step and a disaggregated rollout rank both read it here)."""
        return value if isinstance(value, Scores) else Scores(torch.as_tensor(value, dtype=torch.float32), {})
