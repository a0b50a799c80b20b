"""Disaggregated placement: rollout ranks produce, trainer ranks consume, and neither waits for the other
beyond a bounded lag (asynchronous RL).

The ranks split in two: the trainers (global ranks ``0 .. T-1``) train with Megatron TP / PP / DP over
their own group; the rollout ranks (the last ones, ``rollout_ranks``) run the policy's engine and the
reward functions. Every rank runs Lightning's loop and takes one step per batch (so every rank stops at
``max_steps`` and logs the same steps); a step is

* on a rollout rank (the producer): apply the newest published weights it may use, generate and score
  this step's prompts, send the scored batch, stamped with its policy version, to its trainers;
* on a trainer (the consumer): take the step's batch, compute the advantages, update, and publish the
  new version (:mod:`~yatt_lightning.placement.weight_channel`).

**Staleness.** The trainer's version is the number of updates it has published. A batch generated with
version ``v`` and trained at version ``u`` is ``u - v`` stale. With ``on_stale: wait`` the producer of step
``s`` waits until it holds version ``s - max_staleness`` (so no batch is older); with ``on_stale: drop`` it
never waits for weights, and the trainer drops a batch older than ``max_staleness`` (the step then updates
nothing; ``async/dropped`` counts them); in both, the producer runs at most ``queue_size`` batches ahead of
the trainer (default ``max_staleness + 1``). ``max_staleness: 0`` is the synchronous step, on separate ranks.

**Determinism.** With ``fixed_lag: true`` (needs ``on_stale: wait``) step ``s`` trains exactly on what version
``max(0, s - max_staleness)`` generated, whatever the timing: a run is reproducible. Without it, which
version a batch used depends on timing (``on_stale: wait`` uses the newest one allowed), and so do the
numbers; ``on_stale: drop`` is never deterministic. **Checkpoints**: :class:`~.save_points.SavePoints`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch

from yatt_lightning.placement.base import Placement, memory, rank
from yatt_lightning.placement.batch_channel import (
    BatchInbox,
    BatchSender,
    EndOfRun,
    Produced,
    ProducerFailure,
)
from yatt_lightning.placement.role import Role
from yatt_lightning.placement.save_points import SavePoints
from yatt_lightning.placement.weight_channel import (
    ACK,
    END,
    FAILURE,
    WEIGHTS,
    LiveWeights,
    SaveDecision,
    WeightPublisher,
    WeightReceiver,
)
from yatt_lightning.rollout.types import EngineStart, Generation, RolloutRequest, RolloutSetup

ON_STALE = ("wait", "drop")
log = logging.getLogger(__name__)


class Disaggregated(SavePoints, Placement):
    """Rollout ranks generate continuously; trainer ranks train on what they generated, a bounded lag behind.

    Args:
        rollout_ranks: Global ranks that run the engines and rewards; they must be the last ranks
            (default: the second half). The others train.
        max_staleness: How many policy versions older than the trainer's a trained batch may be.
        on_stale: ``wait`` (the producer waits for new weights) or ``drop`` (the trainer drops a batch
            that is too old).
        fixed_lag: Step ``s`` trains on exactly what version ``s - max_staleness`` generated (deterministic).
        publish_every: Publish the weights after every this many updates (at most ``max_staleness + 1``).
        queue_size: How many batches the producer may be ahead of the trainer (default ``max_staleness + 1``;
            with ``on_stale: wait`` it cannot be more). With ``drop``, a larger queue keeps the producer busy
            and drops what ages past ``max_staleness`` in it.
        bucket_mb: Size of the buckets the weights travel in.
        direct_mb: A storage of at least this many MiB travels as it is, without a copy into a bucket; the
            trainer's next update waits until it has left. A trainer of one model-parallel rank keeps its
            parameters in one storage per dtype, so its whole policy is one message (measured on the small
            config, 46 MiB: 1.26-1.63x a bare broadcast, against 1.88-2.02x packed); ``null``: every tensor
            is copied into buckets. Used for host tensors (a GPU's are copied to host buckets) when a
            model-parallel group is one process (larger groups gather their shards into new tensors).
        in_flight_updates: The engine applies a newer version between its own steps, in the middle of a
            generation (its samples then record the first and last version of their tokens). Default: on,
            unless ``fixed_lag`` (which it would make timing-dependent).
        timeout_s: The longest any rank waits for the other side (a batch, a version) before failing.
    """

    def __init__(
        self,
        rollout_ranks: list[int] | None = None,
        max_staleness: int = 1,
        on_stale: str = "wait",
        fixed_lag: bool = False,
        publish_every: int = 1,
        queue_size: int | None = None,
        bucket_mb: float = 16.0,
        direct_mb: float | None = 4.0,
        timeout_s: float = 600.0,
        in_flight_updates: bool | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"`trainer.strategy.placement.max_staleness` must be >= 0, got {max_staleness}.")
        if on_stale not in ON_STALE:
            raise ValueError(f"`trainer.strategy.placement.on_stale` must be one of {ON_STALE}, got {on_stale!r}.")
        if fixed_lag and (on_stale != "wait" or publish_every != 1 or queue_size not in (None, max_staleness + 1)):
            raise ValueError(
                "`trainer.strategy.placement.fixed_lag` needs `on_stale: wait`, `publish_every: 1` and the default "
                "`queue_size` (step s trains on exactly version s - max_staleness, which a dropped batch, a skipped "
                "publish or a shorter queue would not give)."
            )
        if not 1 <= publish_every <= max_staleness + 1:
            raise ValueError(
                f"`trainer.strategy.placement.publish_every`={publish_every} must be between 1 and max_staleness + 1 "
                f"= {max_staleness + 1}: the producer could otherwise never hold a version recent enough."
            )
        if queue_size is not None and queue_size < 1:
            raise ValueError(f"`trainer.strategy.placement.queue_size` must be >= 1, got {queue_size}.")
        if in_flight_updates and fixed_lag:
            raise ValueError(
                "`trainer.strategy.placement.in_flight_updates` cannot be true with `fixed_lag`: which tokens a "
                "version generated would depend on timing (leave it unset)."
            )
        if bucket_mb <= 0 or timeout_s <= 0 or (direct_mb is not None and direct_mb <= 0):
            raise ValueError("`trainer.strategy.placement.bucket_mb`, `direct_mb` and `timeout_s` must be > 0.")
        self.rollout_ranks = rollout_ranks
        self.max_staleness, self.on_stale, self.fixed_lag = max_staleness, on_stale, fixed_lag
        self.publish_every, self.bucket_bytes, self.timeout_s = publish_every, int(bucket_mb * 2**20), timeout_s
        self.direct_bytes = None if direct_mb is None else int(direct_mb * 2**20)
        self.queue_size = queue_size if queue_size is not None else max_staleness + 1
        self.trainers: list[int] = []
        self.rollout: list[int] = []
        self.steps = 0  # RL steps this rank has produced or consumed
        self.updates = 0  # trainer: versions published so far (the policy's version)
        self.dropped = 0  # trainer: batches dropped as too stale, over the run
        self.in_flight_updates = in_flight_updates
        self.live = LiveWeights(live=not fixed_lag if in_flight_updates is None else in_flight_updates)
        self.resume_version = 0  # rollout rank, resumed: the trainers' version it resumes from
        self.must_republish = False  # trainer, resumed: publish the loaded version before anything else
        self.restored: list[Produced] = []  # trainer, resumed: the batches the checkpoint held
        self.saving_for: SaveDecision | None = None  # rollout rank: the decision whose save it is in
        self.trainers_done = False  # rollout rank: it followed the trainers' last decision
        self.idle_at_safe_point = 0.0  # rollout rank: seconds waited for decisions, counted in the next step's idle
        self.saves_after_failure = False  # a checkpoint callback saves both sides after a rollout rank's own failure
        self.publisher: WeightPublisher | None = None  # trainer 0's (every other trainer reads None)

    # ------------------------------------------------------------------ layout
    def check(self, layout) -> None:
        world = layout.world
        if world < 2:
            raise ValueError("`trainer.strategy.placement`: Disaggregated needs at least 2 processes (`trainer.devices`).")
        rollout = sorted(self.rollout_ranks or list(range(world - world // 2, world)))
        trainers = list(range(world - len(rollout)))
        if not trainers or rollout != list(range(len(trainers), world)):
            raise ValueError(
                f"`trainer.strategy.placement.rollout_ranks` {rollout}: name the last ranks, leaving at least one "
                f"trainer (of {world} processes); e.g. [{world - 1}]."
            )
        model_parallel = layout.model_parallel
        if len(trainers) % model_parallel:
            raise ValueError(
                f"`trainer.strategy.tensor_model_parallel_size` x `pipeline_model_parallel_size` = {model_parallel} "
                f"does not divide the {len(trainers)} trainer ranks of Disaggregated."
            )
        dp = len(trainers) // model_parallel
        if dp % len(rollout):
            raise ValueError(
                f"`trainer.strategy.placement.rollout_ranks`: {len(rollout)} rollout ranks must divide the {dp} "
                "trainer data-parallel ranks (each rollout rank serves the same number)."
            )
        self.trainers, self.rollout, self.model_parallel = trainers, rollout, model_parallel

    @property
    def engine_version(self) -> int | None:
        """Rollout rank: the version its engine holds (None: resumed, not yet loaded)."""
        return self.live.version

    @engine_version.setter
    def engine_version(self, version: int | None) -> None:
        self.live.version = version

    role = property(lambda self: Role.ROLLOUT if rank() in self.rollout else Role.TRAINER)

    def roles(self, world: int) -> list[list[int]]:
        return [self.trainers, self.rollout]

    def training_world(self, world: int) -> int:
        return len(self.trainers)

    def hosts_policy_engine(self) -> bool:
        return rank() in self.rollout

    def sampler(self) -> dict[str, int]:
        """How the rows are sharded: over the rollout ranks (the trainers' loaders are not read)."""
        me = rank()
        return {"num_replicas": len(self.rollout), "rank": self.rollout.index(me) if me in self.rollout else 0}

    def serves(self, rollout_rank: int) -> list[int]:
        """The trainer data-parallel ranks ``rollout_rank`` produces for."""
        idx = self.rollout.index(rollout_rank)
        return [d for d in range(len(self.trainers) // self.model_parallel) if d % len(self.rollout) == idx]

    def _trainers_served(self, dp: int | None = None) -> list[int]:
        """The trainer ranks of data-parallel rank ``dp`` (``None``: of every one this rollout rank serves)."""
        dps = self.serves(rank()) if dp is None else [dp]
        return [t for d in dps for t in range(d * self.model_parallel, (d + 1) * self.model_parallel)]

    def source(self, trainer_rank: int) -> int:
        return self.rollout[(trainer_rank // self.model_parallel) % len(self.rollout)]

    # ------------------------------------------------------------------ engines and channels
    def start_engines(self, setup: RolloutSetup, policy_engine: EngineStart) -> None:
        from yatt_lightning.engines.vllm_groups import join_engine_groups
        from yatt_lightning.rollout.longtail import PartialRollout

        if isinstance(setup.long_tail, PartialRollout):
            raise ValueError("`model.long_tail`: PartialRollout with Disaggregated is not supported yet; use WaitForAll.")
        world = list(range(len(self.trainers) + len(self.rollout)))
        self.batches = torch.distributed.new_group(world, backend="gloo")
        self.weights = torch.distributed.new_group([0, *self.rollout], backend="gloo")
        self.weight_data = torch.distributed.new_group([0, *self.rollout], backend="gloo")  # receives posted ahead
        me = rank()
        if me in self.rollout:  # one engine per rollout rank; vLLM builds its groups with every rank at once
            if self.in_flight_updates and not hasattr(policy_engine.engine, "weight_feed"):
                raise ValueError(
                    f"`trainer.strategy.placement.in_flight_updates`: the engine {type(policy_engine.engine).__name__} "
                    "takes no weights between its steps (it has no `weight_feed`); leave it unset."
                )
            policy_engine = dataclasses.replace(policy_engine, tensor_parallel_size=1)  # whatever the trainers' TP
            policy_engine.start(setup.engine, batch_scale=len(self.serves(me)))
            for genrm in self.judges(setup.reward_functions):  # the rollout rank scores: its judges run beside it
                genrm.start(seed=setup.engine.seed, max_num_seqs=setup.engine.max_num_seqs, dtype=setup.engine.dtype)
            self.sender = BatchSender(self.batches, self.timeout_s)
            self.receiver = WeightReceiver(self.weights, 0, data_group=self.weight_data)
            self.live.receiver = self.receiver
            if self.live.live and hasattr(policy_engine.engine, "weight_feed"):
                policy_engine.engine.weight_feed = self.live
        else:
            join_engine_groups()
            self.inbox = BatchInbox(self.batches, self.source(me), held=self.restored)
            direct = self.direct_bytes if self.model_parallel == 1 else None  # gathered shards are new tensors
            if me == 0:
                self.publisher = WeightPublisher(self.weights, 0, self.bucket_bytes, direct, data_group=self.weight_data)

    def generate(self, request: RolloutRequest, keep: int, engine) -> Generation:
        groups = self.controller.generate(request, keep, engine)
        return Generation(groups, rank_figures=memory("rollout"))

    # ------------------------------------------------------------------ the producer (rollout ranks)
    def await_weights(self, step: int, engine) -> tuple[int, float, float]:
        """Before producing step ``step``: the engine holds the version this step may use. Returns the version,
        the seconds waited for it (or for room in the queue) and the seconds applying it took."""
        bound = max(0, step - self.max_staleness)
        if self.engine_version is None and bound < self.resume_version:  # resumed from a run's end: nothing
            log.info("rank %d: resumed after the run's end: step %d uses version %d (the oldest the trainers hold; "
                     "the lag is %d again from the next step)", rank(), step, self.resume_version, self.max_staleness)
            bound = self.resume_version  # was produced ahead, and the trainers' version is the oldest one left
        room = self.queue_size  # batches the producer may be ahead of the trainer
        waited = self.idle_at_safe_point + self.receiver.wait(
            lambda s: step - (s.consumed + 1) < room, f"step {step - room}'s consumption", self.timeout_s
        )
        self.idle_at_safe_point = 0.0
        if self.engine_version is None:  # resumed: the engine holds the base model until the trainers' version
            waited += self.receiver.wait(lambda s: s.latest >= self.resume_version, f"version {self.resume_version}",
                                         self.timeout_s)  # fmt: skip
        if self.on_stale == "wait":
            if self.fixed_lag:
                held = self.engine_version  # (a step after a resume at the run's end reuses what it applied)
                ready, what = (lambda s: bound in (0, held) or bound in s.versions), f"version {bound}"
            else:
                ready, what = (lambda s: s.latest >= bound), f"a version >= {bound}"
            waited += self.receiver.wait(ready, what, self.timeout_s)
        state = self.receiver.state
        target = bound if self.fixed_lag else max(v for v in (self.engine_version, *state.versions) if v is not None)
        seconds = 0.0
        if target != self.engine_version and target in state.versions:
            t0 = time.perf_counter()
            engine.push_weights(self.receiver.take(target))
            seconds = time.perf_counter() - t0
            self.engine_version = target
        return self.engine_version, waited, seconds

    def send(self, produced: Produced) -> None:
        """The step's scored batch to each trainer of the data-parallel ranks this rank serves (split by groups)."""
        parts = produced.batch.split_groups(len(self.serves(rank())))
        for dp, part in zip(self.serves(rank()), parts, strict=True):
            for trainer in self._trainers_served(dp):
                self.sender.send(Produced(produced.step, produced.version, part, produced.reward_metrics,
                                          produced.times, produced.figures), trainer)  # fmt: skip

    # ------------------------------------------------------------------ the consumer (trainer ranks)
    def take(self, step: int) -> tuple[Produced, dict[str, float]]:
        """Step ``step``'s batch and the figures of the wait (``async/*``)."""
        produced, waited, depth = self.inbox.take(step, self.timeout_s)
        versions = produced.batch.versions or [(produced.version, produced.version)]
        staleness = [self.updates - first for first, _ in versions]  # of a sample's oldest tokens
        return produced, {
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness)),
            "async/version_span_max": float(max(last - first for first, last in versions)),  # in-flight updates
            "async/queue_depth": float(depth),
            "async/consumer_idle": waited,
            "async/producer_idle": produced.times["producer_idle"],
            "async/version": float(produced.version),
        }

    def too_stale(self, produced: Produced) -> bool:
        return self.on_stale == "drop" and self.updates - produced.version > self.max_staleness

    def republish(self, policy) -> None:
        """Resumed trainer, before its first step: the version it loaded, which the rollout ranks' engines
        (started from the base model) need."""
        if self.must_republish:
            self._publish_weights(self.steps - 1, policy)
            self.must_republish = False

    def publish(self, step: int, updated: bool, policy) -> float:
        """After the trainer's step ``step``: the new version of ``policy`` (a collective over the model-parallel
        group), or an acknowledgement when the step updated nothing or it is not time to publish. Returns the
        seconds spent (exporting and posting)."""
        t0 = time.perf_counter()
        if updated:
            self.updates += 1
        if updated and self.updates % self.publish_every == 0:
            self._publish_weights(step, policy)
        elif self.publisher is not None:
            self.publisher.publish(ACK, self.updates, step)
        return time.perf_counter() - t0

    def _publish_weights(self, step: int, policy) -> None:
        """Data-parallel rank 0's model-parallel group exports (a collective); its first rank publishes
        (the others only take part in the export's gathers)."""
        if self.publisher is not None:
            named, rename = self.weights_of(policy)
            self.publisher.publish(WEIGHTS, self.updates, step, named, rename=rename)
        elif rank() < self.model_parallel:
            for _ in policy.export_hf():
                pass

    def weights_of(self, policy):
        """What the publisher sends, and how the rollout rank renames it. A model-parallel group of one
        sends the policy's parameters as they are (views of one storage: with ``direct_mb``, one message
        without a copy), and the rollout rank applies ``policy.hf_names`` (its copy of q, k and v out of the
        fused QKV weight). A larger group sends the Hugging Face export, read as it is sent (each tensor
        gathered or broadcast as it is read)."""
        if self.model_parallel == 1:
            return policy.local_tensors(), policy.hf_names
        return policy.export_hf(), None

    def settle(self) -> float:
        """Trainer, before it changes its parameters: what it sent as it is has left. Returns the seconds waited."""
        return self.publisher.flush(self.timeout_s, only_direct=True) if self.publisher is not None else 0.0

    # ------------------------------------------------------------------ failures and the end
    def tell_failure(self, error: BaseException) -> None:
        """This rank failed: the other side waits for it, so tell it (then the error propagates here). A
        rollout rank that raised on its own, the only one, says it will join the trainers' save (when a
        checkpoint callback saves after a failure: ``saves_after_failure``); a trainer whose rollout rank failed
        that way tells it nothing (it waits for the trainers' decision)."""
        from yatt_lightning.distributed.failures import RankFailure, describe
        from yatt_lightning.placement.batch_channel import ProducerFailed

        origin = error.origin if isinstance(error, RankFailure) else rank()
        with contextlib.suppress(Exception):  # the channel may be what failed
            if rank() in self.rollout:
                joins = self.joins_save_after(error)
                for trainer in self._trainers_served():
                    self.sender.send(ProducerFailure(origin, describe(error), joins_save=joins), trainer)
            elif self.publisher is not None and not (isinstance(error, ProducerFailed) and error.joins_save):
                self.publisher.publish(FAILURE, self.updates, -1, cause=describe(error))

    def joins_save_after(self, error: BaseException) -> bool:
        """Rollout rank: whether it joins the trainers' save after ``error``: its own failure (not one it heard
        of), the only rollout rank, with a checkpoint callback that saves after a failure."""
        from yatt_lightning.distributed.failures import RankFailure

        return self.saves_after_failure and not isinstance(error, RankFailure) and len(self.rollout) == 1

    def finish(self, last_step: int) -> None:
        """The end of the run (after this rank's ``last_step``; a stop on a signal ends it early): what either
        side sent has been received."""
        if rank() in self.rollout:
            for trainer in self._trainers_served():
                self.sender.send(EndOfRun(), trainer)
            self.sender.flush()
            self.receiver.wait(lambda s: s.ended, f"the end of the trainers' step {last_step}", self.timeout_s)
            self.receiver.join(self.timeout_s)
        else:
            if self.publisher is not None:
                self.publisher.publish(END, self.updates, last_step)
                self.publisher.flush(self.timeout_s)
            self.inbox.close(self.timeout_s)  # the rollout rank's EndOfRun came: no receive is left open

    def parts(self) -> int:
        """Into how many trainers' batches a rollout rank's batch is split."""
        return len(self.serves(rank())) if rank() in self.rollout else 1
