"""The RL step as a producer and a consumer, on the two sides of a disaggregated placement (a mixin of
:class:`~yatt_lightning.module.RLHFModule`; see :mod:`yatt_lightning.placement.disaggregated`).

A rollout rank's step produces: the weights it may use, then ``rollout`` and ``reward`` (the module's own
hooks), then the scored batch goes to its trainers, stamped with its version. A trainer's step consumes:
the step's batch, then ``advantage`` and ``update`` (the same hooks as the colocated step, in
``train_on``), then the new version goes out. Lightning counts a step on every rank (the rollout ranks'
optimizer is a :class:`StepCounter`), so every rank stops at ``max_steps``.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from yatt_lightning.placement.batch_channel import Produced
from yatt_lightning.rollout.types import Scores


class StepCounter(torch.optim.Optimizer):
    """A rollout rank's optimizer: it has nothing to train; its steps make Lightning count the rank's steps
    (``trainer.global_step``), so the rollout ranks stop, log and save at the same steps as the trainers."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1, requires_grad=True)], {"lr": 0.0})

    def step(self, closure=None) -> None:
        return None


class AsyncSteps:
    """The producer's and the consumer's step (mixed into ``RLHFModule``)."""

    def check_placement(self, placement) -> None:
        """What ``placement`` cannot run of this module, refused naming the key: by ``yatt fit``'s preflight,
        before any process or engine starts, and again when the model is built (a run started without the CLI)."""
        if placement.role.split:  # the same on every rank of a placement (a trainer before any group exists)
            self.check_disaggregated(placement)

    def check_disaggregated(self, placement) -> None:
        """What the disaggregated placement does not run."""
        if self.dynamic_sampling is not None and placement.on_stale == "wait":
            raise ValueError(
                "`model.dynamic_sampling` with `trainer.strategy.placement: Disaggregated` needs "
                "`trainer.strategy.placement.init_args.on_stale: drop`: a round that fills no update publishes no "
                "new version, and with `wait` the rollout rank would wait for version `step - max_staleness`, "
                "which then never comes. With `drop` it generates with the newest version and the trainer drops "
                "a batch older than `max_staleness` versions."
            )

    def optimizer_steps_per_batch(self, samples: int) -> int:
        """Optimizer steps one RL step of ``samples`` samples takes (what Lightning counts as steps)."""
        from yatt_lightning.rollout.batch import mini_batch_slices

        return self.ppo_epochs * len(mini_batch_slices(samples, self.mini_batches))

    def count_steps(self, samples: int, ran: int = 0) -> None:
        """Let Lightning count the optimizer steps of an RL step that ran fewer here than ``samples`` take
        (``ran``: a rollout rank's none, a dropped batch's none, dynamic sampling's round that filled no update
        none, or one that trained fewer samples): every rank then stops at ``max_steps`` and logs the same
        steps (with dynamic sampling, a disaggregated run's ``max_steps`` counts rounds, not updates: the
        rollout rank cannot know which rounds update)."""
        optimizer = self.optimizers()
        inner = optimizer.optimizer
        if hasattr(inner, "count_only"):
            inner.count_only = True  # Megatron's optimizer is not run
        try:
            for _ in range(self.optimizer_steps_per_batch(samples) - ran):
                optimizer.step()
        finally:
            if hasattr(inner, "count_only"):
                inner.count_only = False

    def produce_step(self, batch: list[dict]) -> None:
        """Rollout rank: generate and score this step's rows with the newest weights allowed, and send them."""
        strategy = self.trainer.strategy
        placement = strategy.placement
        step = placement.steps  # RL steps, not optimizer steps (an RL step may take several)
        try:
            strategy.enter_stage("rollout", step)
            version, waited, sync = placement.await_weights(step, strategy.engine)
            t0 = time.perf_counter()
            rollouts = self.rollout(batch)
            t1 = time.perf_counter()
            strategy.enter_stage("reward", step)
            scores = Scores.of(self.reward(rollouts))
            rollouts = rollouts.scored(scores.total, scores.token_rewards)
            if rollouts.versions is None:  # an engine that applies no weights mid-generation
                rollouts = dataclasses.replace(rollouts, versions=[(version, version)] * len(rollouts))
            times = {"rollout": t1 - t0, "sync": sync, "reward": time.perf_counter() - t1, "producer_idle": waited}
            placement.send(Produced(step, version, rollouts, scores.metrics, times))
        except Exception as err:  # the trainers wait for this batch: tell them, then fail here
            placement.tell_failure(err)
            raise
        self.count_steps(len(rollouts) // max(1, placement.parts()))
        placement.steps += 1

    def consume_step(self, batch: list[dict]) -> dict:
        """Trainer: train on this step's batch (or drop it, when too stale), then publish the new version."""
        strategy = self.trainer.strategy
        placement = strategy.placement
        step = placement.steps
        try:
            placement.republish(self.policy)  # resumed: the rollout ranks need the loaded version
            produced, figures = placement.take(step)
            rollouts = produced.batch
            times = {k: produced.times[k] for k in ("rollout", "sync", "reward")}
            rank = {"idle": figures["async/consumer_idle"]}
            if placement.too_stale(produced):
                placement.dropped += 1
                figures["async/dropped"] = float(placement.dropped)
                self.count_steps(len(rollouts))
                placement.publish(step, updated=False, policy=None)
                out = self.figures_only(rollouts, produced.reward_metrics, times, rank, figures)
            else:
                figures["async/dropped"] = float(placement.dropped)
                figures["async/publish_wait"] = placement.settle()  # storages the last version sent as they are
                before = self.trainer.global_step
                out = self.train_on(rollouts, produced.reward_metrics, times, rank, figures)
                ran = self.trainer.global_step - before  # 0: dynamic sampling's round that filled no update
                self.count_steps(len(rollouts), ran)
                out["stats"].scalars["time/publish"] = placement.publish(step, updated=ran > 0, policy=self.policy)
            placement.steps += 1
            return out
        except Exception as err:  # the rollout ranks wait for weights: tell them, then fail here
            placement.tell_failure(err)
            raise

    def on_train_end(self) -> None:
        """After the callbacks' (a checkpoint's last save): what either side sent has been received."""
        strategy = self.trainer.strategy
        if strategy.role.split:
            strategy.placement.finish(strategy.placement.steps - 1)

    def figures_only(self, rollouts, reward_metrics: dict, times: dict, rank: dict, figures: dict) -> dict:
        """The step's figures when it trained nothing (a dropped batch)."""
        from yatt_lightning.training.step_metrics import step_stats

        times = {**times, "train": 0.0, "step": times["rollout"] + times["sync"] + times["reward"]}
        summary = step_stats(self.step_context(), rollouts, reward_metrics, None, figures, times, rank)
        return {"reward_mean": float(rollouts.rewards.mean()), "stats": summary}
