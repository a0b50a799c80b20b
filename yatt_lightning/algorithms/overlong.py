"""DAPO's soft overlong punishment (Yu et al., 2025): a length-aware penalty added to the reward.

With the longest allowed response ``L`` (``model.sampling.max_new_tokens``) and a buffer of ``cache``
tokens, a response of ``n`` tokens gets 0 while ``n <= L - cache`` and ``(L - cache - n) / cache`` inside
the buffer, down to -1 at ``L`` (where the engine cuts a response that did not finish).
"""

from __future__ import annotations

import torch

from yatt_lightning.algorithms.registry import Registered


class RewardShaping(Registered):
    """Base class: ``__call__(lengths [N], max_new_tokens) -> [N]`` (completion tokens per sample) added to the rewards."""

    family = "reward shaping"

    def __call__(self, lengths: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        raise NotImplementedError


class OverlongPenalty(RewardShaping):
    """Args:
    cache: Tokens before the limit where the penalty ramps from 0 to -1 (DAPO: 4096 of 20480).
    weight: Multiplies the penalty.
    """

    def __init__(self, cache: int = 4, weight: float = 1.0) -> None:
        if cache < 1:
            raise ValueError(f"`model.reward_shaping.cache` must be >= 1, got {cache}.")
        self.cache = cache
        self.weight = weight

    def __call__(self, lengths, max_new_tokens) -> torch.Tensor:
        if self.cache >= max_new_tokens:
            raise ValueError(
                f"`model.reward_shaping.cache`={self.cache} must be below `model.sampling.max_new_tokens`={max_new_tokens}."
            )
        start = max_new_tokens - self.cache
        penalty = torch.clamp((start - lengths.double()) / self.cache, min=-1.0, max=0.0)
        return (self.weight * penalty).float()
