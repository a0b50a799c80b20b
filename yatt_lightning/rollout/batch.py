"""The rollout batch of one data-parallel rank: what its engine generated, built once."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from yatt_lightning.engines.base import Turns


@dataclass(frozen=True)
class RolloutBatch:
    """All samples this rank generated in one step: ``n`` completions for each of its prompts.

    Per-sample lists are aligned; sample ``i`` belongs to group ``group_ids[i]`` (its prompt).
    ``rollout_logprobs`` are 1-D tensors over each sample's completion tokens (the engine's).
    A batch is a value: scoring gives a new one (:meth:`scored`) and nothing assigns its fields.
    ``rewards`` is set once the batch is scored; ``metrics`` holds how it was generated (the long-tail
    policy's figures), logged with the step's; ``rank_figures`` this rank's figures of the generation
    (logged per rank); ``judged`` the scores a placement computed while generating, which scoring uses. What the update adds (advantages, old and reference
    logprobs) lives in :class:`~yatt_lightning.training.batch.TrainingBatch`.
    """

    prompts: list[str]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completions: list[str]
    rows: list[dict]
    group_ids: torch.Tensor
    rollout_logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    rewards: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    token_rewards: list[torch.Tensor] | None = None
    judged: dict = field(default_factory=dict)  # reward name -> RewardOutput a placement scored while generating
    rank_figures: dict[str, float] = field(default_factory=dict)  # this rank's (idle seconds, memory, sync)
    versions: list[tuple[int, int]] | None = None  # per sample: (first, last) policy version of its tokens
    turns: list[Turns] | None = None  # per sample, an agent's episode: which tokens the model sampled, its turns

    def __len__(self) -> int:
        return len(self.completion_ids)

    def scored(self, rewards: torch.Tensor, token_rewards: list[torch.Tensor] | None = None) -> RolloutBatch:
        """This batch with one reward per sample and, when given, per-token rewards (one tensor per sample
        over its completion tokens)."""
        if rewards.shape != (len(self),):
            raise ValueError(f"a rollout batch of {len(self)} samples got rewards of shape {tuple(rewards.shape)}")
        if token_rewards is not None and [len(t) for t in token_rewards] != [len(c) for c in self.completion_ids]:
            raise ValueError("per-token rewards must hold one value per completion token of each sample")
        return dataclasses.replace(self, rewards=rewards, token_rewards=token_rewards)

    @property
    def num_groups(self) -> int:
        return int(torch.unique(self.group_ids).numel())

    def select_groups(self, groups: list[int]) -> RolloutBatch:
        """The samples of ``groups`` (in that order), renumbered 0..len(groups)-1."""
        index = {g: i for i, g in enumerate(groups)}
        keep = [i for i, g in enumerate(self.group_ids.tolist()) if g in index]
        keep.sort(key=lambda i: (index[int(self.group_ids[i])], i))

        def pick(values) -> list | None:
            return None if values is None else [values[i] for i in keep]

        def pick_tensor(values) -> torch.Tensor | None:
            return None if values is None else values[keep]

        return RolloutBatch(
            prompts=pick(self.prompts),
            prompt_ids=pick(self.prompt_ids),
            completion_ids=pick(self.completion_ids),
            completions=pick(self.completions),
            rows=pick(self.rows),
            group_ids=torch.tensor([index[int(self.group_ids[i])] for i in keep], dtype=torch.long),
            rollout_logprobs=pick(self.rollout_logprobs),
            finish_reasons=pick(self.finish_reasons),
            rewards=pick_tensor(self.rewards),
            token_rewards=pick(self.token_rewards),
            versions=pick(self.versions),
            turns=pick(self.turns),
        )

    def split_groups(self, parts: int) -> list[RolloutBatch]:
        """The groups in ``parts`` consecutive parts of sizes differing by one at most (a disaggregated rollout
        rank's batch for the trainer data-parallel ranks it serves)."""
        if parts == 1:
            return [self]
        bounds = [k * self.num_groups // parts for k in range(parts + 1)]
        return [self.select_groups(list(range(a, b))) for a, b in zip(bounds, bounds[1:], strict=False)]

    @staticmethod
    def from_groups(
        rows: list[dict], prompt_ids: list[list[int]], groups: list, tokenizer, metrics: dict[str, float] | None = None
    ) -> RolloutBatch:
        """A batch of the kept groups' samples (``None``: a group not kept), in prompt order (the layout
        every controller relies on)."""
        samples = [(g, rows[g], getattr(c, "prompt_ids", None) or prompt_ids[g], c)
                   for g, group in enumerate(groups) if group is not None for c in group]  # fmt: skip
        return RolloutBatch.from_samples(samples, tokenizer, metrics)

    @staticmethod
    def from_samples(samples: list[tuple], tokenizer, metrics: dict[str, float] | None = None) -> RolloutBatch:
        """A batch from ``(group id, row, prompt ids, completion)`` per sample; a completion is anything with
        ``token_ids``, ``logprobs`` and ``finish_reason`` (and ``versions``, where the engine tracked them).
        ``metrics``: how the batch was generated."""
        completion_ids = [c.token_ids for *_, c in samples]
        versions = [getattr(c, "versions", None) for *_, c in samples]
        turns = [getattr(c, "turns", None) for *_, c in samples]
        return RolloutBatch(
            prompts=[row["prompt"] for _, row, _, _ in samples],
            prompt_ids=[ids for _, _, ids, _ in samples],
            completion_ids=completion_ids,
            completions=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            rows=[row for _, row, _, _ in samples],
            group_ids=torch.tensor([g for g, *_ in samples], dtype=torch.long),
            rollout_logprobs=[torch.tensor(c.logprobs, dtype=torch.float) for *_, c in samples],
            finish_reasons=[c.finish_reason for *_, c in samples],
            metrics=dict(metrics or {}),
            versions=versions if all(v is not None for v in versions) and samples else None,
            turns=turns if all(t is not None for t in turns) and samples else None,
        )

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        """One batch holding the groups of ``batches`` (group ids made distinct)."""
        offset, group_ids = 0, []
        for b in batches:
            group_ids.append(b.group_ids + offset)
            offset += int(b.group_ids.max()) + 1 if len(b) else 0

        def cat(key) -> list:
            return [v for b in batches for v in getattr(b, key)]

        rewards = [b.rewards for b in batches]
        tokens = [b.token_rewards for b in batches]
        return RolloutBatch(
            prompts=cat("prompts"),
            prompt_ids=cat("prompt_ids"),
            completion_ids=cat("completion_ids"),
            completions=cat("completions"),
            rows=cat("rows"),
            group_ids=torch.cat(group_ids) if group_ids else torch.zeros(0, dtype=torch.long),
            rollout_logprobs=cat("rollout_logprobs"),
            finish_reasons=cat("finish_reasons"),
            rewards=torch.cat(rewards) if rewards and all(r is not None for r in rewards) else None,
            token_rewards=[t for part in tokens for t in part]
            if tokens and all(t is not None for t in tokens)
            else None,
            versions=[v for b in batches for v in b.versions] if batches and all(b.versions for b in batches) else None,
            turns=[t for b in batches for t in b.turns] if batches and all(b.turns for b in batches) else None,
        )

    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.float)

    def sequence_lengths(self) -> list[int]:
        return [len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids, strict=True)]


def mini_batch_slices(n: int, parts: int) -> list[slice]:
    """``n`` samples in ``parts`` consecutive mini-batches whose sizes differ by one at most (fewer when
    ``n < parts``). Dynamic sampling, over-provisioning and partial rollouts change ``n`` from step to step;
    every data-parallel rank has the same ``n``, so all take the same number of optimizer steps."""
    bounds = [k * n // parts for k in range(parts + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a]
