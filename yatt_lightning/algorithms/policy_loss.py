"""Policy losses: per-token loss from current, old (behaviour) logprobs and advantages.

:class:`PPOClipLoss` is PPO's clipped surrogate (Schulman et al., 2017) as used by GRPO: with the
importance ratio ``r = exp(logp - old_logp)``, the per-token loss is
``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``. ``clip_eps_high`` allows DAPO's asymmetric
"clip-higher" (Yu et al., 2025); by default it equals ``clip_eps``. Aggregation is token-level: the
trainer sums per-token losses over all tokens of the optimizer step (every micro-batch and data-parallel
rank) and divides by their number, so long responses are not down-weighted (DAPO's token-level
policy-gradient loss), rather than averaging per sequence first.
"""

from __future__ import annotations

import torch


class PolicyLoss:
    """Base class: ``__call__(logprobs, old_logprobs, advantages, mask) -> (per_token_loss, metrics)``.

    All tensors are ``[b, s]``; ``advantages`` is already broadcast to tokens. ``metrics`` maps a name
    to a per-token tensor whose masked sum the trainer averages over tokens for logging.
    """

    def __call__(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


class PPOClipLoss(PolicyLoss):
    """PPO-clip surrogate with token-level aggregation.

    Args:
        clip_eps: Lower clip range: the ratio is clipped below at ``1 - clip_eps``.
        clip_eps_high: Upper clip range (``None`` = ``clip_eps``); DAPO uses 0.28 with ``clip_eps`` 0.2.
    """

    def __init__(self, clip_eps: float = 0.2, clip_eps_high: float | None = None) -> None:
        if not 0 < clip_eps < 1:
            raise ValueError(f"`model.algorithm.clip_eps` must be in (0, 1), got {clip_eps}.")
        if clip_eps_high is not None and clip_eps_high <= 0:
            raise ValueError(f"`model.algorithm.clip_eps_high` must be > 0, got {clip_eps_high}.")
        self.clip_eps = clip_eps
        self.clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    def __call__(self, logprobs, old_logprobs, advantages, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(logprobs - old_logprobs)
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, 1 - self.clip_eps, 1 + self.clip_eps_high) * advantages
        loss = -torch.minimum(unclipped, clipped)
        clip_frac = (clipped < unclipped).float()  # the clip bound was the active (smaller) term
        return loss, {"clip_fraction": clip_frac.detach(), "ratio": ratio.detach()}
