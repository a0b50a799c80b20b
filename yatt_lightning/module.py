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

import lightning.pytorch as pl
import torch
from typing_extensions import override

from yatt_lightning.agents import Agent, EnvironmentReward
from yatt_lightning.algorithms import K3, AdvantageEstimator, GRPOAdvantage, KLEstimator, PolicyLoss, PPOClipLoss
from yatt_lightning.algorithms.advantage import AdvantageInputs, Advantages
from yatt_lightning.algorithms.aggregation import LossAggregation, TokenMean
from yatt_lightning.algorithms.off_policy import OffPolicyCorrection
from yatt_lightning.algorithms.overlong import RewardShaping
from yatt_lightning.callbacks.step_logger import StepLogger
from yatt_lightning.chat import PromptFormat
from yatt_lightning.checkpoint.model_source import ModelSpec, policy_tokenizer
from yatt_lightning.distributed.failures import NonFiniteLossError, RankFailure, check_finite, fail_together  # noqa: F401
from yatt_lightning.distributed.seeding import resolve_seed
from yatt_lightning.engines.base import SamplingConfig
from yatt_lightning.lazy_defaults import lazy_default
from yatt_lightning.models.lora import LoRASettings
from yatt_lightning.models.optim import OptimizerSettings
from yatt_lightning.multimodal.image_inputs import ImageInputs
from yatt_lightning.rewards.base import RewardFunction, RuleReward
from yatt_lightning.rollout.batch import RolloutBatch, mini_batch_slices  # noqa: F401 (mini_batch_slices: public here too)
from yatt_lightning.rollout.dynamic_sampling import DynamicSampling
from yatt_lightning.rollout.longtail import LongTailPolicy, WaitForAll
from yatt_lightning.rollout.types import EngineSpec, RolloutRequest, RolloutSetup, Scores
from yatt_lightning.training.async_steps import AsyncSteps, StepCounter
from yatt_lightning.training.critic import Critic
from yatt_lightning.training.optimizer_adapter import MegatronOptimizerAdapter
from yatt_lightning.training.prompts import Prompts
from yatt_lightning.training.step_metrics import StepContext, step_stats
from yatt_lightning.training.update import PolicyUpdate
from yatt_lightning.training.validation import Validating, Validation

ALPHABET = "yatt_lightning.rewards.rules.alphabet_reward"  # the default reward (not an agent's)

# Per-token quantities summed in the loss function and averaged over tokens for logging (the algorithm's
# parts may add their own, named with a "/": see ``RLHFModule.token_metrics``).
_TOKEN_METRICS = ("pg_loss", "clip_fraction", "kl", "entropy", "ratio")


