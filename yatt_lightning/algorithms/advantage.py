"""Advantage estimators: turn a rollout batch's rewards (and a critic's values) into advantages.

One class per estimator, chosen with ``class_path`` (``model.advantage_estimator``):

- :class:`GRPOAdvantage` (Shao et al., 2024, "DeepSeekMath"): a sample's reward minus its group's mean
  (the n samples of one prompt), divided by the group's unbiased standard deviation (``torch.std``, as in
  the paper and TRL). ``normalize_std=False`` is Dr. GRPO's centring only (Liu et al., 2025, "Understanding
  R1-Zero-Like Training"), which stops up-weighting groups that are nearly solved or nearly failed.
- :class:`RLOOAdvantage` (Ahmadian et al., 2024, "Back to Basics"): the reward minus the mean of the
  *other* samples of the group, ``n/(n-1) (r_i - mean)``; unbiased, no division by a standard deviation.
- :class:`ReinforcePlusPlus` (Hu, 2025, "REINFORCE++"): per-token returns (the sequence reward at the
  last token plus per-token rewards, such as a KL penalty, summed from each token to the end), normalised
  by the mean and standard deviation over every token of the *global* batch (all data-parallel ranks);
  ``group_baseline=True`` first subtracts the group's mean reward (REINFORCE++-baseline).
- :class:`GAE` (Schulman et al., 2016) for PPO with a critic: ``delta_t = r_t + gamma V_{t+1} - V_t``,
  ``A_t = sum_k (gamma lam)^k delta_{t+k}``, value targets ``A_t + V_t``; advantages whitened over the
  global batch (as PPO implementations do); ``V`` after the last token is 0.

A group whose rewards are all equal gets advantage 0 from the group estimators. Sums that need the whole
batch go through ``AdvantageInputs.all_reduce``, which sums over every rank: the ranks of one
model-parallel group hold the same samples, so each replica counts equally and means are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from yatt_lightning.algorithms.registry import Registered


@dataclass(frozen=True)
class Advantages:
    """What the update trains on, per sample of a rollout batch.

    Either ``values [N]`` (one advantage per sample, broadcast over its completion tokens) or ``tokens``
    (one 1-D tensor per sample over its completion tokens). With a critic also ``returns`` (the value
    targets) and ``old_values`` (the critic's values at rollout time, for value clipping), per token.
    """

    values: torch.Tensor | None = None
    tokens: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None
    old_values: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if (self.values is None) == (self.tokens is None):
            raise ValueError("advantages are either one value per sample (`values`) or per token (`tokens`)")
        if self.values is not None and self.values.dim() != 1:
            raise ValueError(f"advantages are one value per sample ([N]); got shape {tuple(self.values.shape)}")
        if (self.returns is None) != (self.old_values is None):
            raise ValueError("a critic's `returns` and `old_values` come together")

    def __len__(self) -> int:
        return len(self.values) if self.values is not None else len(self.tokens)

    @staticmethod
    def of(value: Advantages | torch.Tensor, n_samples: int) -> Advantages:
        """``value`` as advantages of ``n_samples`` samples (an ``advantage`` hook may return a plain tensor)."""
        out = value if isinstance(value, Advantages) else Advantages(torch.as_tensor(value).float())
        if len(out) != n_samples:
            raise ValueError(f"the `advantage` hook returned {len(out)} advantages for {n_samples} samples")
        return out

    def select(self, indices: list[int]) -> Advantages:
        def pick(values: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if values is None else [values[i] for i in indices]

        values = None if self.values is None else self.values[indices]
        return Advantages(values, pick(self.tokens), pick(self.returns), pick(self.old_values))

    def per_token(self, i: int, length: int) -> torch.Tensor:
        """Sample ``i``'s advantage at each of its ``length`` completion tokens."""
        return self.tokens[i] if self.tokens is not None else self.values[i].expand(length)


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may use, for one rank's samples.

    ``rewards [N]``: one scalar per sample (the reward functions' weighted sum, shaping included);
    ``group_ids [N]``: the prompt of each sample; ``lengths``: completion tokens per sample;
    ``token_rewards``: per-token rewards added at each completion token (reward functions' per-token
    rewards, and the KL penalty when it is part of the reward), or ``None``; ``values``: the critic's
    value of each completion token's state, or ``None`` without a critic; ``all_reduce(t)``: ``t`` summed
    over every rank (returns it; the identity on one process).
    """

    rewards: torch.Tensor
    group_ids: torch.Tensor
    lengths: list[int]
    token_rewards: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t

    def sequence_rewards(self) -> torch.Tensor:
        """Each sample's total reward: its scalar plus its per-token rewards."""
        if self.token_rewards is None:
            return self.rewards.double()
        return self.rewards.double() + torch.stack([t.double().sum() for t in self.token_rewards])

    def token_level(self, scalars: torch.Tensor) -> list[torch.Tensor]:
        """Per-token rewards: ``scalars[i]`` at sample i's last token, plus its per-token rewards."""
        out = []
        for i, n in enumerate(self.lengths):
            r = torch.zeros(n, dtype=torch.float64)
            if n:
                r[-1] = scalars[i]
            if self.token_rewards is not None:
                r = r + self.token_rewards[i].double()
            out.append(r)
        return out


class AdvantageEstimator(Registered):
    """Base class: ``__call__(inputs: AdvantageInputs) -> Advantages``.

    ``group_baseline``: the estimator compares each sample with the other samples of its prompt, so a
    group of one sample gets advantage 0 and the run learns nothing (refused at construction).
    ``needs_critic``: the estimator uses ``inputs.values`` (refused without ``model.critic``).
    """

    family = "advantage estimator"
    group_baseline: ClassVar[bool] = False
    needs_critic: ClassVar[bool] = False

    def __call__(self, inputs: AdvantageInputs) -> Advantages:
        raise NotImplementedError


def _check_eps(eps: float) -> None:
    if eps <= 0:
        raise ValueError(f"`model.advantage_estimator.eps` must be > 0, got {eps}.")


class GRPOAdvantage(AdvantageEstimator):
    """Group-normalised advantages.

    Args:
        normalize_std: Divide by the group's standard deviation (GRPO); False only centres (Dr. GRPO).
        eps: Added to the standard deviation to avoid division by zero.
    """

    group_baseline = True

    def __init__(self, normalize_std: bool = True, eps: float = 1e-6) -> None:
        _check_eps(eps)
        self.normalize_std = normalize_std
        self.eps = eps

    def __call__(self, inputs: AdvantageInputs) -> Advantages:
        return Advantages(by_group(inputs.sequence_rewards(), inputs.group_ids, self._normalise).float())

    def _normalise(self, r: torch.Tensor) -> torch.Tensor:
        centred = r - r.mean()
        if not self.normalize_std:
            return centred
        std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
        return centred / (std + self.eps)


class RLOOAdvantage(AdvantageEstimator):
    """Leave-one-out baseline: a sample's reward minus the mean reward of the other samples of its group."""

    group_baseline = True

    def __call__(self, inputs: AdvantageInputs) -> Advantages:
        return Advantages(by_group(inputs.sequence_rewards(), inputs.group_ids, _leave_one_out).float())


def _leave_one_out(r: torch.Tensor) -> torch.Tensor:
    return r - (r.sum() - r) / (r.numel() - 1) if r.numel() > 1 else torch.zeros_like(r)


def by_group(
    rewards: torch.Tensor, group_ids: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``fn`` applied to each group's rewards (float64), put back in sample order."""
    rewards = rewards.double()
    out = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        out[idx] = fn(rewards[idx])
    return out


def whiten(
    tokens: list[torch.Tensor], all_reduce: Callable[[torch.Tensor], torch.Tensor], eps: float
) -> list[torch.Tensor]:
    """``(x - mean) / sqrt(var + eps)`` with the mean and (population) variance over every token of every
    rank's samples."""
    flat = torch.cat(tokens).double() if tokens else torch.zeros(0, dtype=torch.float64)
    sums = all_reduce(
        torch.stack([flat.sum(), (flat**2).sum(), torch.tensor(float(flat.numel()), dtype=torch.float64)])
    )
    count = max(float(sums[2]), 1.0)
    mean = sums[0] / count
    var = torch.clamp(sums[1] / count - mean**2, min=0.0)
    return [((t.double() - mean) / torch.sqrt(var + eps)).float() for t in tokens]


def _discounted(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go ``G_t = r_t + gamma G_{t+1}`` of one sample's per-token rewards."""
    out, running = torch.zeros_like(rewards), torch.zeros((), dtype=rewards.dtype)
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


class ReinforcePlusPlus(AdvantageEstimator):
    """REINFORCE++: per-token returns normalised over the global batch.

    Args:
        group_baseline: Subtract the group's mean reward first (REINFORCE++-baseline; needs n >= 2).
        gamma: Discount of the per-token returns (1 = none, as in the paper's LLM setting; 0 = each token's
            own reward, the per-token advantage of on-policy distillation, where a return summed over the
            completion would reward short completions for holding fewer tokens' KL).
        eps: Added to the variance before the square root.
    """

    def __init__(self, group_baseline: bool = False, gamma: float = 1.0, eps: float = 1e-8) -> None:
        _check_eps(eps)
        if not 0 <= gamma <= 1:
            raise ValueError(f"`model.advantage_estimator.gamma` must be in [0, 1], got {gamma}.")
        self.group_baseline = group_baseline
        self.gamma = gamma
        self.eps = eps

    def __call__(self, inputs: AdvantageInputs) -> Advantages:
        scalars = inputs.rewards.double()
        if self.group_baseline:
            scalars = by_group(scalars, inputs.group_ids, lambda r: r - r.mean())
        returns = [_discounted(r, self.gamma) for r in inputs.token_level(scalars)]
        return Advantages(tokens=whiten(returns, inputs.all_reduce, self.eps))


class GAE(AdvantageEstimator):
    """Generalised advantage estimation from a critic's values (PPO).

    Args:
        gamma: Discount per token.
        lam: GAE's lambda: 1 gives Monte-Carlo returns minus the value, 0 the one-step TD error.
        whiten: Normalise the advantages over the global batch (the value targets are not normalised).
        eps: Added to the variance before the square root when whitening.
    """

    needs_critic = True

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, eps: float = 1e-8) -> None:
        _check_eps(eps)
        for key, value in (("gamma", gamma), ("lam", lam)):
            if not 0 <= value <= 1:
                raise ValueError(f"`model.advantage_estimator.{key}` must be in [0, 1], got {value}.")
        self.gamma = gamma
        self.lam = lam
        self.whiten = whiten
        self.eps = eps

    def __call__(self, inputs: AdvantageInputs) -> Advantages:
        if inputs.values is None:
            raise ValueError("GAE needs the critic's values: set `model.critic`.")
        advantages, returns = [], []
        for rewards, values in zip(inputs.token_level(inputs.rewards.double()), inputs.values, strict=True):
            values = values.double()
            following = torch.cat([values[1:], torch.zeros(1, dtype=values.dtype)])
            deltas = rewards + self.gamma * following - values
            adv = _discounted(deltas, self.gamma * self.lam)
            advantages.append(adv.float())
            returns.append((adv + values).float())
        if self.whiten:
            advantages = whiten(advantages, inputs.all_reduce, self.eps)
        return Advantages(tokens=advantages, returns=returns, old_values=[v.float() for v in inputs.values])
