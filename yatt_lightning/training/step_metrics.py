"""What one RL step reports: its statistics, reduced over ranks, as one typed value.

:func:`step_stats` gathers every figure of the step (rewards, lengths, the update's token means, the
reward functions', dynamic sampling's, the long-tail policy's and the load balancer's figures, phase
times, idle time and memory per rank) into a :class:`StepStats`, which ``training_step`` returns;
:class:`~yatt_lightning.callbacks.StepLogger` writes it to TensorBoard and the progress bar.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from yatt_lightning.engines.base import AGENT_FIGURES
from yatt_lightning.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class StepStats:
    """One step's statistics, the same on every rank (except ``samples``, this rank's)."""

    scalars: dict[str, float]  # for the loggers (TensorBoard)
    progress: dict[str, float]  # for the progress bar: reward, t_roll, t_train
    samples: list[tuple[str, str, float]]  # a few (prompt, completion, reward) for the Text tab
    samples_count: int  # samples the step's means are over


# The update's figures logged as ``actor/<name>``; its other figures (the load balancer's) keep their names.
_ACTOR_KEYS = ("pg_loss", "kl", "clip_fraction", "entropy", "ratio", "grad_norm")


@dataclass(frozen=True)
class StepContext:
    """What :func:`step_stats` needs besides the step's values: who reduces (the controller, over every
    rank), whether this rank counts its group's samples, the reward figures every rank reports (the same
    keys on every rank), how many samples to show, the learning rate of the step's update, and whether the
    samples are an agent's episodes (every rank reports their figures, even with no sample this step)."""

    controller: Any
    is_model_parallel_head: bool
    world_size: int
    reward_keys: list[str]
    log_samples: int
    lr: float
    agent: bool = False


def step_stats(
    context: StepContext,
    rollouts: RolloutBatch,
    reward_metrics: dict[str, float],
    stats: dict[str, float] | None,
    figures: dict[str, float],
    times: dict[str, float],
    rank_figures: dict[str, float],
) -> StepStats:
    """Collective: rollout and reward statistics every step; actor statistics when the step updated the
    policy (dynamic sampling can end a step without an update); each rank's idle time and, per stage, memory.
    ``reward_metrics``: the scores' metrics (``Scores.metrics``); ``stats``: what ``update`` returned;
    ``figures``: the step's other components' figures (the long-tail policy's, in ``RolloutBatch.metrics``,
    and dynamic sampling's), logged as they are named; ``times``: the phases' seconds; ``rank_figures``:
    this rank's own (idle seconds, memory per stage), logged per rank."""
    controller = context.controller
    rewards = rollouts.rewards  # each sample's total: its scalar and its per-token rewards (an agent's turns)
    if rollouts.token_rewards is not None:
        rewards = rewards + torch.stack([t.sum() for t in rollouts.token_rewards]).to(rewards.dtype)
    agent = context.agent
    turns = [sum(t.figures.get(k, 0.0) for t in rollouts.turns or []) for k in AGENT_FIGURES] if agent else []
    lengths = rollouts.response_lengths()
    # The ranks of a model-parallel group hold the same rollouts: count them once, at the group's head.
    w = 1.0 if context.is_model_parallel_head else 0.0
    names = context.reward_keys
    diff = stats["logprob_diff_max"] if stats else 0.0
    local = torch.tensor(
        [w * rewards.sum(), w * (rewards**2).sum(), w * len(rewards), w * lengths.sum(), lengths.max(), diff]
        + [w * reward_metrics.get(k, 0.0) for k in names]
        + [w * v for v in turns],
        dtype=torch.float64,
    )
    maxes = controller.all_reduce(local[[4, 5]].clone(), op=torch.distributed.ReduceOp.MAX)
    controller.all_reduce(local)
    local[[4, 5]] = maxes
    r_sum, r_sq, count, len_sum, len_max, lp_diff = local[:6].tolist()
    extra = dict(zip(names, local[6 : 6 + len(names)].tolist(), strict=True))
    agent_sums = dict(zip(AGENT_FIGURES, local[6 + len(names) :].tolist(), strict=False))
    mean = r_sum / count
    metrics = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(r_sq / count - mean**2, 0.0)),
        "response_length/mean": len_sum / count,
        "response_length/max": len_max,
        "perf/rollout_tokens_per_s": len_sum / max(times["rollout"], 1e-9),
        "perf/step_tokens_per_s": len_sum / max(times["step"], 1e-9),
    }
    for key, value in extra.items():  # per reward function: its mean score, and error/unparsed counts
        if key.endswith("/sum"):
            metrics[key.removesuffix("/sum") + "/mean"] = value / count
        else:
            metrics[key] = value
    if agent:  # per episode: turns, tool calls and errors, seconds in tools; per step: episodes cut short
        metrics.update({f"agent/{k}_per_episode": agent_sums[k] / count for k in AGENT_FIGURES if k != "truncated"})
        metrics["agent/truncated"] = agent_sums["truncated"]
    if stats is not None:
        metrics.update({f"actor/{k}": stats[k] for k in _ACTOR_KEYS})
        metrics["actor/lr"] = context.lr
        metrics["rollout/logprob_diff_max"] = lp_diff
        metrics.update({k: v for k, v in stats.items() if "/" in k})
    metrics.update(figures)
    metrics.update({f"time/{k}": v for k, v in times.items()})
    metrics.update(_per_rank(context.world_size, times, rank_figures, controller.group))
    samples = [
        (rollouts.prompts[i], rollouts.completions[i], float(rewards[i]))
        for i in range(min(context.log_samples, len(rollouts)))
    ]
    progress = {"reward": mean, "t_roll": times["rollout"], "t_train": times["train"]}
    return StepStats(metrics, progress, samples, max(int(count), 1))


