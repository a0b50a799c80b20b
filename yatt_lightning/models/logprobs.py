"""Token logprobs and entropy from vocabulary-parallel logits (each TP rank holds a slice of the vocabulary)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from yatt_lightning.training.batch import MicroBatch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[targets]`` per position; differentiable; TP-aware.

    ``logits`` is ``[..., vocab / tp]`` (this rank's slice), ``targets`` is ``[...]`` of global ids.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature
    return -vocab_parallel_cross_entropy(scaled, targets)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, reduced over the TP group."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    scaled = logits.float() / temperature
    peak = scaled.max(dim=-1).values
    if tp > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = scaled - peak.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
    if tp > 1:
        torch.distributed.all_reduce(sums, group=group)
    z, weighted = sums[0], sums[1]
    return z.log() - weighted / z


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
    from yatt_lightning.training.batch import TrainingBatch

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


def max_abs_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a - b| over the tokens of aligned per-sample tensors (0 when there are none)."""
    return max(((x - y).abs().max().item() for x, y in zip(a, b, strict=True) if len(x)), default=0.0)


def share_with_pipeline(per_sample: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """What the last pipeline stage computed (per-sample tensors), on every stage of this rank's pipeline
    (the other stages pass ``None``); unchanged without pipeline parallelism."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return per_sample
    group = ps.get_pipeline_model_parallel_group()
    last = torch.distributed.get_process_group_ranks(group)[-1]
    box = [per_sample]
    torch.distributed.broadcast_object_list(box, src=last, group=group)
    return box[0]
