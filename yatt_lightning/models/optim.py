"""Optimizer settings for the policy (Megatron's optimizer does the work)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimizerSettings:
    """Adam(W) through Megatron-Core's optimizer, with linear warm-up to a constant learning rate.

    Args:
        lr: Peak learning rate.
        weight_decay: Decoupled weight decay.
        adam_beta1: Adam's first-moment decay.
        adam_beta2: Adam's second-moment decay.
        adam_eps: Adam's epsilon.
        clip_grad: Clip the global gradient norm (over all TP/PP/DP shards) to this value; 0 disables.
        warmup_steps: Optimizer steps of linear warm-up from 0 to ``lr``.
        use_distributed_optimizer: Shard optimizer state across data-parallel ranks (ZeRO-1).
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"`model.optimizer.lr` must be > 0, got {self.lr}.")
        if self.clip_grad < 0:
            raise ValueError(f"`model.optimizer.clip_grad` must be >= 0 (0 disables clipping), got {self.clip_grad}.")
        if self.warmup_steps < 0:
            raise ValueError(f"`model.optimizer.warmup_steps` must be >= 0, got {self.warmup_steps}.")

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr
