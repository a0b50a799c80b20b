"""What one update trains on: a rank's samples (only what training needs), their advantages, and the
logprobs the update computed, packed into right-padded micro-batches for Megatron's schedule."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from yatt_lightning.algorithms.advantage import Advantages
from yatt_lightning.rollout.batch import RolloutBatch
from yatt_lightning.training.packing import pack_by_tokens


@dataclass(frozen=True)
class TrainingSamples:
    """A rank's samples as training sees them: each sample's prompt and completion token ids, the engine's
    logprobs of the completion (the behaviour policy), and its images' references (``None`` for a text row;
    paths and hashes, never pixels). ``action_masks``: for an agent's episodes, per completion token 1 where
    the model sampled it and 0 for an observation's (the loss skips those); ``None``: every completion token
    is the model's. What the load balancer moves between ranks; the rollouts' texts, rows and rewards stay
    with their owner."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rollout_logprobs: list[torch.Tensor]
    images: list[list[Any] | None]
    action_masks: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, rollouts: RolloutBatch) -> TrainingSamples:
        masks = None
        if rollouts.turns is not None:
            masks = [torch.tensor(t.mask, dtype=torch.float) for t in rollouts.turns]
        return cls(
            rollouts.prompt_ids, rollouts.completion_ids, rollouts.rollout_logprobs,
            [row["images"] if "images" in row else None for row in rollouts.rows], masks,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def sequence_lengths(self) -> list[int]:
        return [len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids, strict=True)]


@dataclass(frozen=True)
class MicroBatch:
    """One right-padded micro-batch of ``b`` samples of longest length ``s``.

    ``input_ids [b, s]``; ``loss_mask [b, s-1]`` (1 where position t predicts a completion token the model
    sampled: not an observation's in an agent's episode); ``completion_mask [b, s-1]`` (1 where it predicts
    any completion token), only where the two differ;
    ``sample_index [b]`` (the samples' indices in their batch); ``rollout_logprobs [b, s-1]`` (the
    engine's); where known ``old_logprobs``, ``ref_logprobs [b, s-1]`` and ``advantages`` (``[b]``, or
    ``[b, s-1]`` when they are per token); with a critic ``returns`` and ``old_values [b, s-1]``; for a
    vision-language policy ``pixel_values`` (the samples' images, in order; Qwen-VL's as patches, with each
    image's ``image_grid_thw``) and ``prompt_lengths [b]``.
    Reads as a mapping too (``mb["advantages"]``, ``"pixel_values" in mb``: the fields that are set), as
    the hooks written for dict micro-batches do.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    sample_index: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    prompt_lengths: torch.Tensor | None = None
    completion_mask: torch.Tensor | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        value = getattr(self, key, None) if key in _FIELDS else None
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in _FIELDS and getattr(self, key) is not None

    def replace(self, **fields: torch.Tensor) -> MicroBatch:
        return dataclasses.replace(self, **fields)


_FIELDS = frozenset(f.name for f in dataclasses.fields(MicroBatch))


@dataclass(frozen=True)
class TrainingBatch:
    """The update's input, built once per stage of the update (a new value when a field is added).

    ``advantages`` is ``None`` only for forward passes that need no loss (the old and reference logprobs);
    ``old_logprobs`` / ``ref_logprobs`` are per-sample 1-D tensors over the completion tokens, present when
    the update computed them (old: more than one optimizer step per rollout batch; ref: a KL term).
    """

    samples: TrainingSamples
    advantages: Advantages | None = None
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, rollouts: RolloutBatch, advantages: Advantages | None = None) -> TrainingBatch:
        return cls(TrainingSamples.of(rollouts), advantages)

    def __len__(self) -> int:
        return len(self.samples)

    def plan_by_tokens(
        self, indices: list[int], token_budget: int, overhead_tokens: int = 256, pad_to_multiple: int = 8
    ) -> list[list[int]]:
        """Group ``indices`` into micro-batches whose padded size (samples x longest) fits ``token_budget``,
        with the least padding plus ``overhead_tokens`` per micro-batch (:func:`~yatt_lightning.training.packing.pack_by_tokens`)."""
        lengths = self.samples.sequence_lengths()
        plan = pack_by_tokens([lengths[i] for i in indices], token_budget, overhead_tokens, pad_to_multiple)
        return [[indices[j] for j in mb] for mb in plan]

    def microbatches(
        self,
        indices: list[int],
        micro_batch_size: int,
        pad_id: int,
        pad_to_multiple: int = 8,
        plan: list[list[int]] | None = None,
        pixels: Callable[[list[list[Any]]], torch.Tensor | None] | None = None,
    ) -> list[MicroBatch]:
        """Right-padded :class:`MicroBatch` es of the samples ``indices`` (in that order),
        ``micro_batch_size`` each, or following ``plan`` (lists of sample indices) when given; with
        ``pixels(images)`` (a vision-language policy's: the samples' image references to the micro-batch's
        image fields) also their ``pixel_values`` (and ``image_grid_thw``) and ``prompt_lengths``."""
        samples = self.samples
        per_sample = {
            "rollout_logprobs": samples.rollout_logprobs,
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
            longest = max(len(samples.prompt_ids[i]) + len(samples.completion_ids[i]) for i in chunk)
            seq = -(-longest // pad_to_multiple) * pad_to_multiple
            ids = torch.full((len(chunk), seq), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), seq - 1), dtype=torch.float)
            per_token = {k: torch.zeros((len(chunk), seq - 1)) for k in per_sample}
            for row, i in enumerate(chunk):
                p, c = samples.prompt_ids[i], samples.completion_ids[i]
                ids[row, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
                span = slice(len(p) - 1, len(p) - 1 + len(c))
                mask[row, span] = 1.0 if samples.action_masks is None else samples.action_masks[i]
                for key, values in per_sample.items():
                    per_token[key][row, span] = values[i]
            fields = dict(per_token)
            if advantages is not None and advantages.values is not None:
                fields["advantages"] = advantages.values[chunk].float()
            images = pixels([samples.images[i] or [] for i in chunk]) if pixels is not None else None
            if images is not None:  # placeholders count in the prompt only (a completion may sample the token)
                fields.update(images)
                fields["prompt_lengths"] = torch.tensor([len(samples.prompt_ids[i]) for i in chunk])
            if samples.action_masks is not None:  # per-token values are laid out over every completion token
                full = torch.zeros_like(mask)
                for row, i in enumerate(chunk):
                    start = len(samples.prompt_ids[i]) - 1
                    full[row, start : start + len(samples.completion_ids[i])] = 1.0
                fields["completion_mask"] = full
            out.append(MicroBatch(ids, mask, torch.tensor(chunk), **fields))
        return out

    @staticmethod
    def unpack_per_token(mb: MicroBatch, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-sample completion-token slices of a ``[b, s-1]`` tensor computed for micro-batch ``mb``."""
        mask = (mb.loss_mask if mb.completion_mask is None else mb.completion_mask).bool()
        return [values[row][mask[row]].detach().clone() for row in range(values.shape[0])]
