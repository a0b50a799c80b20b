"""The rollout batch of one data-parallel rank, and its packing into training micro-batches."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from yatt_lightning.packing import pack_by_tokens


@dataclass
class RolloutBatch:
    """All samples this rank generated in one step: ``n`` completions for each of its prompts.

    Per-sample lists are aligned; sample ``i`` belongs to group ``group_ids[i]`` (its prompt).
    Per-token values (``rollout_logprobs``, ``old_logprobs``, ``ref_logprobs``) are 1-D tensors over
    the sample's completion tokens.
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
    advantages: torch.Tensor | None = None
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

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
            advantages=pick_tensor(self.advantages),
        )

    @staticmethod
    def from_samples(samples: list[tuple], tokenizer) -> RolloutBatch:
        """A batch from ``(group id, row, prompt ids, completion)`` per sample; a completion is anything with
        ``token_ids``, ``logprobs`` and ``finish_reason``."""
        completion_ids = [c.token_ids for *_, c in samples]
        return RolloutBatch(
            prompts=[row["prompt"] for _, row, _, _ in samples],
            prompt_ids=[ids for _, _, ids, _ in samples],
            completion_ids=completion_ids,
            completions=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            rows=[row for _, row, _, _ in samples],
            group_ids=torch.tensor([g for g, *_ in samples], dtype=torch.long),
            rollout_logprobs=[torch.tensor(c.logprobs, dtype=torch.float) for *_, c in samples],
            finish_reasons=[c.finish_reason for *_, c in samples],
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
        )

    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(c) for c in self.completion_ids], dtype=torch.float)

    def sequence_lengths(self) -> list[int]:
        return [len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids, strict=True)]

    def plan_by_tokens(
        self, indices: list[int], token_budget: int, overhead_tokens: int = 256, pad_to_multiple: int = 8
    ) -> list[list[int]]:
        """Group ``indices`` into micro-batches whose padded size (samples x longest) fits ``token_budget``,
        with the least padding plus ``overhead_tokens`` per micro-batch (:func:`~yatt_lightning.packing.pack_by_tokens`)."""
        lengths = self.sequence_lengths()
        plan = pack_by_tokens([lengths[i] for i in indices], token_budget, overhead_tokens, pad_to_multiple)
        return [[indices[j] for j in mb] for mb in plan]

    def microbatches(
        self,
        indices: list[int],
        micro_batch_size: int,
        pad_id: int,
        pad_to_multiple: int = 8,
        plan: list[list[int]] | None = None,
    ) -> list[dict]:
        """Right-padded micro-batches of the samples ``indices`` (in that order), ``micro_batch_size``
        each, or following ``plan`` (lists of sample indices) when given.

        Each holds ``input_ids [b, s]``, ``loss_mask [b, s-1]`` (1 where position t predicts a
        completion token), ``sample_index [b]``, ``rollout_logprobs`` (the engine's) and, where known,
        ``old_logprobs``, ``ref_logprobs`` ``[b, s-1]`` and ``advantages [b]``.
        """
        out = []
        chunks = plan or [indices[s : s + micro_batch_size] for s in range(0, len(indices), micro_batch_size)]
        for chunk in chunks:
            longest = max(len(self.prompt_ids[i]) + len(self.completion_ids[i]) for i in chunk)
            seq = -(-longest // pad_to_multiple) * pad_to_multiple
            ids = torch.full((len(chunk), seq), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), seq - 1), dtype=torch.float)
            per_token = {
                k: torch.zeros((len(chunk), seq - 1)) for k in ("rollout_logprobs", "old_logprobs", "ref_logprobs")
            }
            for row, i in enumerate(chunk):
                p, c = self.prompt_ids[i], self.completion_ids[i]
                ids[row, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
                span = slice(len(p) - 1, len(p) - 1 + len(c))
                mask[row, span] = 1.0
                for key in per_token:
                    values = getattr(self, key)
                    if values is not None:
                        per_token[key][row, span] = values[i]
            mb = {"input_ids": ids, "loss_mask": mask, "sample_index": torch.tensor(chunk)}
            for key, values in per_token.items():
                if getattr(self, key) is not None:
                    mb[key] = values
            if self.advantages is not None:
                mb["advantages"] = self.advantages[chunk].float()
            out.append(mb)
        return out

    @staticmethod
    def unpack_per_token(mb: dict, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-sample completion-token slices of a ``[b, s-1]`` tensor computed for micro-batch ``mb``."""
        mask = mb["loss_mask"].bool()
        return [values[row][mask[row]].detach().clone() for row in range(values.shape[0])]


def mini_batch_slices(n: int, parts: int) -> list[slice]:
    """``n`` samples in ``parts`` consecutive mini-batches whose sizes differ by one at most (fewer when
    ``n < parts``). Dynamic sampling, over-provisioning and partial rollouts change ``n`` from step to step;
    every data-parallel rank has the same ``n``, so all take the same number of optimizer steps."""
    bounds = [k * n // parts for k in range(parts + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a]
