"""MegatronStrategy: Megatron-Core parallel state on Lightning's process group, and the rollout engine's life.

Lightning launches the processes (its subprocess launcher, torchrun or SLURM; on CPU a machine's local ranks are
forked from rank 0 instead, :mod:`~yatt_lightning.distributed.fork_launcher`) and creates the default
process group (gloo on CPU; on GPU NCCL for CUDA tensors and gloo for CPU ones). This strategy then builds Megatron's tensor / pipeline /
data-parallel groups over it, never wraps the module in torch's DDP (which would broadcast rank 0's
parameters over the tensor-parallel shards; Megatron's own DDP is used instead), starts the rollout
engine on every rank at the same point, and keeps the engine's weights in step with the policy.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from yatt_lightning.distributed import console, failures, training_world
from yatt_lightning.distributed import threads as run_threads
from yatt_lightning.distributed.fork_launcher import ForkedRanks
from yatt_lightning.distributed.layout import Layout
from yatt_lightning.distributed.watchdog import Watchdog
from yatt_lightning.engines.base import RolloutEngine
from yatt_lightning.models.cpu import megatron_cpu_context
from yatt_lightning.placement import FullColocation, PartialColocation, Placement
from yatt_lightning.placement.role import Role
from yatt_lightning.rollout.controller import Controller, ParallelController
from yatt_lightning.rollout.service import RolloutService
from yatt_lightning.rollout.types import EngineStart

log = logging.getLogger(__name__)

# On GPUs, the step's control messages (error flags, counts, prompts and scores between ranks) are CPU
# tensors, which NCCL cannot carry: gloo carries those, NCCL the CUDA tensors of training.
GPU_PROCESS_GROUP_BACKEND = "cpu:gloo,cuda:nccl"


class MegatronStrategy(DDPStrategy):
    """Megatron-Core parallelism plus a colocated rollout engine.

    Args:
        tensor_model_parallel_size: Ranks that split each layer's weights (TP).
        pipeline_model_parallel_size: Ranks that split the layers into stages (PP).
        expert_model_parallel_size: Ranks that split a mixture-of-experts model's experts (EP; carved out of
            the data-parallel ranks, as Megatron does): each holds ``num_experts / ep`` whole experts, tokens
            travel to their experts by all-to-all, and the engine receives every expert (gathered layer by layer).
        expert_tensor_parallel_size: Ranks that split each expert's weights; 1 (whole experts) for now.
        engine: The rollout engine (default: :class:`~yatt_lightning.rollout.VLLMEngine`). One engine
            serves each model-parallel group, split across its TP x PP ranks by the engine's own
            tensor parallelism.
        controller: Who moves rollout data (default :class:`~yatt_lightning.rollout.controller.ParallelController`;
            :class:`~yatt_lightning.rollout.controller.SingleController` routes everything through rank 0).
        placement: Where the rollout engine and a generative reward model run
            (:class:`~yatt_lightning.placement.FullColocation` by default, or ``PartialColocation``).
        offload_params: While the engine generates, also move the policy's parameters to host memory
            (gradients and optimizer state always move; on CPU into host copies, for the same behaviour).
        timeout_minutes: Timeout of collective operations; a hung rank fails the run after this.
        watchdog_minutes: A rank that stands at one stage of its step (rollout, reward, train, ...)
            this long while a peer is still at an earlier one stops the run, naming the late rank and its
            stage, with every thread's stack in each rank's log (:mod:`yatt_lightning.distributed.watchdog`);
            below ``timeout_minutes``. ``None``: no watchdog.
    """

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
        engine: RolloutEngine | None = None,
        controller: Controller | None = None,
        placement: Placement | None = None,
        offload_params: bool = False,
        timeout_minutes: float = 30.0,
        watchdog_minutes: float | None = 20.0,
        **kwargs: Any,
    ) -> None:
        if watchdog_minutes is not None and not 0 < watchdog_minutes < timeout_minutes:
            raise ValueError(
                f"`trainer.strategy.watchdog_minutes` ({watchdog_minutes}) must be > 0 and below `timeout_minutes` "
                f"({timeout_minutes}), or the collective's timeout ends the run first without naming the late rank; "
                "set it lower, or null for no watchdog."
            )
        if tensor_model_parallel_size < 1:
            raise ValueError(
                f"`trainer.strategy.tensor_model_parallel_size` must be >= 1, got {tensor_model_parallel_size}."
            )
        if pipeline_model_parallel_size < 1:
            raise ValueError(
                f"`trainer.strategy.pipeline_model_parallel_size` must be >= 1, got {pipeline_model_parallel_size}."
            )
        if expert_model_parallel_size < 1:
            raise ValueError(
                f"`trainer.strategy.expert_model_parallel_size` must be >= 1, got {expert_model_parallel_size}."
            )
        if expert_tensor_parallel_size != 1:
            raise ValueError(
                f"`trainer.strategy.expert_tensor_parallel_size` {expert_tensor_parallel_size}: only 1 (whole experts on "
                "each expert-parallel rank) is supported yet; split experts across ranks with `expert_model_parallel_size`."
            )
        if torch.cuda.is_available():
            kwargs.setdefault("process_group_backend", GPU_PROCESS_GROUP_BACKEND)
        super().__init__(timeout=timedelta(minutes=timeout_minutes), **kwargs)
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.expert_model_parallel_size = expert_model_parallel_size
        self.expert_tensor_parallel_size = expert_tensor_parallel_size
        if engine is None:
            from yatt_lightning.engines.vllm_engine import VLLMEngine

            engine = VLLMEngine()
        self.engine = engine
        self.controller = controller if controller is not None else ParallelController()
        self.placement = placement if placement is not None else FullColocation()
        if isinstance(self.placement, PartialColocation) and not isinstance(self.controller, ParallelController):
            raise ValueError(
                "`trainer.strategy.placement`: PartialColocation moves data itself; keep the ParallelController."
            )
        self.offload_params = offload_params
        self.layout: Layout | None = None  # set by check_layout, once the number of processes is known
        self.watchdog_minutes = watchdog_minutes
        self.watchdog: Watchdog | None = None
        self._engine_started = False
        self.resumed_from: Path | None = None
        self.run_id = uuid.uuid4().hex  # recorded in checkpoint manifests; a resumed run keeps its run's id
        # what the module's rollout and reward steps call
        self.rollout = RolloutService(self.engine, self.placement, self.controller, offload_params)

    # ------------------------------------------------------------------ parallel state
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":  # Lightning's default: on CPU, the local ranks are forked from rank 0
            self._launcher = ForkedRanks(self.cluster_environment, self.num_processes, self.num_nodes, self._preload)

    def _preload(self) -> None:
        """What every rank imports once the run starts (Megatron-Core's model, optimizer and checkpointing, the
        engine's modules), imported by rank 0 before its local ranks are forked from it: ~5 s of a core less
        for each of them. What they print goes into the run's log, as it did when each rank imported them."""
        with console.hold_output():
            import megatron.core.dist_checkpointing  # noqa: F401
            import megatron.core.distributed  # noqa: F401
            import megatron.core.models.gpt  # noqa: F401
            import megatron.core.optimizer  # noqa: F401
            import megatron.core.parallel_state  # noqa: F401

            preload = getattr(self.engine, "preload", None)  # a user's engine may have none
            if preload is not None:
                preload()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # Lightning's process group
        os.environ["YATT_PROCESS_RANK"], os.environ["YATT_PROCESS_WORLD"] = str(self.global_rank), str(self.world_size)
        threads, source = run_threads.apply(len(self.parallel_devices or [None]))  # before any engine binds them
        log.info("rank %d: %d torch thread%s (%s)", self.global_rank, threads, "s" if threads > 1 else "", source)
        self._init_megatron()
        self.placement.controller = self.controller
        roles = self.placement.roles(self.world_size)
        if len(roles) > 1:  # each role's step collectives span its own ranks only
            groups = [torch.distributed.new_group(ranks) for ranks in roles]
            self.controller.group = next(g for g, r in zip(groups, roles, strict=True) if self.global_rank in r)
            trains = self.global_rank in roles[0]  # the trainers come first
            training_world.set_training_ranks(len(roles[0]) if trains else None, groups[0] if trains else None)
        if self.watchdog_minutes is not None and self.world_size > 1 and self.watchdog is None:
            peers = next(r for r in roles if self.global_rank in r) if len(roles) > 1 else range(self.world_size)
            self.watchdog = Watchdog(self.watchdog_minutes * 60, self.global_rank, list(peers)).start()

    def enter_stage(self, stage: str, step: int) -> None:
        """This rank's step enters ``stage`` (the watchdog compares it with its peers')."""
        if self.watchdog is not None:
            self.watchdog.enter(stage, step)

    def check_layout(self, world: int) -> Layout:
        """The run's layout for ``world`` processes, checked by the controller and the placement (preflight
        calls this before any process group or engine; a run started from Python, on setting up)."""
        layout = Layout(world, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                        self.expert_model_parallel_size)  # fmt: skip
        if layout != self.layout:
            self.controller.check_layout(layout)
            self.placement.check(layout)
            train = self.placement.training_world(world)
            if layout.ep > 1 and train != world:
                raise ValueError(
                    f"`trainer.strategy.expert_model_parallel_size` {layout.ep} with {type(self.placement).__name__}: "
                    "expert parallelism runs with every rank training (FullColocation) for now; set it to 1."
                )
            layout.check_divides(train, "processes (`trainer.devices` x `trainer.num_nodes`)" if train == world
                                 else f"trainer ranks of {type(self.placement).__name__}")  # fmt: skip
            self.layout = layout
        return layout

    def _init_megatron(self) -> None:
        from megatron.core import parallel_state as ps

        layout = self.check_layout(self.world_size)
        tp, pp = layout.tp, layout.pp
        world = self.placement.training_world(self.world_size)  # the ranks that train (disaggregated: some)
        if ps.model_parallel_is_initialized():  # a second fit/validate re-enters setup
            if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
                raise RuntimeError(
                    "Megatron's parallel state is already initialised with a different layout in this process."
                )
            return
        training_world.set_training_ranks(world if world < self.world_size else None)
        with megatron_cpu_context():
            # tp fastest, then pp, then dp: each model-parallel group is a block of consecutive ranks,
            # which is how vLLM's external launcher groups the ranks of one tensor-parallel engine.
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, order="tp-cp-ep-pp-dp",
                expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            )
        if self.global_rank >= world:
            log.info("rank %d: a rollout rank, outside Megatron's %d training ranks", self.global_rank, world)
            return
        log.info(
            "Megatron parallel state: world=%d tp=%d pp=%d dp=%d ep=%d (rank %d: tp_rank=%d pp_rank=%d dp_rank=%d)",
            world, tp, pp, layout.data_parallel(world), layout.ep, self.global_rank, ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
        )  # fmt: skip

    @property
    def _layout(self) -> Layout:
        return self.layout or Layout(self.world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                                     self.expert_model_parallel_size)  # fmt: skip

    @property
    def role(self) -> Role:
        """What this rank does in its placement (``placement/role.py``)."""
        return self.placement.role

    @property
    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank() if self.role.trains else 0

    @property
    def is_model_parallel_head(self) -> bool:
        """True on the first rank of this rank's model-parallel (TP x PP) group: the one that talks to engines."""
        return self.global_rank % self._layout.model_parallel == 0

    @property
    def data_parallel_size(self) -> int:
        return self._layout.data_parallel(self.placement.training_world(self.world_size))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard data by data-parallel rank: the ranks of one model-parallel group share their data; in a
        # disaggregated placement, the rollout ranks own the rows.
        if self.role.split:
            return self.placement.sampler()
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    # ------------------------------------------------------------------ set-up and teardown
    @override
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.role.split:
            _unsynchronised_sigterm(trainer)
        if self.role.only_rolls_out:
            _run_even_when_done(trainer.fit_loop)
        if not self._engine_started and getattr(self.lightning_module, "needs_engine", True):
            if self.rollout.setup is None:
                raise RuntimeError(
                    "MegatronStrategy: the module did not hand the rollout service its setup in configure_model "
                    "(RLHFModule does; a custom LightningModule must call strategy.rollout.configure)."
                )
            t0 = time.perf_counter()
            start = EngineStart(self.engine, self._layout.model_parallel, self.controller.engine_batch_scale())
            self.placement.start_engines(self.rollout.setup, start)
            log.info("rank %d: engines started in %.1fs", self.global_rank, time.perf_counter() - t0)
            self._engine_started = True
            # vLLM reseeds the global RNG when it starts; put the trainer's seed back.
            torch.manual_seed(self.rollout.setup.run_seed + self.global_rank)

    @override
    def model_to_device(self) -> None:
        pass  # Megatron places its own parameters (CPU, or the current CUDA device)

    @override
    def teardown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self._engine_started:
            self.engine.shutdown()  # before the process group goes: vLLM's groups hang off it
            self.placement.shutdown(self.rollout.setup.reward_functions)
            self._engine_started = False
        super().teardown()

    # ------------------------------------------------------------------ the rollout + reward phase
    def finish_scoring(self, error: BaseException | None) -> float:
        """Collective end of the rollout + reward phase: raises everywhere if any rank failed; returns the
        seconds spent here waiting for slower ranks (this rank's idle time)."""
        t0 = time.perf_counter()
        failures.agree(error, self.controller.group)
        return time.perf_counter() - t0

    def all_reduce_min_max(self, values: list[float]) -> tuple[list[float], list[float]]:
        """(min over ranks, max over ranks) of each value."""
        low = torch.tensor(values, dtype=torch.float64)
        high = low.clone()
        if self.world_size > 1:
            torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=self.controller.group)
            torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=self.controller.group)
        return low.tolist(), high.tolist()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the policy is saved sharded by save_checkpoint, not gathered on rank 0

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Synchronous save (Lightning's ``trainer.save_checkpoint`` / ``ModelCheckpoint``): a complete folder
        or none. :class:`~yatt_lightning.callbacks.AsyncCheckpoint` writes the same format in the background."""
        from yatt_lightning.checkpoint import folder as ckpt

        ckpt.begin(self, checkpoint, Path(filepath), asynchronous=False)
        ckpt.finalize(self, Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint folder, or the newest intact one when given a ``latest`` tracker file."""
        from yatt_lightning.checkpoint import folder as ckpt

        folder = ckpt.resolve(self, Path(checkpoint_path))
        if self.is_global_zero:
            log.info("resuming from %s", folder)
        self.resumed_from = folder
        self.run_id = ckpt.run_id_of(folder) or self.run_id
        return ckpt.load_trainer_state(self, folder)

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        from yatt_lightning.checkpoint import folder as ckpt

        ckpt.load_policy(self, checkpoint)
        self.rollout.mark_weights_stale()

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # restored with the model by load_model_state_dict

    @override
    def remove_checkpoint(self, filepath) -> None:
        from yatt_lightning.checkpoint import folder as ckpt

        if self.is_global_zero:
            ckpt.remove(filepath)


def _unsynchronised_sigterm(trainer) -> None:
    """Lightning broadcasts a SIGTERM flag from rank 0 before every step, which makes every rank meet every
    step. The two sides of a disaggregated placement must not meet: each handles a SIGTERM where it lands
    (and tells the other side through its channel as it fails)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def local_check() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = local_check


def _run_even_when_done(fit_loop) -> None:
    """A rollout rank's loop runs its start and end even with no step left. A stop decided within
    ``queue_size - 1`` steps of the end saves the rollout rank after its last step (it produced ahead of the
    trainers); resumed from there, Lightning would skip its whole loop, ``on_train_end`` included, and the
    trainers, with steps left on the batches they hold, would wait for a rank that never follows their
    decisions. Running the loop's start and end, the rank follows them to the trainers' end (AsyncCheckpoint)
    and ends the channels (``Disaggregated.finish``)."""
    base = type(fit_loop)
    if getattr(base, "runs_even_when_done", False):  # setup runs again (a second fit or validate)
        return
    skip = property(lambda loop: loop.trainer.limit_train_batches == 0)
    fit_loop.__class__ = type(f"RunEvenWhenDone{base.__name__}", (base,), {"skip": skip, "runs_even_when_done": True})
