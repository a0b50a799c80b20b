"""Preference losses of :class:`~yatt_lightning.stages.dpo.DPOModule`, each a class chosen by ``class_path``.

Each takes per pair the policy's and the frozen reference's log-probabilities of the chosen and the rejected
completion (summed over their tokens) and the completions' token counts, and returns the per-pair loss and
the implicit rewards ``beta * (policy - reference)`` of the chosen and the rejected completion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairLogprobs:
    """Per pair ``[n]``: summed log-probabilities of the chosen and rejected completions under the policy and
    the reference, and the completions' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


class PreferenceLoss:
    """Base class: :meth:`__call__` returns ``(loss [n], chosen_reward [n], rejected_reward [n])``."""

    def __init__(self, beta: float = 0.1) -> None:
        if beta <= 0:
            raise ValueError(f"`model.loss.init_args.beta` must be > 0, got {beta}.")
        self.beta = beta

    def __call__(self, lp: PairLogprobs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def rewards(self, lp: PairLogprobs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.beta * (lp.chosen - lp.ref_chosen), self.beta * (lp.rejected - lp.ref_rejected)


class SigmoidLoss(PreferenceLoss):
    """DPO (Rafailov et al., 2023): ``-log sigmoid(beta * margin)``, the margin being the chosen's log-ratio to
    the reference minus the rejected's; ``label_smoothing`` > 0 is the conservative DPO of noisy labels.

    Args:
        beta: Strength of the implicit KL to the reference.
        label_smoothing: Probability that a pair's labels are flipped (0: plain DPO).
    """

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0) -> None:
        super().__init__(beta)
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"`model.loss.init_args.label_smoothing` must be in [0, 0.5), got {label_smoothing}.")
        self.label_smoothing = label_smoothing

    def __call__(self, lp):
        chosen, rejected = self.rewards(lp)
        margin = chosen - rejected
        eps = self.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        return loss, chosen, rejected


class IPOLoss(PreferenceLoss):
    """IPO (Azar et al., 2023): ``(margin - 1 / (2 beta))**2`` on the log-ratios averaged per token (the
    length normalisation TRL uses), which does not push the margin without bound as the sigmoid does.

    Args:
        beta: The regularisation; the loss holds the margin near ``1 / (2 beta)``.
    """

    def __call__(self, lp):
        chosen, rejected = self.rewards(lp)
        margin = (lp.chosen - lp.ref_chosen) / lp.chosen_tokens - (lp.rejected - lp.ref_rejected) / lp.rejected_tokens
        loss = (margin - 1.0 / (2.0 * self.beta)) ** 2
        return loss, chosen, rejected
