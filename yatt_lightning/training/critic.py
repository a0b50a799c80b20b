"""PPO's critic: its settings (``model.critic``), its values of a batch, and its clipped value loss.

The critic is a :class:`~yatt_lightning.models.policy.MegatronPolicy` built with a value head
(:mod:`yatt_lightning.models.value_model`) in the policy's tensor / pipeline / data-parallel layout, on
the same ranks, offloaded with the policy while the engine runs. It has its own Megatron optimizer and
learning-rate schedule, trains in the same optimizer steps as the policy (one critic step after each
policy step, on the same micro-batches) and is saved and resumed in the same checkpoint.

The value of completion token t is read at the position that predicts it, the state before the token, as
the policy's logprob is. The loss is PPO's clipped value loss (as in OpenAI's baselines and verl):
``0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``, token-mean over the optimizer step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from yatt_lightning.checkpoint.model_source import ModelSpec
from yatt_lightning.distributed import wire
from yatt_lightning.distributed.failures import check_finite
from yatt_lightning.models.optim import OptimizerSettings
from yatt_lightning.training.batch import MicroBatch
from yatt_lightning.training.per_sample import per_sample_forward
from yatt_lightning.training.step_metrics import add_metric_sums

# The critic's per-token figures of a step, averaged over its tokens for logging.
CRITIC_METRICS = ("critic/value_loss", "critic/clip_fraction", "critic/value_mean")


class Critic:
    """Args:
    path: The model to start the critic's trunk from (``None``: the policy's own checkpoint).
    optimizer: The critic's optimizer settings (PPO implementations train it at a higher rate than the
        policy).
    value_clip: ``c`` of the clipped value loss (``None``: unclipped squared error).
    """

    def __init__(
        self,
        path: ModelSpec | None = None,
        optimizer: OptimizerSettings = OptimizerSettings(lr=1e-3),
        value_clip: float | None = 0.2,
    ) -> None:
        if value_clip is not None and value_clip <= 0:
            raise ValueError(f"`model.critic.value_clip` must be > 0 (or null), got {value_clip}.")
        self.path = path
        self.optimizer = optimizer
        self.value_clip = value_clip

    def build(self, policy_path: Path, params_dtype: torch.dtype, seed: int):
        """This rank's critic (a ``MegatronPolicy`` with a value head) and its optimizer."""
        from yatt_lightning.models.policy import MegatronPolicy

        path = self.path.resolve() if self.path is not None else policy_path
        return MegatronPolicy(path, params_dtype=params_dtype, optimizer=self.optimizer, seed=seed, value_head=True)

    def loss(
        self, values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token value loss ``[b, s]`` and where the clipped term was the larger one."""
        unclipped = (values - returns) ** 2
        if self.value_clip is None:
            return 0.5 * unclipped, torch.zeros_like(unclipped)
        clipped_values = old_values + torch.clamp(values - old_values, -self.value_clip, self.value_clip)
        clipped = (clipped_values - returns) ** 2
        return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()

    def step(self, model, microbatches: list[MicroBatch], step: int, sums: dict[str, float], group=None) -> float:
        """One optimizer step of the critic ``model`` on the policy step's micro-batches (collective over the
        training ranks, ``group``: a disaggregated placement's rollout ranks take no part): adds the token sums
        of :data:`CRITIC_METRICS` (and ``tokens``) to ``sums``; returns the gradient norm."""
        model.zero_grad_buffers()
        with wire.category("gradients"):
            outputs = model.forward_backward(microbatches, self.loss_fn, forward_only=False)
        for out in outputs:
            add_metric_sums(sums, out["metrics"])
        check_finite(outputs, step, what="the critic's value loss", group=group)
        with wire.category("gradients"):
            _, norm = model.optimizer_step(step)
        return norm

    def loss_fn(self, mb: MicroBatch, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Megatron's loss function for one micro-batch: (loss sum, tokens, metrics) with the metrics
        ``tokens`` and the token sums of :data:`CRITIC_METRICS`, by name."""
        values = values[:, :-1]
        mask = mb.loss_mask
        per_token, clipped = self.loss(values, mb.returns, mb.old_values)
        loss_sum = (per_token * mask).sum()
        finite = torch.isfinite(loss_sum)
        if not finite:
            loss_sum = torch.nan_to_num(loss_sum) * 0
        sums = [mask.sum(), (per_token * mask).sum(), (clipped * mask).sum(), (values * mask).sum()]
        metrics = {k: v.detach().float() for k, v in zip(("tokens", *CRITIC_METRICS), sums, strict=True)}
        return loss_sum, mask.sum().to(torch.int), {"metrics": metrics, "finite": finite}


def sample_values(model, microbatches: list[MicroBatch], n_samples: int) -> list[torch.Tensor] | None:
    """Per-sample values of the completion tokens' states under the critic ``model`` (forward only);
    ``None`` on pipeline stages other than the last."""
    return per_sample_forward(model, microbatches, n_samples, lambda mb, values: values[:, :-1])
