"""Token logprobs and entropy from vocabulary-parallel logits (each TP rank holds a slice of the vocabulary)."""

from __future__ import annotations

import torch


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
