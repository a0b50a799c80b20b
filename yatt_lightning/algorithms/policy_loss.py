"""Policy losses: per-token loss from current, old (behaviour) logprobs and advantages.

- :class:`PPOClipLoss`: PPO's clipped surrogate (Schulman et al., 2017), as GRPO uses it. With the
  importance ratio ``r = exp(logp - old_logp)`` the per-token loss is
  ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``. ``clip_eps_high`` is DAPO's asymmetric
  "clip-higher" (Yu et al., 2025; 0.28 with ``clip_eps`` 0.2), which leaves room for unlikely tokens to
  grow. ``dual_clip`` (Ye et al., 2020, "Mastering Complex Control in MOBA Games") bounds the loss of a
  negative-advantage token at ``-c A``, so a huge ratio on a bad token cannot dominate the step.
- :class:`GSPOLoss` (Zheng et al., 2025, "Group Sequence Policy Optimization"): the ratio is a sequence's
  length-normalised likelihood ratio ``s = exp(mean_t (logp - old_logp))``, clipped with much smaller
  ranges (3e-4 / 4e-4 in the paper); gradients flow through every token as in the paper's GSPO-token form
  (``s_t = sg[s] * exp(logp_t - sg[logp_t])``). Use it with sequence-mean aggregation.

How the per-token losses become one number (token mean, sequence mean, Dr. GRPO's constant) is the
module's ``loss_aggregation`` (:mod:`yatt_lightning.algorithms.aggregation`).
"""

from __future__ import annotations

import torch

from yatt_lightning.algorithms.registry import Registered


class PolicyLoss(Registered):
    """Base class: ``__call__(logprobs, old_logprobs, advantages, mask) -> (per_token_loss, metrics)``.

    All tensors are ``[b, s]``; ``advantages`` is already broadcast to tokens. ``metrics`` maps a name
    to a per-token tensor whose masked sum the trainer averages over tokens for logging: ``clip_fraction``
    and ``ratio`` (logged as ``actor/...``), and the names in :attr:`extra_metrics` (logged as named).
    """

    family = "policy loss"

    @property
    def extra_metrics(self) -> tuple[str, ...]:
        return ()

    def __call__(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


def _check_clip(clip_eps: float, clip_eps_high: float | None) -> float:
    if not 0 < clip_eps < 1:
        raise ValueError(f"`model.algorithm.clip_eps` must be in (0, 1), got {clip_eps}.")
    if clip_eps_high is not None and clip_eps_high <= 0:
        raise ValueError(f"`model.algorithm.clip_eps_high` must be > 0, got {clip_eps_high}.")
    return clip_eps if clip_eps_high is None else clip_eps_high


def _clipped_surrogate(ratio, advantages, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - low, 1 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()  # the clip bound was the active (smaller) term


class PPOClipLoss(PolicyLoss):
    """PPO-clip surrogate.

    Args:
        clip_eps: Lower clip range: the ratio is clipped below at ``1 - clip_eps``.
        clip_eps_high: Upper clip range (``None`` = ``clip_eps``); DAPO uses 0.28 with ``clip_eps`` 0.2.
        dual_clip: ``c`` > 1 of dual-clip PPO: a token with a negative advantage loses at most ``-c A``
            (``None``: off; 3 is the paper's value).
    """

    def __init__(
        self, clip_eps: float = 0.2, clip_eps_high: float | None = None, dual_clip: float | None = None
    ) -> None:
        self.clip_eps_high = _check_clip(clip_eps, clip_eps_high)
        if dual_clip is not None and dual_clip <= 1:
            raise ValueError(f"`model.algorithm.dual_clip` must be > 1 (3 in the paper), got {dual_clip}.")
        self.clip_eps = clip_eps
        self.dual_clip = dual_clip

    @property
    def extra_metrics(self) -> tuple[str, ...]:
        return ("actor/dual_clip_fraction",) if self.dual_clip is not None else ()

    def __call__(self, logprobs, old_logprobs, advantages, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(logprobs - old_logprobs)
        loss, clip_frac = _clipped_surrogate(ratio, advantages, self.clip_eps, self.clip_eps_high)
        metrics = {"clip_fraction": clip_frac, "ratio": ratio.detach()}
        if self.dual_clip is not None:
            bound = -self.dual_clip * advantages
            capped = (advantages < 0) & (loss > bound)
            loss = torch.where(capped, bound, loss)
            metrics["actor/dual_clip_fraction"] = capped.float()
        return loss, metrics


class GSPOLoss(PolicyLoss):
    """GSPO: PPO-clip on each sequence's length-normalised importance ratio.

    Args:
        clip_eps: Lower clip range of the sequence ratio (the paper: 3e-4).
        clip_eps_high: Upper clip range (the paper: 4e-4; ``None`` = ``clip_eps``).
    """

    def __init__(self, clip_eps: float = 3e-4, clip_eps_high: float | None = 4e-4) -> None:
        self.clip_eps_high = _check_clip(clip_eps, clip_eps_high)
        self.clip_eps = clip_eps

    def __call__(self, logprobs, old_logprobs, advantages, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)
        seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=-1, keepdim=True) / tokens
        ratio = torch.exp(seq_log_ratio.detach() + logprobs - logprobs.detach())  # value s, gradient per token
        loss, clip_frac = _clipped_surrogate(ratio, advantages, self.clip_eps, self.clip_eps_high)
        return loss, {"clip_fraction": clip_frac, "ratio": ratio.detach()}
