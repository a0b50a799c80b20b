"""The rollout service: what a step's rollout and reward call, between the module and the machinery.

The module's steps call one object the strategy owns (``strategy.rollout``): :meth:`RolloutService.rollout`
for this rank's rollouts and :meth:`RolloutService.score` for their rewards. A rollout enters the service
once, and the service calls each part once, straight down, in this order:

1. the long-tail policy plans the request (:meth:`~yatt_lightning.rollout.longtail.LongTailPolicy.plan`);
2. the engine gets the policy's current weights, where this rank hosts it (:meth:`engine_ready`);
3. the placement generates (and, in partial colocation, judges) through the controller;
4. the long-tail policy collects the results into a :class:`~yatt_lightning.rollout.batch.RolloutBatch`.

Values flow down (:class:`~yatt_lightning.rollout.types.RolloutSetup` once, a
:class:`~yatt_lightning.rollout.types.RolloutRequest` per rollout) and typed values come back, with the
figures each part measured; nothing below the service receives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch

from yatt_lightning.engines.base import RolloutEngine
from yatt_lightning.rewards.base import RewardFunction, RewardOutput, TokenRewardFunction
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.rollout.longtail import WaitForAll
from yatt_lightning.rollout.types import (  # noqa: F401 (the types' former home: imported from here too)
    EngineSpec,
    Generation,
    Plan,
    RolloutRequest,
    RolloutSetup,
    Scores,
)


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
    """Generation and scoring for a strategy's module: the engine, the placement and the controller.

    Args:
        engine: The policy's rollout engine (on ranks that host one).
        placement: Where engines and judges run; it generates through ``controller``.
        controller: Who talks to engines, what crosses ranks.
        offload_params: Also move the policy's parameters off the device while the engine runs.
    """

    def __init__(self, engine: RolloutEngine, placement, controller, offload_params: bool = False) -> None:
        self.engine = engine
        self.placement = placement
        self.controller = controller
        self.offload_params = offload_params
        self.setup: RolloutSetup | None = None
        self.engine_weights_version: int | None = 0  # the engine starts from the policy's own folder
        self.adapter_root = None  # where the LoRA adapters pushed to the engine are written

    def configure(self, setup: RolloutSetup) -> None:
        self.setup = setup

    def _require_setup(self) -> RolloutSetup:
        if self.setup is None:
            raise RuntimeError("the rollout service was used before the module handed it its setup")
        return self.setup

    def mark_weights_stale(self) -> None:
        """The engine's weights no longer match the policy (restored from a checkpoint, say)."""
        self.engine_weights_version = None

    # ------------------------------------------------------------------ the two calls of a step
    def rollout(self, request: RolloutRequest) -> RolloutBatch:
        """This rank's rollouts for ``request``: planned and collected by the long-tail policy, generated
        by the placement; ``rank_figures`` carry the weight push's seconds and the placement's figures."""
        setup = self._require_setup()
        plan = setup.long_tail.plan(request, setup.run_seed)
        generation, sync, pushed = self.generate(plan.request, plan.keep) if plan.request is not None else (None, 0.0, {})
        batch = setup.long_tail.collect(plan, generation, setup.tokenizer, self.controller.min_over_ranks)
        judged = generation.judged if generation is not None else {}
        rank = {**(generation.rank_figures if generation is not None else {}), "sync": sync}
        return dataclasses.replace(batch, judged=judged, rank_figures=rank, metrics={**batch.metrics, **pushed})

    def generate(self, request: RolloutRequest, keep: int | None = None) -> tuple[Generation, float, dict[str, float]]:
        """Completions for the request's prompts (the first ``keep`` groups to finish) through the placement,
        the seconds the weight push took on this rank, and the push's figures (LoRA's)."""
        keep = len(request.prompt_ids) if keep is None else keep
        hosts = self.placement.hosts_policy_engine()
        with self.engine_ready(request.weights_version) if hosts else _no_engine() as (engine, sync, pushed):
            return self.placement.generate(request, keep, engine), sync, pushed

    def evaluate(self, request: RolloutRequest) -> RolloutBatch:
        """Validation's rollouts for ``request``: every prompt's samples, the run's long-tail policy and its
        state left alone. The engine takes the policy's weights again before the next step, whose push then
        resets its prefix cache as it would have without this (the step samples as it would have)."""
        generation, _, _ = self.generate(request)
        batch = WaitForAll().collect(Plan(request, len(request.prompt_ids)), generation, self._require_setup().tokenizer,
                                     self.controller.min_over_ranks)  # fmt: skip
        self.mark_weights_stale()
        return dataclasses.replace(batch, judged=generation.judged)

    def score(self, batch: RolloutBatch) -> Scores:
        """This rank's rewards (through the controller), using what the placement already judged while
        generating (``batch.judged``); the end of the rollout + reward phase."""
        setup = self._require_setup()
        functions = setup.reward_functions
        with self.placement.scoring(functions) as figures:
            per_token = any(isinstance(fn, TokenRewardFunction) for fn in functions)
            scores = self.controller.score(
                batch, lambda part: combine(functions, part, batch.judged), per_token, setup.tokenizer
            )
        return Scores(scores.total, scores.metrics, scores.token_rewards, {**scores.rank_figures, **figures})

    # ------------------------------------------------------------------ the engine around a rollout
    @contextlib.contextmanager
    def engine_ready(self, weights_version: int) -> Iterator[tuple[RolloutEngine, float, dict[str, float]]]:
        """Engine awake with the policy's current weights, the seconds that took and the push's figures;
        training memory released while inside (GPU).

        Order on a GPU: wake the engine, push the weights (the policy's parameters are still resident),
        offload the training state, generate; then put the engine to sleep. The training state comes back
        in :meth:`prepare_training`, after the reward stage (which may need the device for a judge).
        """
        setup = self._require_setup()
        t0 = time.perf_counter()
        self.engine.wake_up()
        pushed = {}
        if setup.policy is not None and self.engine_weights_version != weights_version:  # none: weights come from a trainer
            pushed = self.push_policy(setup, weights_version)
            self.engine_weights_version = weights_version
        for model in (setup.policy, setup.critic):
            if model is not None:
                model.offload(params=self.offload_params)
        try:
            yield self.engine, time.perf_counter() - t0, pushed
        finally:
            self.engine.sleep()

    def push_policy(self, setup, version: int) -> dict[str, float]:
        """The policy's weights into the engine; with LoRA only the adapter (a PEFT folder the engine loads
        under a new adapter id), or, with ``lora.merge``, the weights with the adapter merged in. Returns the
        push's figures: ``rollout/push_bytes`` (what the engine received), with LoRA ``lora/trainable_params``
        (the whole adapter's) and ``lora/sync_bytes`` (the same bytes under the name LoRA users look for)."""
        lora = setup.policy.lora
        if lora is None:
            sent = [0]

            def counted():
                for name, tensor in setup.policy.export_hf():
                    sent[0] += tensor.numel() * tensor.element_size()
                    yield name, tensor

            self.engine.push_weights(counted())
            return {"rollout/push_bytes": float(sent[0])}
        adapter = dict(setup.policy.export_adapter())
        figures = {"lora/trainable_params": float(sum(t.numel() for t in adapter.values()))}
        if lora.merge:
            merged = list(setup.policy.export_merged(adapter))
            self.engine.push_weights(merged)
            sent = float(sum(t.numel() * t.element_size() for _, t in merged))
            return {**figures, "lora/sync_bytes": sent, "rollout/push_bytes": sent}
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        from yatt_lightning.models.lora import save_peft

        if self.adapter_root is None:  # in memory where there is a tmpfs
            shm = Path("/dev/shm")
            self.adapter_root = Path(tempfile.mkdtemp(prefix="yatt-lora-", dir=shm if shm.is_dir() else None))
            atexit.register(shutil.rmtree, self.adapter_root, True)
        folder = self.adapter_root / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        save_peft(folder, adapter, lora, setup.engine.model_path, setup.policy.vision_language)
        self.engine.push_adapter(folder)
        for old in self.adapter_root.iterdir():  # the engine has read the new one by its next request
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        sent = float(sum(t.numel() * t.element_size() for t in adapter.values()))
        return {**figures, "lora/sync_bytes": sent, "rollout/push_bytes": sent}

    def prepare_training(self) -> None:
        """Before the update, the critic's values or a save: the training state back on the device (a no-op
        when it is back already)."""
        setup = self._require_setup()
        for model in (setup.policy, setup.critic):
            if model is not None:
                model.onload()


@contextlib.contextmanager
def _no_engine() -> Iterator[tuple[None, float, dict]]:
    yield None, 0.0, {}
