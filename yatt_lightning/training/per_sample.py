"""Per-sample values from a forward pass over a training batch's micro-batches: the completion tokens'
logprobs under a policy (the old policy's and the reference's in the RL update, DPO's reference) or a
critic's values, cut back into one tensor per sample."""

from __future__ import annotations

from collections.abc import Callable

import torch

from yatt_lightning.models.logprobs import token_logprobs
from yatt_lightning.training.batch import MicroBatch, TrainingBatch


def sample_logprobs(
    model, microbatches: list[MicroBatch], n_samples: int, temperature: float
) -> list[torch.Tensor] | None:
    """Per-sample completion-token logprobs of ``microbatches`` (from ``TrainingBatch.microbatches``) under
    ``model`` (a ``MegatronPolicy``, forward only); ``None`` on pipeline stages other than the last."""
    return per_sample_forward(
        model, microbatches, n_samples,
        lambda mb, logits: token_logprobs(logits[:, :-1], mb.input_ids[:, 1:], temperature),
    )  # fmt: skip


def per_sample_forward(
    model, microbatches: list[MicroBatch], n_samples: int, per_token: Callable[[MicroBatch, torch.Tensor], torch.Tensor]
) -> list[torch.Tensor] | None:
    """``per_token(mb, output) -> [b, s-1]`` of ``model``'s forward output on each micro-batch, cut into
    per-sample 1-D tensors over the completion tokens, in sample order; ``None`` on pipeline stages other
    than the last (only the last stage sees the output)."""
    def collect(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        values = TrainingBatch.unpack_per_token(mb, per_token(mb, output))
        return torch.zeros(()), mb.loss_mask.sum().to(torch.int), {"values": values}

    outputs = model.forward_backward(microbatches, collect, forward_only=True)
    if not outputs:
        return None
    result: list[torch.Tensor] = [torch.empty(0)] * n_samples
    for mb, out in zip(microbatches, outputs, strict=True):
        for i, values in zip(mb.sample_index.tolist(), out["values"], strict=True):
            result[i] = values
    return result
