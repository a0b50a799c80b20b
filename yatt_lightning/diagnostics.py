"""Checks a user can run on a live training job: does the rollout engine sample from the trained policy?"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def rollout_consistency(module, rows: list[dict]) -> dict[str, float]:
    """Sample ``rows`` through the strategy (which pushes the current weights), then score the sampled
    tokens with the Megatron policy. Returns the largest and mean absolute logprob difference.

    Collective: call on every rank at the same point.
    """
    rollouts = module.rollout(rows)
    ours = module.compute_logprobs(module.policy, rollouts, list(range(len(rollouts))))
    return _compare(ours, rollouts.rollout_logprobs)


def stale_engine_consistency(module, rows: list[dict], stale_weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """The same comparison after loading ``stale_weights`` into the engine instead of the policy's weights:
    shows the size of the error a missed weight push would leave. Marks the engine stale afterwards."""
    strategy = module.trainer.strategy
    strategy.engine.push_weights(stale_weights)
    prompt_ids = [module.tokenize_prompt(r) for r in rows]
    groups = strategy.engine.generate(prompt_ids, module.sampling, module.sample_seeds(rows))
    strategy.mark_weights_stale()
    from yatt_lightning.batch import RolloutBatch

    n = module.sampling.n
    comps = [c for g in groups for c in g]
    rollouts = RolloutBatch(
        prompts=[r["prompt"] for r in rows for _ in range(n)],
        prompt_ids=[p for p in prompt_ids for _ in range(n)],
        completion_ids=[c.token_ids for c in comps],
        completions=[""] * len(comps),
        rows=[r for r in rows for _ in range(n)],
        group_ids=torch.arange(len(rows)).repeat_interleave(n),
        rollout_logprobs=[torch.tensor(c.logprobs) for c in comps],
        finish_reasons=[c.finish_reason for c in comps],
    )
    ours = module.compute_logprobs(module.policy, rollouts, list(range(len(rollouts))))
    return _compare(ours, rollouts.rollout_logprobs)


def _compare(ours: list[torch.Tensor] | None, engine: list[torch.Tensor]) -> dict[str, float]:
    if ours is None:  # not the last pipeline stage
        return {"max_abs_logprob_diff": float("nan"), "mean_abs_logprob_diff": float("nan"), "tokens": 0}
    diffs = torch.cat([(a - b).abs() for a, b in zip(ours, engine, strict=True) if len(a)])
    return {
        "max_abs_logprob_diff": float(diffs.max()) if diffs.numel() else 0.0,
        "mean_abs_logprob_diff": float(diffs.mean()) if diffs.numel() else 0.0,
        "tokens": int(diffs.numel()),
    }
