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
