"""RLHFModule: one RL step as four overridable calls -- rollout, reward, advantage, update.

Subclass and override any of them (or the smaller hooks they call: ``tokenize_prompt``,
``sample_seeds``, ``advantage_inputs``, ``loss``). Orchestration (the engine, weight sync, placement)
lives in the strategy; this module reads like the algorithm. With the defaults it is GRPO: n samples per
prompt, group-normalised advantages, PPO-clip with token-level aggregation, optional k3 KL to a frozen
reference. The algorithm library (:mod:`yatt_lightning.algorithms`) swaps each part by ``class_path``:
RLOO, REINFORCE++, GAE with a critic (PPO), DAPO's clip-higher and overlong shaping, GSPO, Dr. GRPO.
"""

from __future__ import annotations

import time
from collections import defaultdict

import lightning.pytorch as pl
import torch
from jsonargparse import lazy_instance
from typing_extensions import override

from yatt_lightning.algorithms import K3, AdvantageEstimator, GRPOAdvantage, KLEstimator, PolicyLoss, PPOClipLoss
from yatt_lightning.algorithms.advantage import AdvantageInputs, Advantages
from yatt_lightning.algorithms.aggregation import LossAggregation, TokenMean
from yatt_lightning.algorithms.off_policy import OffPolicyCorrection
from yatt_lightning.algorithms.overlong import RewardShaping
from yatt_lightning.callbacks.step_logger import StepLogger
from yatt_lightning.chat import PromptFormat
from yatt_lightning.distributed import wire
from yatt_lightning.distributed.failures import NonFiniteLossError, RankFailure, check_finite, fail_together  # noqa: F401
from yatt_lightning.distributed.seeding import resolve_seed, sampling_seed
from yatt_lightning.models.logprobs import (
    max_abs_difference,
    sample_logprobs,
    share_with_pipeline,
    token_entropy,
    token_logprobs,
)  # fmt: skip
from yatt_lightning.models.spec import ModelSpec
from yatt_lightning.multimodal.image_inputs import ImageInputs
from yatt_lightning.rewards.base import RewardFunction, RuleReward
from yatt_lightning.rollout.base import SamplingConfig
from yatt_lightning.rollout.batch import RolloutBatch, mini_batch_slices  # noqa: F401 (mini_batch_slices: public here too)
from yatt_lightning.rollout.dynamic_sampling import DynamicSampling
from yatt_lightning.rollout.longtail import LongTailPolicy, WaitForAll
from yatt_lightning.rollout.service import EngineSpec, RolloutRequest, RolloutSetup, Scores
from yatt_lightning.training.batch import TrainingBatch
from yatt_lightning.training.critic import CRITIC_METRICS, Critic, sample_values
from yatt_lightning.training.optim import OptimizerSettings
from yatt_lightning.training.optimizer_adapter import MegatronOptimizerAdapter
from yatt_lightning.training.step_metrics import reduce_token_metrics, step_stats

# Per-token quantities summed in the loss function and averaged over tokens for logging (the algorithm's
# parts may add their own, named with a "/": see ``RLHFModule.token_metrics``).
_TOKEN_METRICS = ("pg_loss", "clip_fraction", "kl", "entropy", "ratio")


