"""KL estimators between the policy and a frozen reference, per token.

With ``log_ratio = ref_logp - logp`` evaluated on tokens sampled from the policy (Schulman, "Approximating
KL divergence", 2020): k1 = ``-log_ratio`` (unbiased, high variance, can be negative); k2 =
``log_ratio**2 / 2``; k3 = ``exp(log_ratio) - log_ratio - 1`` (unbiased, always >= 0, low variance; GRPO's
choice). The log-ratio is clamped to +-20 before exponentiation so one stray token cannot make the loss
infinite.
"""

from __future__ import annotations

import torch

from yatt_lightning.algorithms.registry import Registered


class KLEstimator(Registered):
    """Base class: ``__call__(logprobs, ref_logprobs) -> per-token KL estimate``."""

    family = "KL estimator"

    def __call__(self, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class K1(KLEstimator):
    def __call__(self, logprobs, ref_logprobs) -> torch.Tensor:
        return logprobs - ref_logprobs


class K2(KLEstimator):
    def __call__(self, logprobs, ref_logprobs) -> torch.Tensor:
        return 0.5 * (logprobs - ref_logprobs) ** 2


class K3(KLEstimator):
    def __call__(self, logprobs, ref_logprobs) -> torch.Tensor:
        log_ratio = torch.clamp(ref_logprobs - logprobs, -20.0, 20.0)
        return torch.exp(log_ratio) - log_ratio - 1
