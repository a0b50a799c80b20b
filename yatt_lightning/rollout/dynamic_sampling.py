"""Dynamic sampling (DAPO, Yu et al., 2025): train only on groups whose rewards differ.

A group whose n samples all got the same reward has zero advantage under group normalisation: it adds
nothing to the gradient but still costs a training pass, and it shrinks the effective batch. Dynamic
sampling drops such groups and keeps generating until ``groups_per_update`` informative groups are
collected. Oversampling is set by the data: each RL step (a "round") generates ``data.batch_size``
prompts, so ``data.batch_size / groups_per_update`` is the oversampling ratio per round. Rounds are
successive training steps of the Lightning loop: a round that does not complete the buffer ends without
an update (``trainer.global_step`` does not advance). After ``max_rounds`` rounds the update runs with
what was collected. Data-parallel ranks decide together (an update needs every rank to be ready), and
each trains on the same number of groups, the smallest any rank collected.

Choices: extra groups beyond ``groups_per_update`` are discarded (not carried to the next update), so
every update trains on samples of the current policy only; the buffer is saved in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from yatt_lightning.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class Sampled:
    """One round of dynamic sampling: the batch to train on (``None``: no update this step) and its figures."""

    batch: RolloutBatch | None
    metrics: dict[str, float]


class DynamicSampling:
    """Args:
    groups_per_update: Informative groups (prompts) per rank for one update.
    max_rounds: Generation rounds at most before updating with what was collected.
    min_reward_std: A group is informative when its rewards' standard deviation exceeds this.
    """

    def __init__(self, groups_per_update: int, max_rounds: int = 4, min_reward_std: float = 0.0) -> None:
        if groups_per_update < 1:
            raise ValueError(f"`model.dynamic_sampling.groups_per_update` must be >= 1, got {groups_per_update}.")
        if max_rounds < 1:
            raise ValueError(f"`model.dynamic_sampling.max_rounds` must be >= 1, got {max_rounds}.")
        if min_reward_std < 0:
            raise ValueError(f"`model.dynamic_sampling.min_reward_std` must be >= 0, got {min_reward_std}.")
        self.groups_per_update = groups_per_update
        self.max_rounds = max_rounds
        self.min_reward_std = min_reward_std
        self.buffer: list[RolloutBatch] = []
        self.rounds = 0
        self._next: tuple[list[RolloutBatch], int] | None = None  # the state once the step commits

    def informative_groups(self, rollouts: RolloutBatch) -> list[int]:
        """Groups whose rewards are not all (nearly) equal, in order of first appearance."""
        keep = []
        for g in dict.fromkeys(rollouts.group_ids.tolist()):
            r = rollouts.rewards[rollouts.group_ids == g].double()
            spread = r.std().item() if r.numel() > 1 else 0.0
            if spread > self.min_reward_std:
                keep.append(g)
        return keep

    def step(self, rollouts: RolloutBatch, all_reduce_min_max) -> Sampled:
        """Add a round's scored rollouts; the batch to train on, or ``None`` if more rounds are needed.
        The buffer changes only at :meth:`commit` (when the step is done), so a step that fails leaves it as
        it was.

        ``all_reduce_min_max(values)`` returns (min over ranks, max over ranks) of a list of floats.
        """
        keep = self.informative_groups(rollouts)
        buffer = self.buffer + ([rollouts.select_groups(keep)] if keep else [])
        rounds = self.rounds + 1
        metrics = {
            "sampling/kept_groups": float(len(keep)),
            "sampling/dropped_groups": float(rollouts.num_groups - len(keep)),
            "sampling/rounds": float(rounds),
        }
        lows, highs = all_reduce_min_max([float(sum(b.num_groups for b in buffer)), float(rounds)])
        fewest, most_rounds = int(lows[0]), int(highs[1])
        if fewest < self.groups_per_update and most_rounds < self.max_rounds:
            self._next = (buffer, rounds)
            return Sampled(None, metrics)
        take = min(fewest, self.groups_per_update)
        metrics["sampling/groups_trained"] = float(take)
        self._next = ([], 0)
        if take == 0:
            return Sampled(None, metrics)  # not one informative group on some rank after max_rounds: no update
        return Sampled(RolloutBatch.concat(buffer).select_groups(list(range(take))), metrics)

    def commit(self) -> None:
        if self._next is not None:
            self.buffer, self.rounds = self._next
            self._next = None

    def state_dict(self) -> dict:
        return {"buffer": self.buffer, "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.buffer, self.rounds = state["buffer"], state["rounds"]


__all__ = ["DynamicSampling", "Sampled"]
