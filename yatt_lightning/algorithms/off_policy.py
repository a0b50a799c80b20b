"""Corrections for rollouts that were not sampled by exactly the policy being trained.

The engine samples with its own numerics (bf16 kernels on GPU, other batch shapes), partial rollouts carry
tokens sampled by older weights across steps, and over-provisioned groups are kept by finishing order.
:class:`TruncatedIS` (Yao et al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training") weights each token's policy-gradient loss by the importance ratio of the training policy at
rollout time to the engine, ``w = min(exp(old_logp - engine_logp), cap)``, detached: the gradient becomes
an estimate for the policy being trained, and the cap bounds its variance. The ratio's mean and the
fraction of tokens the cap truncated are logged (``off_policy/tis_ratio``, ``off_policy/tis_truncated``).
"""

from __future__ import annotations

import torch

from yatt_lightning.algorithms.registry import Registered


class OffPolicyCorrection(Registered):
    """Base class: ``__call__(old_logprobs, engine_logprobs) -> (per-token weight [b, s], metrics)``; the
    weight multiplies the policy-gradient loss of each token. ``metric_names``: the keys of ``metrics``."""

    family = "off-policy correction"
    metric_names: tuple[str, ...] = ()

    def __call__(self, old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError


class TruncatedIS(OffPolicyCorrection):
    """Args:
    cap: Largest weight (2 in the paper's experiments).
    """

    metric_names = ("off_policy/tis_ratio", "off_policy/tis_truncated")

    def __init__(self, cap: float = 2.0) -> None:
        if cap < 1:
            raise ValueError(f"`model.off_policy_correction.cap` must be >= 1, got {cap}.")
        self.cap = cap

    def __call__(self, old_logprobs, engine_logprobs) -> tuple[torch.Tensor, dict]:
        ratio = torch.exp(torch.clamp(old_logprobs - engine_logprobs, -20.0, 20.0)).detach()
        weight = torch.clamp(ratio, max=self.cap)
        return weight, {"off_policy/tis_ratio": ratio, "off_policy/tis_truncated": (ratio > self.cap).float()}
