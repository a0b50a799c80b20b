"""How per-token losses become the step's loss: which tokens weigh how much, and what the sum is divided by.

Megatron's schedule sums each micro-batch's ``(weighted loss sum, count)`` over micro-batches and
data-parallel ranks and divides the gradient by the total count, so every choice here is exact over the
whole optimizer step, not per micro-batch.

- :class:`TokenMean` (DAPO's token-level loss, Yu et al., 2025): every completion token of the step
  weighs the same, so long responses are not down-weighted.
- :class:`SequenceMean` (GRPO's original and GSPO's): each sequence's token mean, averaged over sequences.
- :class:`ConstantNormalizer` (Dr. GRPO, Liu et al., 2025): the token sum divided by
  ``sequences x max_tokens``, a constant per sample, which removes GRPO's length bias.
"""

from __future__ import annotations

import torch

from yatt_lightning.algorithms.registry import Registered


class LossAggregation(Registered):
    """Base class: ``weights(mask [b, s], max_new_tokens) -> (per-token weights [b, s], count)``; the step's
    loss is ``sum(loss * weights) / sum(count)`` over every micro-batch and rank."""

    family = "loss aggregation"

    def weights(self, mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TokenMean(LossAggregation):
    def weights(self, mask, max_new_tokens) -> tuple[torch.Tensor, torch.Tensor]:
        return mask, mask.sum().to(torch.int)


class SequenceMean(LossAggregation):
    def weights(self, mask, max_new_tokens) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = mask.sum(dim=-1, keepdim=True)
        return mask / tokens.clamp(min=1), (tokens > 0).sum().to(torch.int)


class ConstantNormalizer(LossAggregation):
    """Args:
    max_tokens: The constant per sequence (``None``: ``model.sampling.max_new_tokens``, as Dr. GRPO does).
    """

    def __init__(self, max_tokens: int | None = None) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"`model.loss_aggregation.max_tokens` must be >= 1, got {max_tokens}.")
        self.max_tokens = max_tokens

    def weights(self, mask, max_new_tokens) -> tuple[torch.Tensor, torch.Tensor]:
        constant = self.max_tokens or max_new_tokens
        return mask / constant, torch.tensor(mask.shape[0], dtype=torch.int)
