"""What one update trains on: a rank's rollouts, their advantages, and the logprobs the update computed,
packed into right-padded micro-batches for Megatron's schedule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from yatt_lightning.algorithms.advantage import Advantages
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.training.packing import pack_by_tokens


@dataclass(frozen=True)
class TrainingBatch:
    """The update's input, built once per stage of the update (a new value when a field is added).

    ``advantages`` is ``None`` only for forward passes that need no loss (the old and reference logprobs);
    ``old_logprobs`` / ``ref_logprobs`` are per-sample 1-D tensors over the completion tokens, present when
    the update computed them (old: more than one optimizer step per rollout batch; ref: a KL term).
    """

    rollouts: RolloutBatch
    advantages: Advantages | None = None
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.rollouts)

    def plan_by_tokens(
        self, indices: list[int], token_budget: int, overhead_tokens: int = 256, pad_to_multiple: int = 8
    ) -> list[list[int]]:
        """Group ``indices`` into micro-batches whose padded size (samples x longest) fits ``token_budget``,
        with the least padding plus ``overhead_tokens`` per micro-batch (:func:`~yatt_lightning.training.packing.pack_by_tokens`)."""
        lengths = self.rollouts.sequence_lengths()
        plan = pack_by_tokens([lengths[i] for i in indices], token_budget, overhead_tokens, pad_to_multiple)
        return [[indices[j] for j in mb] for mb in plan]

    def microbatches(
        self,
        indices: list[int],
        micro_batch_size: int,
        pad_id: int,
        pad_to_multiple: int = 8,
        plan: list[list[int]] | None = None,
        pixels: Callable[[list[dict]], torch.Tensor | None] | None = None,
    ) -> list[dict]:
        """Right-padded micro-batches of the samples ``indices`` (in that order), ``micro_batch_size``
        each, or following ``plan`` (lists of sample indices) when given.

        Each holds ``input_ids [b, s]``, ``loss_mask [b, s-1]`` (1 where position t predicts a
        completion token), ``sample_index [b]``, ``rollout_logprobs`` (the engine's) and, where known,
        ``old_logprobs``, ``ref_logprobs`` ``[b, s-1]`` and ``advantages`` (``[b]``, or ``[b, s-1]`` when
        they are per token), with a critic also ``returns`` and ``old_values`` ``[b, s-1]``; with ``pixels(rows)``
        (a vision-language policy's) also ``pixel_values`` of the samples' images, in sample order, and
        ``prompt_lengths [b]``.
        """
        rollouts = self.rollouts
        per_sample = {
            "rollout_logprobs": rollouts.rollout_logprobs,
            "old_logprobs": self.old_logprobs,
            "ref_logprobs": self.ref_logprobs,
        }
        advantages = self.advantages
        if advantages is not None:
            per_sample.update({"returns": advantages.returns, "old_values": advantages.old_values})
            if advantages.tokens is not None:
                per_sample["advantages"] = advantages.tokens
        per_sample = {k: v for k, v in per_sample.items() if v is not None}
        out = []
        chunks = plan or [indices[s : s + micro_batch_size] for s in range(0, len(indices), micro_batch_size)]
        for chunk in chunks:
            longest = max(len(rollouts.prompt_ids[i]) + len(rollouts.completion_ids[i]) for i in chunk)
            seq = -(-longest // pad_to_multiple) * pad_to_multiple
            ids = torch.full((len(chunk), seq), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), seq - 1), dtype=torch.float)
            per_token = {k: torch.zeros((len(chunk), seq - 1)) for k in per_sample}
            for row, i in enumerate(chunk):
                p, c = rollouts.prompt_ids[i], rollouts.completion_ids[i]
                ids[row, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
                span = slice(len(p) - 1, len(p) - 1 + len(c))
                mask[row, span] = 1.0
                for key, values in per_sample.items():
                    per_token[key][row, span] = values[i]
            mb = {"input_ids": ids, "loss_mask": mask, "sample_index": torch.tensor(chunk), **per_token}
            if advantages is not None and advantages.values is not None:
                mb["advantages"] = advantages.values[chunk].float()
            images = pixels([rollouts.rows[i] for i in chunk]) if pixels is not None else None
            if images is not None:  # placeholders count in the prompt only (a completion may sample the token)
                mb["pixel_values"] = images
                mb["prompt_lengths"] = torch.tensor([len(rollouts.prompt_ids[i]) for i in chunk])
            out.append(mb)
        return out

    @staticmethod
    def unpack_per_token(mb: dict, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-sample completion-token slices of a ``[b, s-1]`` tensor computed for micro-batch ``mb``."""
        mask = mb["loss_mask"].bool()
        return [values[row][mask[row]].detach().clone() for row in range(values.shape[0])]