class RLHFModule(pl.LightningModule):
    """GRPO-style RL post-training of a Megatron-Core policy.

    Args:
        policy: The model to train (a Hugging Face folder, loaded into Megatron-Core).
        reward_fn: Dotted import path of ``f(prompt: str, completion: str, **row) -> float``; the row's
            other fields (e.g. ``answer``) arrive as keyword arguments. Ignored when ``rewards`` is set.
        rewards: Reward functions whose weighted scores are summed (rule functions, reward models,
            generative reward models); ``None`` uses ``reward_fn`` alone.
        sampling: How completions are sampled (``n`` is the GRPO group size).
        algorithm: The policy loss (``class_path`` selects it; default PPO-clip; GSPO).
        advantage_estimator: Turns rewards into advantages (default GRPO group normalisation; RLOO,
            REINFORCE++, GAE with ``critic``).
        critic: PPO's value model, trained with the policy (needed by GAE; ``None`` builds none).
        loss_aggregation: How per-token losses are averaged: over tokens (default), per sequence, or
            with Dr. GRPO's constant.
        off_policy_correction: Reweights each token by the training policy's ratio to the engine's
            sampling probability (truncated importance sampling); ``None``: none.
        kl_coef: Weight of the KL penalty to the frozen initial policy; 0 builds no reference model.
        kl_estimator: Per-token KL estimator (k1, k2, default k3).
        kl_in_reward: Subtract ``kl_coef x KL`` from each token's reward (before the advantage) instead of
            adding it to the loss.
        reward_shaping: Added to every sample's reward (DAPO's overlong penalty); ``None``: none.
        optimizer: Optimizer settings.
        ppo_epochs: Passes over each rollout batch.
        mini_batches: Optimizer steps per pass (the rollout batch is split into this many parts of sizes
            differing by one at most; fewer when a step has fewer samples).
        micro_batch_size: Sequences per forward/backward micro-batch.
        max_prompt_tokens: Longest prompt accepted, in tokens; a longer one is an error naming its row.
        apply_chat_template: Wrap each prompt in the model's chat template when it has one (see
            :mod:`yatt_lightning.chat`: system prompts, rows that are chat messages).
        system_prompt: A system message put in front of every prompt (not where a row's messages start
            with their own); needs a chat template.
        log_samples: Completions written to TensorBoard as text every ``log_every_n_steps``.
        dynamic_sampling: Drop groups whose rewards are all equal and generate more rounds until enough
            groups remain (DAPO); ``None`` trains on every group.
        long_tail: How long responses are handled: wait for all (default), over-provision, or partial
            rollout (see :mod:`yatt_lightning.rollout.longtail`, including the bias each introduces).
        seed: Seed of sampling and of mini-batch shuffling; ``None`` follows ``seed_everything``.
    """

    def __init__(
        self,
        policy: ModelSpec = ModelSpec(),
        reward_fn: str = "yatt_lightning.rewards.rules.alphabet_reward",
        rewards: list[RewardFunction] | None = None,
        sampling: SamplingConfig = SamplingConfig(),
        algorithm: PolicyLoss = lazy_instance(PPOClipLoss),
        advantage_estimator: AdvantageEstimator = lazy_instance(GRPOAdvantage),
        critic: Critic | None = None,
        loss_aggregation: LossAggregation = lazy_instance(TokenMean),
        off_policy_correction: OffPolicyCorrection | None = None,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = lazy_instance(K3),
        kl_in_reward: bool = False,
        reward_shaping: RewardShaping | None = None,
        optimizer: OptimizerSettings = OptimizerSettings(),
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        micro_batch_size: int = 32,
        max_prompt_tokens: int = 128,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        log_samples: int = 4,
        dynamic_sampling: DynamicSampling | None = None,
        long_tail: LongTailPolicy = lazy_instance(WaitForAll),
        seed: int | None = None,
    ) -> None:
        super().__init__()
        for key, value, low in (
            ("ppo_epochs", ppo_epochs, 1),
            ("mini_batches", mini_batches, 1),
            ("micro_batch_size", micro_batch_size, 1),
            ("max_prompt_tokens", max_prompt_tokens, 1),
            ("log_samples", log_samples, 0),
        ):
            if value < low:
                raise ValueError(f"`model.{key}` must be >= {low}, got {value}.")
        if kl_coef < 0:
            raise ValueError(f"`model.kl_coef` must be >= 0, got {kl_coef}.")
        if advantage_estimator.group_baseline and sampling.n < 2:
            raise ValueError(
                f"`model.sampling.n`={sampling.n} with `model.advantage_estimator` "
                f"{type(advantage_estimator).__name__}: a group of one sample has advantage 0, so nothing would "
                "be learned; set `model.sampling.n` >= 2 (GRPO uses 4-16)."
            )
        if advantage_estimator.needs_critic and critic is None:
            raise ValueError(
                f"`model.advantage_estimator` {type(advantage_estimator).__name__} uses a critic's values, but "
                "`model.critic` is not set; set `model.critic: {}` (PPO) or choose an estimator without one."
            )
        if critic is not None and not advantage_estimator.needs_critic:
            raise ValueError(
                f"`model.critic` is set, but `model.advantage_estimator` {type(advantage_estimator).__name__} does "
                "not use its values (it would be trained for nothing); use GAE or remove `model.critic`."
            )
        if kl_in_reward and kl_coef == 0:
            raise ValueError("`model.kl_in_reward` is true but `model.kl_coef` is 0: set a coefficient > 0.")
        self.automatic_optimization = False
        self.policy_spec = policy
        self.reward_functions = list(rewards) if rewards else [RuleReward(reward_fn)]
        names = [fn.name for fn in self.reward_functions]
        if len(set(names)) != len(names):
            raise ValueError(f"`model.rewards`: two reward functions share a name ({names}); rename one.")
        self.dynamic_sampling = dynamic_sampling
        self.long_tail = long_tail
        self.sampling = sampling
        self.algorithm = algorithm
        self.advantage_estimator = advantage_estimator
        self.critic = critic
        self.loss_aggregation = loss_aggregation
        self.off_policy_correction = off_policy_correction
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.kl_in_reward = kl_in_reward
        self.reward_shaping = reward_shaping
        correction = off_policy_correction.metric_names if off_policy_correction is not None else ()
        self.token_metrics = _TOKEN_METRICS + algorithm.extra_metrics + correction
        self.optimizer_settings = optimizer
        self.ppo_epochs = ppo_epochs
        self.mini_batches = mini_batches
        self.micro_batch_size = micro_batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.log_samples = log_samples
        self.seed = resolve_seed(seed)
        self.policy = None
        self.reference = None
        self.critic_model = None
        self.tokenizer = None
        self.prompt_format: PromptFormat | None = None
        self.last_rollouts: RolloutBatch | None = None
        self.images: ImageInputs | None = None  # a vision-language policy's image tokens and pixels
        self.balancer = None  # set by callbacks.DPLoadBalancer
        self.partial_update = False  # True between the first and last optimizer step of an RL step
        self.phase_times: dict[str, float] = {}
        self.reward_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ building
    @override
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from transformers import AutoTokenizer

        from yatt_lightning.models.policy import MegatronPolicy

        path = self.policy_spec.resolve()
        self.model_path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.prompt_format = self.prompt_format_for(path, self.tokenizer)
        dtype = self.policy_spec.torch_dtype()
        self.policy = MegatronPolicy(path, params_dtype=dtype, optimizer=self.optimizer_settings, seed=self.seed)
        if self.kl_coef > 0:
            self.reference = MegatronPolicy(path, params_dtype=dtype, optimizer=None, seed=self.seed)
        if self.critic is not None:
            self.critic_model = self.critic.build(path, dtype, self.seed)
        self.images = ImageInputs(path) if self.policy.vision_language else None
        self.trainer.strategy.rollout.configure(self._rollout_setup())

    @override
    def configure_callbacks(self) -> list:
        return [StepLogger()]  # writes the StepStats each training_step returns

    @override
    def setup(self, stage: str) -> None:
        # The step's metrics are logged before any other callback's on_train_batch_end reads them.
        callbacks = self.trainer.callbacks
        first = [cb for cb in callbacks if isinstance(cb, StepLogger)]
        callbacks[:] = first + [cb for cb in callbacks if not isinstance(cb, StepLogger)]

    @override
    def configure_optimizers(self) -> MegatronOptimizerAdapter:
        return MegatronOptimizerAdapter(self.policy, step_index=lambda: self.trainer.global_step)

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Rollouts waiting across steps (dynamic sampling's buffer, partial rollouts) resume with the run.
        for key, part in (("dynamic_sampling", self.dynamic_sampling), ("long_tail", self.long_tail)):
            if hasattr(part, "state_dict"):
                checkpoint[f"yatt_{key}"] = part.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        for key, part in (("dynamic_sampling", self.dynamic_sampling), ("long_tail", self.long_tail)):
            if hasattr(part, "load_state_dict") and f"yatt_{key}" in checkpoint:
                part.load_state_dict(checkpoint[f"yatt_{key}"])

    def _rollout_setup(self) -> RolloutSetup:
        """What the strategy's rollout service needs of this module, handed down once."""
        datamodule = self.trainer.datamodule
        seqs = max(1, datamodule.batch_size * self.sampling.n) if datamodule is not None else 256
        dtype = str(self.policy_spec.torch_dtype()).removeprefix("torch.")
        engine = EngineSpec(
            self.model_path, self.seed, seqs, self.max_prompt_tokens + self.sampling.max_new_tokens, dtype
        )
        return RolloutSetup(
            self.policy, self.tokenizer, engine, self.reward_functions, self.long_tail, self.seed, self.critic_model
        )

    # ------------------------------------------------------------------ the RL step
    @override
    def training_step(self, batch: list[dict], batch_idx: int) -> dict | None:
        strategy = self.trainer.strategy
        t0 = time.perf_counter()
        error, rollouts, t1 = None, None, t0
        try:
            rollouts = self.rollout(batch)
            t1 = time.perf_counter()
            if len(rollouts):  # partial rollout: no group may have finished on some rank this step
                scores = self.reward(rollouts)
                scores = scores if isinstance(scores, Scores) else Scores(torch.as_tensor(scores), {})
                rollouts = rollouts.scored(scores.total, scores.token_rewards)
        except Exception as err:  # every rank must learn of it, or the others hang in the next collective
            if isinstance(err, RankFailure) and err.agreed:
                raise  # already collective: every rank raises it at the same point
            error = err
        strategy.finish_scoring(error)
        t2 = time.perf_counter()
        if len(rollouts) == 0:
            self.commit_step_state()
            return None
        figures = dict(rollouts.metrics)  # the components' own figures of the step, logged as named
        train_on: RolloutBatch | None = rollouts
        if self.dynamic_sampling is not None:
            sampled = self.dynamic_sampling.step(rollouts, strategy.all_reduce_min_max)
            train_on = sampled.batch
            figures.update(sampled.metrics)
        stats = None
        if train_on is not None:
            inputs, kl_figures = self.advantage_inputs(train_on)
            figures.update(kl_figures)
            advantages = Advantages.of(self.advantage(train_on, inputs), len(train_on))
            stats = self.update(train_on, advantages)
        t3 = time.perf_counter()
        sync = strategy.rollout.sync_seconds
        self.phase_times = {"rollout": t1 - t0 - sync, "sync": sync, "reward": t2 - t1, "train": t3 - t2, "step": t3 - t0}  # fmt: skip
        self.commit_step_state()
        self.last_rollouts = rollouts
        summary = step_stats(self, rollouts, stats, figures)
        self.reward_metrics = {}
        return {"reward_mean": float(rollouts.rewards.mean()), "stats": summary}

    def rollout(self, batch: list[dict]) -> RolloutBatch:
        """Sample ``sampling.n`` completions for each prompt of this rank's batch (the groups the long-tail
        policy keeps), through the strategy's rollout service."""
        request = RolloutRequest(
            rows=batch, prompt_ids=self.tokenize_batch(batch), seeds=self.sample_seeds(batch),
            sampling=self.sampling, step=self.trainer.global_step,
            weights_version=self.trainer.global_step,  # changes with every optimizer step, as the weights do
        )  # fmt: skip
        return self.trainer.strategy.rollout.rollout(request)

    def reward(self, rollouts: RolloutBatch) -> Scores:
        """The rewards of the samples: the weighted sum of the reward functions (and their per-token
        rewards), computed where the rollouts live (see the controller and placement), plus the reward
        shaping. An override may return a plain ``[N]`` tensor."""
        scores = self.trainer.strategy.rollout.score(rollouts)
        for key, value in scores.metrics.items():
            self.reward_metrics[key] = self.reward_metrics.get(key, 0.0) + value
        total = scores.total
        if self.reward_shaping is not None:
            shaped = self.reward_shaping(rollouts.response_lengths(), self.sampling.max_new_tokens)
            key = "reward/shaping/sum"
            self.reward_metrics[key] = self.reward_metrics.get(key, 0.0) + float(shaped.sum())
            total = total + shaped
        return Scores(total, scores.metrics, scores.token_rewards)

    def advantage_inputs(self, rollouts: RolloutBatch) -> tuple[AdvantageInputs, dict[str, float]]:
        """What the estimator uses: the rewards, the per-token rewards (with ``kl_in_reward`` the KL
        penalty, from the engine's logprobs of the sampled tokens against the reference's), and the
        critic's values; and the KL's figures. Collective (the reference's and the critic's forwards)."""
        self.trainer.strategy.rollout.prepare_training()
        batch, everything, figures = TrainingBatch(rollouts), list(range(len(rollouts))), {}
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

    def advantage(self, rollouts: RolloutBatch, inputs: AdvantageInputs) -> Advantages:
        """The advantages of the samples (an override may return a plain ``[N]`` tensor)."""
        return self.advantage_estimator(inputs)

    def update(self, rollouts: RolloutBatch, advantages: Advantages) -> dict[str, float]:
        """Policy update: ``ppo_epochs`` passes of ``mini_batches`` optimizer steps over the scored rollouts.
        Returns the update's figures: the token means of :data:`_TOKEN_METRICS`, ``grad_norm`` and
        ``logprob_diff_max`` (logged as ``actor/...``), and the load balancer's, logged under their names."""
        self.trainer.strategy.rollout.prepare_training()
        batch, figures = TrainingBatch(rollouts, advantages), {}
        if self.balancer is not None:
            with wire.category("rollout"):
                rebalanced = self.balancer.rebalance(self, batch)
            batch, figures = rebalanced.batch, rebalanced.metrics
        everything = list(range(len(batch)))
        old = ref = None
        if self.ppo_epochs * len(mini_batch_slices(len(batch), self.mini_batches)) > 1:
            # More than one optimizer step per rollout batch: later ones need the logprobs from before the first.
            old = self.compute_logprobs(self.policy, batch, everything)
        # Otherwise the step is exactly on-policy: the training forward's own logprobs, detached, are the old
        # ones (``_loss_fn``), which saves a forward pass over every token.
        if self.reference is not None and not self.kl_in_reward:
            ref = self.compute_logprobs(self.reference, batch, everything)
        batch = TrainingBatch(batch.rollouts, batch.advantages, old_logprobs=old, ref_logprobs=ref)
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
                with wire.category("gradients"):  # Megatron's DDP reduces the gradients at the schedule's end
                    outputs = self.policy.forward_backward(mbs, self._loss_fn, forward_only=False)
                for out in outputs:
                    for key, value in zip(("tokens", *self.token_metrics), out["metrics"].tolist(), strict=True):
                        sums[key] += value
                    if first_forward:
                        forward_diff = max(forward_diff, float(out["logprob_diff_max"]))
                first_forward = False
                check_finite(outputs, self.trainer.global_step)
                step = self.trainer.global_step
                self.partial_update = True  # until the last optimizer step of this RL step is taken
                with wire.category("gradients"):  # the distributed optimizer all-gathers the parameters
                    optimizer.step()
                grad_norms.append(optimizer.last_grad_norm)
                if self.critic_model is not None:
                    critic_norms.append(self.critic.step(self.critic_model, mbs, step, critic_sums))
        self.partial_update = False
        controller = self.trainer.strategy.controller
        stats = reduce_token_metrics(controller, sums, self.token_metrics)
        stats["grad_norm"] = sum(grad_norms) / len(grad_norms)
        if self.critic_model is not None:
            stats.update(reduce_token_metrics(controller, critic_sums, CRITIC_METRICS))
            stats["critic/grad_norm"] = sum(critic_norms) / len(critic_norms)
        stats["logprob_diff_max"] = (
            max_abs_difference(old, batch.rollouts.rollout_logprobs) if old is not None else forward_diff
        )
        return {**stats, **figures}

    def commit_step_state(self) -> None:
        """The step's rollouts are consumed: rollouts waiting across steps (dynamic sampling's buffer,
        partial rollouts) take their new state. Until then a checkpoint (one saved after a failure in the
        step, say) holds the state from before the step."""
        for part in (self.dynamic_sampling, self.long_tail):
            if hasattr(part, "commit"):
                part.commit()

    def tokenize_batch(self, batch: list[dict]) -> list[list[int]]:
        """Prompt token ids of this rank's rows. Collective: a prompt that fails to tokenize (too long, say)
        on one rank raises on every rank, before any rank enters the rollout's collectives."""
        with fail_together():
            return [self.tokenize_prompt(row) for row in batch]

    # ------------------------------------------------------------------ hooks
    def prompt_format_for(self, path, tokenizer) -> PromptFormat:
        """How this module's rows become prompt ids for the model folder ``path`` (also used by preflight)."""
        return PromptFormat.of(
            path, tokenizer, apply_chat_template=self.apply_chat_template, system_prompt=self.system_prompt
        )

    def tokenize_prompt(self, row: dict) -> list[int]:
        """The row's prompt ids (:mod:`yatt_lightning.chat`), image tokens expanded to the model's count."""
        ids = self.prompt_format.ids(row)
        ids = self.images.expand(ids) if self.images is not None else ids
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(
                f"prompt of {len(ids)} tokens ({row.get('_source', 'built-in task')}) is longer than "
                f"`model.max_prompt_tokens`={self.max_prompt_tokens}; raise it or shorten the prompt."
            )
        return ids

    def sample_seeds(self, batch: list[dict]) -> list[int]:
        """A sampling seed per prompt, fixed by (seed, step, row): a resumed run samples the same."""
        step = self.trainer.global_step
        return [sampling_seed(self.seed, step, row, i) for i, row in enumerate(batch)]

    def loss(self, logprobs, mb: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss ``[b, s-1]`` and per-token metrics for one micro-batch."""
        advantages = mb["advantages"]
        advantages = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
        per_token, metrics = self.algorithm(logprobs, mb["old_logprobs"], advantages, mb["loss_mask"])
        if self.off_policy_correction is not None:
            weight, more = self.off_policy_correction(mb["old_logprobs"], mb["rollout_logprobs"])
            per_token = per_token * weight
            metrics.update(more)
        metrics = {"pg_loss": per_token.detach(), **metrics}
        if self.reference is not None and not self.kl_in_reward:
            kl = self.kl_estimator(logprobs, mb["ref_logprobs"])
            per_token = per_token + self.kl_coef * kl
            metrics["kl"] = kl.detach()
        return per_token, metrics

    # ------------------------------------------------------------------ internals
    def _loss_fn(self, mb: dict, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logits = logits[:, :-1]
        logprobs = token_logprobs(logits, mb["input_ids"][:, 1:], self.sampling.temperature)
        mask = mb["loss_mask"]
        if "old_logprobs" not in mb:  # on-policy: the behaviour policy is the current one
            mb = {**mb, "old_logprobs": logprobs.detach()}
        diff = ((logprobs.detach() - mb["rollout_logprobs"]).abs() * mask).max() if mask.any() else torch.zeros(())
        per_token, metrics = self.loss(logprobs, mb)
        metrics["entropy"] = token_entropy(logits, self.sampling.temperature)
        weights, count = self.loss_aggregation.weights(mask, self.sampling.max_new_tokens)
        loss_sum = (per_token * weights).sum()
        row = [mask.sum()] + [
            (metrics[k] * mask).sum() if k in metrics else torch.zeros(()) for k in self.token_metrics
        ]
        finite = torch.isfinite(loss_sum)
        if not finite:  # keep the schedule going so every rank reaches the check after it
            loss_sum = torch.nan_to_num(loss_sum) * 0
        return (
            loss_sum,
            count,
            {
                "metrics": torch.stack([v.detach().float() for v in row]),
                "finite": finite,
                "logprob_diff_max": diff,
            },
        )

    def compute_logprobs(self, model, batch: TrainingBatch, indices: list[int]) -> list[torch.Tensor] | None:
        """Per-sample logprobs of the completion tokens under ``model`` (forward only; ``None`` on pipeline
        stages other than the last)."""
        return sample_logprobs(model, self.microbatches(batch, indices), len(batch), self.sampling.temperature)

    def microbatches(self, batch: TrainingBatch, indices: list[int]) -> list[dict]:
        """Micro-batches of ``micro_batch_size`` samples, or under the load balancer's token budget."""
        budget = getattr(self.balancer, "max_tokens_per_micro_batch", None)
        overhead = getattr(self.balancer, "micro_batch_overhead_tokens", 0)
        plan = batch.plan_by_tokens(indices, budget, overhead) if budget else None
        pixels = self.images.pixels if self.images is not None else None
        return batch.microbatches(indices, self.micro_batch_size, self.tokenizer.pad_token_id, plan=plan, pixels=pixels)