# What a long run must not accumulate, per process at the step's end: OS threads (Python's and the
# libraries' own), open file descriptors, resident memory (tests/test_soak.py holds them flat).
PROCESS_KEYS = ("process/threads", "process/open_fds", "process/rss_gb")


def process_figures() -> dict[str, float]:
    """This process's threads, open file descriptors and resident memory, now."""
    import psutil

    me = psutil.Process()
    return {"process/threads": float(me.num_threads()), "process/open_fds": float(me.num_fds()),
            "process/rss_gb": me.memory_info().rss / 2**30}  # fmt: skip


def _per_rank(world_size: int, times: dict[str, float], rank_figures: dict[str, float], group=None) -> dict[str, float]:
    """Each rank's idle time in the rollout + reward phase, the memory it held at each stage, and its
    threads, open files and memory at the step's end."""
    # the same on every rank; 0 where not measured
    keys = ["memory/reward_rss_gb", "memory/rollout_rss_gb", *PROCESS_KEYS]
    rank_figures = {**rank_figures, **process_figures()}
    phase = times["rollout"] + times["sync"] + times["reward"]
    mine = torch.tensor([rank_figures["idle"], phase] + [rank_figures.get(k, 0.0) for k in keys], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    if world_size > 1:
        torch.distributed.all_gather(every, mine, group=group)
    else:
        every = [mine]
    out = {}
    for rank, values in enumerate(every):
        idle, phase_r = values[0].item(), values[1].item()
        out[f"idle/rank{rank}"] = idle
        out[f"idle_fraction/rank{rank}"] = idle / phase_r if phase_r > 0 else 0.0
        for k, v in zip(keys, values[2:].tolist(), strict=True):
            out[f"{k}/rank{rank}"] = v
    return out


def add_metric_sums(sums: dict[str, float], metrics: dict[str, torch.Tensor]) -> None:
    """Add a micro-batch's metric sums (by name, as its loss function returned them) to ``sums``, read
    from the device in one transfer."""
    for key, value in zip(metrics, torch.stack(list(metrics.values())).tolist(), strict=True):
        sums[key] += value


def reduce_token_metrics(controller, sums: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    """Per-token means over every rank of the step's summed token metrics (``sums["tokens"]`` counts them)."""
    keys = ("tokens", *names)
    t = controller.all_reduce(torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64))
    tokens = max(t[0].item(), 1.0)
    return {k: t[i].item() / tokens for i, k in enumerate(keys) if i > 0}
