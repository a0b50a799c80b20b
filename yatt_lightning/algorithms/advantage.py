"""Advantage estimators: turn per-sample rewards into per-sample advantages.

:class:`GRPOAdvantage` follows GRPO (Shao et al., 2024, "DeepSeekMath"): each prompt's n samples form
a group, and a sample's advantage is its reward minus the group mean, divided by the group's standard
deviation. Choices: the standard deviation is the unbiased one (``torch.std``), as in the GRPO paper
and TRL; ``normalize_std=False`` gives Dr. GRPO's mean-centering only (Liu et al., 2025), which avoids
up-weighting groups that are nearly solved. A group whose rewards are all equal gets advantage 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Advantages:
    """One advantage per sample of a rollout batch (``values [N]``, float), what the update trains on."""

    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.values.dim() != 1:
            raise ValueError(f"advantages are one value per sample ([N]); got shape {tuple(self.values.shape)}")

    @staticmethod
    def of(value: Advantages | torch.Tensor, n_samples: int) -> Advantages:
        """``value`` as advantages of ``n_samples`` samples (an ``advantage`` hook may return a plain tensor)."""
        out = value if isinstance(value, Advantages) else Advantages(torch.as_tensor(value).float())
        if len(out.values) != n_samples:
            raise ValueError(f"the `advantage` hook returned {len(out.values)} advantages for {n_samples} samples")
        return out

    def select(self, indices: list[int]) -> Advantages:
        return Advantages(self.values[indices])


class AdvantageEstimator:
    """Base class: ``__call__(rewards [N], group_ids [N]) -> advantages [N]`` (one value per sample).

    ``group_baseline``: the estimator compares each sample with the other samples of its prompt, so a
    group of one sample gets advantage 0 and the run learns nothing (refused at construction)."""

    group_baseline: bool = False

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GRPOAdvantage(AdvantageEstimator):
    """Group-normalised advantages.

    Args:
        normalize_std: Divide by the group's standard deviation (GRPO); False only centres (Dr. GRPO).
        eps: Added to the standard deviation to avoid division by zero.
    """

    group_baseline = True

    def __init__(self, normalize_std: bool = True, eps: float = 1e-6) -> None:
        if eps <= 0:
            raise ValueError(f"`model.advantage.eps` must be > 0, got {eps}.")
        self.normalize_std = normalize_std
        self.eps = eps

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        rewards = rewards.double()
        adv = torch.zeros_like(rewards)
        for g in torch.unique(group_ids):
            idx = group_ids == g
            r = rewards[idx]
            centred = r - r.mean()
            if self.normalize_std:
                std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
                centred = centred / (std + self.eps)
            adv[idx] = centred
        return adv.float()