class RLHFModule(Prompts, PolicyUpdate, AsyncSteps, Validating, pl.LightningModule):
    """GRPO-style RL post-training of a Megatron-Core policy.

    Args:
        policy: The model to train (a Hugging Face folder, loaded into Megatron-Core).
        reward_fn: Dotted import path of ``f(prompt: str, completion: str, **row) -> float``; the row's
            other fields (e.g. ``answer``) arrive as keyword arguments. Ignored when ``rewards`` is set (and
            its default, the alphabet task's, with ``agent``).
        rewards: Reward functions whose weighted scores are summed (rule functions, reward models,
            generative reward models); ``None`` uses ``reward_fn`` alone.
        reward_timeout_s: The longest one call into a reward function may take (a rule function's call
            on one sample; a reward model's or judge's on a batch) where the function sets no ``timeout_s``
            of its own; past it the call fails as the function's ``on_error`` says. ``None``: no deadline.
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
        agent: Multi-turn episodes in an environment (tools, games) instead of one completion per sample
            (:class:`~yatt_lightning.agents.Agent`); the environment's rewards are added as ``environment``.
        lora: Train LoRA adapters on the frozen policy (:class:`~yatt_lightning.models.lora.LoRASettings`);
            the engine receives only the adapter after each step (or, with ``merge``, merged weights).
        validation: How the held-out prompts (``data.val_path`` / ``data.val_task``) are sampled and judged,
            before training and every ``trainer.val_check_interval`` (:mod:`yatt_lightning.training.validation`).
    """

    def __init__(
        self,
        policy: ModelSpec = ModelSpec(),
        reward_fn: str = ALPHABET,
        rewards: list[RewardFunction] | None = None,
        reward_timeout_s: float | None = 300.0,
        sampling: SamplingConfig = SamplingConfig(),
        algorithm: PolicyLoss = lazy_default(PPOClipLoss),
        advantage_estimator: AdvantageEstimator = lazy_default(GRPOAdvantage),
        critic: Critic | None = None,
        loss_aggregation: LossAggregation = lazy_default(TokenMean),
        off_policy_correction: OffPolicyCorrection | None = None,
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = lazy_default(K3),
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
        long_tail: LongTailPolicy = lazy_default(WaitForAll),
        seed: int | None = None,
        agent: Agent | None = None,
        lora: LoRASettings | None = None,
        validation: Validation = lazy_default(Validation),
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
        if reward_timeout_s is not None and reward_timeout_s <= 0:
            raise ValueError(f"`model.reward_timeout_s` must be > 0 (or null for no deadline), got {reward_timeout_s}.")
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
        self.policy_spec, self.lora = policy, lora
        rule = [] if agent is not None and reward_fn == ALPHABET else [RuleReward(reward_fn)]  # an agent's: its environment's
        self.reward_functions = list(rewards) if rewards else rule
        if agent is not None and not any(isinstance(fn, EnvironmentReward) for fn in self.reward_functions):
            self.reward_functions.append(EnvironmentReward())  # the turns' rewards, on their last tokens
        self.agent = agent
        for fn in self.reward_functions:
            fn.set_default_timeout(reward_timeout_s, "model.reward_timeout_s")
        names = [fn.name for fn in self.reward_functions]
        if len(set(names)) != len(names):
            raise ValueError(f"`model.rewards`: two reward functions share a name ({names}); rename one.")
        self.dynamic_sampling, self.long_tail, self.sampling = dynamic_sampling, long_tail, sampling
        self.algorithm, self.advantage_estimator, self.critic = algorithm, advantage_estimator, critic
        self.loss_aggregation, self.off_policy_correction = loss_aggregation, off_policy_correction
        self.kl_coef, self.kl_estimator, self.kl_in_reward = kl_coef, kl_estimator, kl_in_reward
        self.reward_shaping, self.validation, self.val_tally = reward_shaping, validation, None
        self.checkpoint_step: int | None = None
        correction = off_policy_correction.metric_names if off_policy_correction is not None else ()
        self.token_metrics = _TOKEN_METRICS + algorithm.extra_metrics + correction
        self.optimizer_settings = optimizer
        self.ppo_epochs, self.mini_batches, self.micro_batch_size = ppo_epochs, mini_batches, micro_batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.apply_chat_template, self.system_prompt = apply_chat_template, system_prompt
        self.log_samples = log_samples
        self.seed = resolve_seed(seed)
        self.policy, self.reference, self.critic_model, self.tokenizer = None, None, None, None
        self.prompt_format: PromptFormat | None = None
        self.last_rollouts: RolloutBatch | None = None
        self.images: ImageInputs | None = None  # a vision-language policy's image tokens and pixels
        self.balancer = None  # set by callbacks.DPLoadBalancer
        self.partial_update = False  # True between the first and last optimizer step of an RL step

    # ------------------------------------------------------------------ building
    @override
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from yatt_lightning.models.policy import MegatronPolicy

        path = self.policy_spec.resolve()
        self.model_path = path
        self.tokenizer = policy_tokenizer(path)
        self.prompt_format = self.prompt_format_for(path, self.tokenizer)
        if self.agent is not None:
            self.agent.configure(self.tokenizer, self.apply_chat_template, path, self.max_prompt_tokens)
        if self.trainer.strategy.role.only_rolls_out:  # no Megatron model here
            self.check_disaggregated(self.trainer.strategy.placement)
            from transformers import AutoConfig

            from yatt_lightning.models import vlm

            self.images = ImageInputs(path) if vlm.is_vision_language(AutoConfig.from_pretrained(path)) else None
            self.trainer.strategy.rollout.configure(self._rollout_setup())
            return
        dtype = self.policy_spec.torch_dtype()
        publishes = self.trainer.strategy.role.only_trains  # sends its parameters as they are
        self.policy = MegatronPolicy(path, params_dtype=dtype, optimizer=self.optimizer_settings, seed=self.seed,
                                     one_storage=publishes, lora=self.lora)  # fmt: skip
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
    def configure_optimizers(self) -> MegatronOptimizerAdapter | StepCounter:
        if self.trainer.strategy.role.only_rolls_out:
            return StepCounter()
        if self.trainer.strategy.role.only_trains:
            self.check_disaggregated(self.trainer.strategy.placement)
        return MegatronOptimizerAdapter(self.policy, step_index=lambda: self.trainer.global_step)

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Rollouts waiting across steps (dynamic sampling's buffer, partial rollouts) resume with the run.
        placement = self.trainer.strategy.placement
        parts = (("dynamic_sampling", self.dynamic_sampling), ("long_tail", self.long_tail), ("placement", placement))
        for key, part in parts:
            if hasattr(part, "state_dict"):
                checkpoint[f"yatt_{key}"] = part.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.checkpoint_step = checkpoint.get("global_step")  # what `yatt validate` names its figures by
        placement = self.trainer.strategy.placement
        parts = (("dynamic_sampling", self.dynamic_sampling), ("long_tail", self.long_tail), ("placement", placement))
        for key, part in parts:
            if hasattr(part, "load_state_dict") and f"yatt_{key}" in checkpoint:
                part.load_state_dict(checkpoint[f"yatt_{key}"])

    def _rollout_setup(self) -> RolloutSetup:
        """What the strategy's rollout service needs of this module, handed down once."""
        datamodule = self.trainer.datamodule
        seqs = max(1, datamodule.batch_size * self.sampling.n) if datamodule is not None else 256
        dtype = str(self.policy_spec.torch_dtype()).removeprefix("torch.")
        longest = self.agent.max_total_tokens if self.agent else self.max_prompt_tokens + self.sampling.max_new_tokens
        lora_rank = self.lora.rank if self.lora is not None and not self.lora.merge else None  # the engine serves it
        engine = EngineSpec(self.model_path, self.seed, seqs, longest, dtype, lora_rank)
        return RolloutSetup(
            self.policy, self.tokenizer, engine, self.reward_functions, self.long_tail, self.seed, self.critic_model
        )

    # ------------------------------------------------------------------ the RL step
    @override
    def training_step(self, batch: list[dict], batch_idx: int) -> dict | None:
        strategy = self.trainer.strategy
        if strategy.role.only_rolls_out:
            return self.produce_step(batch)
        if strategy.role.only_trains:
            return self.consume_step(batch)
        t0 = time.perf_counter()
        error, rollouts, scores, t1 = None, None, None, t0
        try:
            strategy.enter_stage("rollout", self.trainer.global_step)
            rollouts = self.rollout(batch)
            t1 = time.perf_counter()
            if len(rollouts):  # partial rollout: no group may have finished on some rank this step
                strategy.enter_stage("reward", self.trainer.global_step)
                scores = Scores.of(self.reward(rollouts))
                rollouts = rollouts.scored(scores.total, scores.token_rewards)
        except Exception as err:  # every rank must learn of it, or the others hang in the next collective
            if isinstance(err, RankFailure) and err.agreed:
                raise  # already collective: every rank raises it at the same point
            error = err
        strategy.enter_stage("scored", self.trainer.global_step)
        waited = strategy.finish_scoring(error)
        t2 = time.perf_counter()
        if len(rollouts) == 0:
            self.commit_step_state()
            return None
        rank = {**rollouts.rank_figures, **scores.rank_figures}
        sync = rank.pop("sync", 0.0)
        rank["idle"] = rank.pop("idle", 0.0) + waited  # the placement's waiting and the end of scoring
        times = {"rollout": t1 - t0 - sync, "sync": sync, "reward": t2 - t1}
        return self.train_on(rollouts, scores.metrics, times, rank)

    def train_on(
        self, rollouts: RolloutBatch, reward_metrics: dict, times: dict, rank: dict, figures: dict | None = None
    ) -> dict:
        """Advantage and update on the scored ``rollouts`` (after dynamic sampling), and the step's figures:
        ``reward_metrics``: the scores' metrics; ``times``: the seconds of the rollout, sync and reward phases;
        ``rank``: this rank's own figures (idle seconds, memory); ``figures``: more, logged as named."""
        strategy = self.trainer.strategy
        t2 = time.perf_counter()
        figures = {**rollouts.metrics, **(figures or {})}  # the components' own figures, logged as named
        train_on: RolloutBatch | None = rollouts
        if self.dynamic_sampling is not None:
            sampled = self.dynamic_sampling.step(rollouts, strategy.all_reduce_min_max)
            train_on = sampled.batch
            figures.update(sampled.metrics)
        stats = None
        strategy.enter_stage("train", self.trainer.global_step)
        if train_on is not None:
            inputs, kl_figures = self.advantage_inputs(train_on)
            figures.update(kl_figures)
            advantages = Advantages.of(self.advantage(train_on, inputs), len(train_on))
            stats = self.update(train_on, advantages)
        train = time.perf_counter() - t2
        times = {**times, "train": train, "step": times["rollout"] + times["sync"] + times["reward"] + train}
        self.commit_step_state()
        self.last_rollouts = rollouts
        summary = step_stats(self.step_context(), rollouts, reward_metrics, stats, figures, times, rank)
        return {"reward_mean": float(rollouts.rewards.mean()), "stats": summary}

    def step_context(self) -> StepContext:
        """What the step's figures are reduced and labelled with (see :func:`step_stats`)."""
        strategy = self.trainer.strategy
        keys = sorted(
            {f"reward/{fn.name}/sum" for fn in self.reward_functions}
            | {k for fn in self.reward_functions for k in fn.metric_names()}
            | ({"reward/shaping/sum"} if self.reward_shaping is not None else set())
        )
        lr = self.optimizer_settings.lr_at(max(self.trainer.global_step - 1, 0))
        group = strategy.controller.group
        size = torch.distributed.get_world_size(group) if strategy.world_size > 1 else 1
        return StepContext(strategy.controller, strategy.is_model_parallel_head, size, keys, self.log_samples, lr,
                           self.agent is not None)  # fmt: skip

    def rollout(self, batch: list[dict]) -> RolloutBatch:
        """Sample ``sampling.n`` completions for each prompt of this rank's batch (the groups the long-tail
        policy keeps), through the strategy's rollout service."""
        request = RolloutRequest(
            rows=batch, prompt_ids=self.tokenize_batch(batch), seeds=self.sample_seeds(batch),
            sampling=self.sampling, step=self.trainer.global_step,
            weights_version=self.trainer.global_step,  # changes with every optimizer step, as the weights do
            agent=self.agent,
        )  # fmt: skip
        return self.trainer.strategy.rollout.rollout(request)

    def reward(self, rollouts: RolloutBatch) -> Scores:
        """The rewards of the samples: the weighted sum of the reward functions (and their per-token
        rewards), computed where the rollouts live (see the controller and placement), plus the reward
        shaping. An override may return a plain ``[N]`` tensor."""
        scores = self.trainer.strategy.rollout.score(rollouts)
        total, metrics = scores.total, dict(scores.metrics)
        if self.reward_shaping is not None:
            shaped = self.reward_shaping(rollouts.response_lengths(), self.sampling.max_new_tokens)
            metrics["reward/shaping/sum"] = float(shaped.sum())
            total = total + shaped
        return Scores(total, metrics, scores.token_rewards, scores.rank_figures)

    def advantage(self, rollouts: RolloutBatch, inputs: AdvantageInputs) -> Advantages:
        """The advantages of the samples (an override may return a plain ``[N]`` tensor)."""
        return self.advantage_estimator(inputs)

    def commit_step_state(self) -> None:
        """The step's rollouts are consumed: rollouts waiting across steps (dynamic sampling's buffer,
        partial rollouts) take their new state. Until then a checkpoint (one saved after a failure in the
        step, say) holds the state from before the step."""
        for part in (self.dynamic_sampling, self.long_tail):
            if hasattr(part, "commit"):
                part.commit()
