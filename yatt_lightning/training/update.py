"""The training half of :class:`~yatt_lightning.module.RLHFModule`: what the advantage uses, the policy
update, the loss, and the micro-batches they run on. A mixin of the module (its methods are the module's
hooks: override them on a subclass of ``RLHFModule``); it reads the module's configuration and models."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from yatt_lightning.algorithms.advantage import AdvantageInputs, Advantages
from yatt_lightning.distributed import wire
from yatt_lightning.distributed.failures import check_finite
from yatt_lightning.models.logprobs import (
    max_abs_difference,
    share_with_pipeline,
    token_entropy,
    token_logprobs,
)  # fmt: skip
from yatt_lightning.rollout.batch import RolloutBatch, mini_batch_slices
from yatt_lightning.training.batch import MicroBatch, TrainingBatch
from yatt_lightning.training.cost_model import Work, microbatch_work
from yatt_lightning.training.critic import CRITIC_METRICS, sample_values
from yatt_lightning.training.per_sample import sample_logprobs
from yatt_lightning.training.step_metrics import add_metric_sums, reduce_token_metrics


class PolicyUpdate:
    """Advantage inputs, update, loss and micro-batches of an RL step (mixed into ``RLHFModule``)."""

    def advantage_inputs(self, rollouts: RolloutBatch) -> tuple[AdvantageInputs, dict[str, float]]:
        """What the estimator uses: the rewards, the per-token rewards (with ``kl_in_reward`` the KL
        penalty, from the engine's logprobs of the sampled tokens against the reference's), and the
        critic's values; and the KL's figures. Collective (the reference's and the critic's forwards)."""
        self.trainer.strategy.rollout.prepare_training()
        batch, everything, figures = TrainingBatch.of(rollouts), list(range(len(rollouts))), {}
        tokens = rollouts.token_rewards
        if self.kl_in_reward:
            ref = share_with_pipeline(self.compute_logprobs(self.reference, batch, everything))
            kl = [self.kl_estimator(lp, r) for lp, r in zip(rollouts.rollout_logprobs, ref, strict=True)]
            penalty = [-self.kl_coef * k for k in kl]
            tokens = penalty if tokens is None else [t + p for t, p in zip(tokens, penalty, strict=True)]
            flat = torch.cat(kl) if kl else torch.zeros(0)
            sums = {"tokens": float(flat.numel()), "kl": float(flat.sum())}
            figures["actor/kl"] = reduce_token_metrics(self.trainer.strategy.controller, sums, ("kl",))["kl"]
        values = None
        if self.critic_model is not None:
            values = share_with_pipeline(
                sample_values(self.critic_model, self.microbatches(batch, everything), len(batch))
            )
        inputs = AdvantageInputs(
            rollouts.rewards, rollouts.group_ids, [len(c) for c in rollouts.completion_ids], tokens, values,
            all_reduce=self.trainer.strategy.controller.all_reduce,
        )  # fmt: skip
        return inputs, figures

    def update(self, rollouts: RolloutBatch, advantages: Advantages) -> dict[str, float]:
        """Policy update: ``ppo_epochs`` passes of ``mini_batches`` optimizer steps over the scored rollouts.
        Returns the update's figures: the token means of :data:`_TOKEN_METRICS`, ``grad_norm`` and
        ``logprob_diff_max`` (logged as ``actor/...``), and the load balancer's, logged under their names."""
        self.trainer.strategy.rollout.prepare_training()
        controller = self.trainer.strategy.controller  # the training ranks (a disaggregated run's trainers)
        batch, figures = TrainingBatch.of(rollouts, advantages), {}
        if self.balancer is not None:
            with wire.category("rollout"):
                rebalanced = self.balancer.rebalance(self, batch)
            batch, figures = rebalanced.batch, rebalanced.metrics
        everything = list(range(len(batch)))
        started, synced, trained = time.perf_counter(), self._grad_sync_seconds(), Work(0.0, 0.0, 0.0)
        old = ref = None
        if self.ppo_epochs * len(mini_batch_slices(len(batch), self.mini_batches)) > 1:
            # More than one optimizer step per rollout batch: later ones need the logprobs from before the first.
            old = self.compute_logprobs(self.policy, batch, everything)
        # Otherwise the step is exactly on-policy: the training forward's own logprobs, detached, are the old
        # ones (``_loss_fn``), which saves a forward pass over every token.
        if self.reference is not None and not self.kl_in_reward:
            ref = self.compute_logprobs(self.reference, batch, everything)
        batch = TrainingBatch(batch.samples, batch.advantages, old_logprobs=old, ref_logprobs=ref)
        sums: dict[str, float] = defaultdict(float)
        critic_sums: dict[str, float] = defaultdict(float)
        grad_norms, critic_norms = [], []
        first_forward, forward_diff = True, 0.0  # engine/policy agreement, from the first (pre-update) forward
        optimizer = self.optimizers()
        shuffle = torch.Generator().manual_seed(self.seed * 1_000_003 + self.trainer.global_step)
        for _ in range(self.ppo_epochs):
            order = torch.randperm(len(batch), generator=shuffle).tolist()
            for part in mini_batch_slices(len(order), self.mini_batches):
                optimizer.zero_grad()
                mbs = self.microbatches(batch, order[part])
                trained = trained + microbatch_work(mbs)
                with wire.category("gradients"):  # Megatron's DDP reduces the gradients at the schedule's end
                    outputs = self.policy.forward_backward(mbs, self._loss_fn, forward_only=False)
                for out in outputs:
                    add_metric_sums(sums, out["metrics"])
                    if first_forward:
                        forward_diff = max(forward_diff, float(out["logprob_diff_max"]))
                first_forward = False
                check_finite(outputs, self.trainer.global_step, group=controller.group)
                step = self.trainer.global_step
                self.partial_update = True  # until the last optimizer step of this RL step is taken
                with wire.category("gradients"):  # the distributed optimizer all-gathers the parameters
                    optimizer.step()
                grad_norms.append(optimizer.last_grad_norm)
                if self.critic_model is not None:
                    critic_norms.append(self.critic.step(self.critic_model, mbs, step, critic_sums, group=controller.group))
        self.partial_update = False
        if self.balancer is not None:  # what this rank computed, without waiting for its peers
            self.balancer.measured(trained, time.perf_counter() - started - (self._grad_sync_seconds() - synced))
        stats = reduce_token_metrics(controller, sums, self.token_metrics)
        stats["grad_norm"] = sum(grad_norms) / len(grad_norms)
        if self.critic_model is not None:
            stats.update(reduce_token_metrics(controller, critic_sums, CRITIC_METRICS))
            stats["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
        stats["logprob_diff_max"] = (
            max_abs_difference(old, batch.samples.rollout_logprobs) if old is not None else forward_diff
        )
        return {**stats, **self.policy.take_moe_figures(), **figures}


    def loss(self, logprobs, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss ``[b, s-1]`` and per-token metrics for one micro-batch."""
        advantages = mb.advantages
        advantages = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
        per_token, metrics = self.algorithm(logprobs, mb.old_logprobs, advantages, mb.loss_mask)
        if self.off_policy_correction is not None:
            weight, more = self.off_policy_correction(mb.old_logprobs, mb.rollout_logprobs)
            per_token = per_token * weight
            metrics.update(more)
        metrics = {"pg_loss": per_token.detach(), **metrics}
        if self.reference is not None and not self.kl_in_reward:
            kl = self.kl_estimator(logprobs, mb.ref_logprobs)
            per_token = per_token + self.kl_coef * kl
            metrics["kl"] = kl.detach()
        return per_token, metrics


    # ------------------------------------------------------------------ internals
    def _loss_fn(self, mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logits = logits[:, :-1]
        logprobs = token_logprobs(logits, mb.input_ids[:, 1:], self.sampling.temperature)
        mask = mb.loss_mask
        if mb.old_logprobs is None:  # on-policy: the behaviour policy is the current one
            mb = mb.replace(old_logprobs=logprobs.detach())
        diff = ((logprobs.detach() - mb.rollout_logprobs).abs() * mask).max() if mask.any() else torch.zeros(())
        per_token, metrics = self.loss(logprobs, mb)
        metrics["entropy"] = token_entropy(logits, self.sampling.temperature)
        weights, count = self.loss_aggregation.weights(mask, self.sampling.max_new_tokens)
        loss_sum = (per_token * weights).sum()
        sums = {"tokens": mask.sum()}  # each metric's sum over the loss tokens, by name
        sums.update({k: (metrics[k] * mask).sum() if k in metrics else torch.zeros(()) for k in self.token_metrics})
        finite = torch.isfinite(loss_sum)
        if not finite:  # keep the schedule going so every rank reaches the check after it
            loss_sum = torch.nan_to_num(loss_sum) * 0
        metrics_out = {k: v.detach().float() for k, v in sums.items()}
        return loss_sum, count, {"metrics": metrics_out, "finite": finite, "logprob_diff_max": diff}

    def _grad_sync_seconds(self) -> float:
        """Seconds the policy and the critic have waited in their gradient synchronisation so far."""
        return sum(m.grad_sync_seconds for m in (self.policy, self.critic_model) if m is not None)

    def compute_logprobs(self, model, batch: TrainingBatch, indices: list[int]) -> list[torch.Tensor] | None:
        """Per-sample logprobs of the completion tokens under ``model`` (forward only; ``None`` on pipeline
        stages other than the last)."""
        return sample_logprobs(model, self.microbatches(batch, indices), len(batch), self.sampling.temperature)

    def microbatches(self, batch: TrainingBatch, indices: list[int]) -> list[MicroBatch]:
        """Micro-batches of ``micro_batch_size`` samples, or under the load balancer's token budget."""
        budget = getattr(self.balancer, "max_tokens_per_micro_batch", None)
        overhead = getattr(self.balancer, "micro_batch_overhead_tokens", 0)
        plan = batch.plan_by_tokens(indices, budget, overhead) if budget else None
        pixels = self.images.pixels if self.images is not None else None
        return batch.microbatches(indices, self.micro_batch_size, self.tokenizer.pad_token_id, plan=plan, pixels=pixels)
