"""AsyncCheckpoint: checkpoints written in the background, at safe points, on preemption, at the end.

What a step waits for is the planning collectives and, on GPU, Megatron's device-to-host copy (then
Megatron-Core's asynchronous ``dist_checkpointing`` writers in a forked process); on CPU a thread of the
training process writes from the training tensors themselves, and the next optimizer step first copies
what it has not written yet (see :mod:`yatt_lightning.checkpoint.writer`). A
checkpoint becomes visible (renamed from ``.tmp``, then named by the ``latest`` tracker) only after
every rank's writers finished and the manifest of sizes and checksums is on disk; only then is
"checkpoint saved" logged. See :mod:`yatt_lightning.checkpoint.folder` for the format.

Saves happen at the safe point of a step (after the optimizer step, before the next weight push):
every ``every_n_steps`` steps and/or ``every_minutes`` minutes, when SIGINT (Ctrl-C), SIGTERM or SIGUSR1
arrives on any rank (the step in flight finishes, the state is saved, training stops with a log line and
exit code 128 + the signal's number: 130 for Ctrl-C), and at the end of training. A second Ctrl-C stops
at once: the newest complete checkpoint stays ``latest`` and a save in flight is never taken for one. A
step that does not finish within ``interrupt_grace_s`` of a Ctrl-C (stuck in a reward function, say) is
given up as a second Ctrl-C would: the main thread is interrupted (exit code 130, ``latest`` unchanged),
and if it cannot unwind (blocked in a collective) the process exits 15 s later.
The writers are started with those signals blocked, so a Ctrl-C that reaches the whole process group
(a terminal's) never interrupts a write (a forked writer never sees it; a writer thread leaves it to the
main thread). On an exception it saves only when the state is consistent (no
optimizer step of the failed RL step was taken), every rank raised the same error and at least one step
was trained since the run started, and says which it did.

With :class:`~yatt_lightning.placement.Disaggregated`, the trainers decide at their safe point (over their
own group, counting a signal any rollout rank reported) and the rollout ranks follow that decision at theirs
(:meth:`~yatt_lightning.placement.Disaggregated.decide`): the two sides never meet but to save.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback
from typing_extensions import override
from yatt_lightning.callbacks.best_checkpoint import BestCheckpoint
from yatt_lightning.callbacks.disaggregated_saves import DisaggregatedSavePoints

from yatt_lightning.checkpoint import folder as ckpt
from yatt_lightning.checkpoint import space
from yatt_lightning.checkpoint.lock import FolderLock, FolderLocked
from yatt_lightning.checkpoint.signals import PREEMPTION_SIGNALS, PreemptionSignals
from yatt_lightning.distributed import failures
from yatt_lightning.distributed.failures import RankFailure
from yatt_lightning.distributed.seeding import rng_states, set_rng_states
from yatt_lightning.models.cpu import megatron_cpu_context

log = logging.getLogger("yatt_lightning.checkpoint.folder")



class AsyncCheckpoint(DisaggregatedSavePoints, Callback):
    """Args:
    dirpath: Folder of the checkpoints and the ``latest`` tracker. ``None``: ``<save_dir>/<name>/checkpoints``
        of the logger (not its ``version_N`` folder, so a resumed run finds the checkpoints of the run
        it resumes), or ``<default_root_dir>/checkpoints`` without a logger.
    every_n_steps: Save after every this many training steps; ``None`` or 0 disables.
    every_minutes: Also save when this many minutes passed since the last save; ``None`` disables.
    keep_last: Keep this many newest checkpoints (older ones are deleted in the background, never the
        one the run resumed from).
    async_save: Write in the background; ``False`` writes synchronously (same format).
    save_on_signal: Save and stop on SIGTERM / SIGUSR1.
    save_at_end: Save when training ends.
    interrupt_grace_s: After a Ctrl-C, the longest the step in flight may take to reach its end (and be
        saved); past it the run stops without saving it.
    on_no_space: Before each save, when the folder's disk has less free space than the save needs (the
        last checkpoint's size, or an estimate before the first; :mod:`yatt_lightning.checkpoint.space`):
        ``warn`` in one line, or ``stop`` the run before writing.
    keep_best: A validation figure (``val/reward/mean``, ...): a validation that improves it saves the state,
        which ``keep_last`` then keeps and the ``best`` file names (:mod:`~yatt_lightning.callbacks.best_checkpoint`).
    best_mode: ``max`` (a higher figure is better) or ``min``.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int | None = 10,
        every_minutes: float | None = None,
        keep_last: int = 3,
        async_save: bool = True,
        save_on_signal: bool = True,
        save_at_end: bool = True,
        interrupt_grace_s: float = 60.0,
        on_no_space: Literal["warn", "stop"] = "warn",
        keep_best: str | None = None,
        best_mode: Literal["max", "min"] = "max",
    ) -> None:
        if every_n_steps is not None and every_n_steps < 0:
            raise ValueError(f"`AsyncCheckpoint.every_n_steps` must be >= 0, got {every_n_steps}.")
        if every_minutes is not None and every_minutes <= 0:
            raise ValueError(f"`AsyncCheckpoint.every_minutes` must be > 0, got {every_minutes}.")
        if on_no_space not in ("warn", "stop"):
            raise ValueError(f"`AsyncCheckpoint.on_no_space` must be 'warn' or 'stop', got {on_no_space!r}.")
        if interrupt_grace_s <= 0:
            raise ValueError(f"`AsyncCheckpoint.interrupt_grace_s` must be > 0, got {interrupt_grace_s}.")
        if keep_last < 1:
            raise ValueError(f"`AsyncCheckpoint.keep_last` must be >= 1, got {keep_last}.")
        self.best = BestCheckpoint(keep_best, best_mode) if keep_best is not None else None
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_steps = every_n_steps or None
        self.every_minutes = every_minutes
        self.keep_last = keep_last
        self.async_save = async_save
        self.save_on_signal = save_on_signal
        self.save_at_end = save_at_end
        self.interrupt_grace_s = interrupt_grace_s
        self._signals = PreemptionSignals(interrupt_grace_s, lambda: self.dirpath)
        self.on_no_space = on_no_space
        self._needed = 0  # what the save in flight needs, as its error would say
        self._queue = None
        self._pending: list[tuple[int, Path]] = []
        self._last_saved_step: int | None = None  # the newest step whose checkpoint is complete
        self._scheduled_step: int | None = None  # the newest step a save was started for
        self._last_save_time = time.monotonic()
        self._stop_requested = False  # a disaggregated rollout rank told the trainers of its signal
        self._lock: FolderLock | None = None  # rank 0: this run's hold on dirpath
        self.stopped_by: int | None = None  # the signal that stopped training (its exit code is 128 + it)
        self._start_step = 0
        self._restored_rng: dict | None = None
        self._training = False
        self.stall_seconds = 0.0  # time the step loop spent in this callback's saves (for benchmarks)

    # ------------------------------------------------------------------ life cycle
    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = default_dirpath(trainer)
        error = None
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            if stage == "fit" and self._lock is None:  # one run per folder, for the run's whole life
                lock = FolderLock(self.dirpath)
                try:
                    lock.acquire()
                    self._lock = lock
                except FolderLocked as err:
                    error = err
        failures.agree(error)  # before any engine starts: every rank stops with the holder named

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._training = True
        if self.async_save:
            ckpt.start_write_results_queue()  # outside the step loop, and deaf to preemption signals
        if trainer.is_global_zero and not trainer.ckpt_path and ckpt.complete_checkpoints(self.dirpath):
            log.warning(
                "%s already holds checkpoints and this run does not resume from them; `latest` will point to "
                "this run's checkpoints from its first save", self.dirpath,
            )  # fmt: skip
        if self._restored_rng is not None:
            set_rng_states(self._restored_rng)
            self._restored_rng = None
        if self.save_on_signal:  # ours only record the signal; the decision to save is taken at the safe point
            self._signals.install()
        self._last_save_time = time.monotonic()
        self._start_step = trainer.global_step
        if trainer.strategy.role.split:  # a rollout rank that raises joins the trainers' save after it
            trainer.strategy.placement.saves_after_failure = True
        if trainer.ckpt_path:  # resumed: the state at this step is already saved
            self._last_saved_step = self._scheduled_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """The safe point: after the optimizer step, before the next rollout's weight push."""
        t0 = time.perf_counter()
        self._signals.reached_safe_point()  # the step in flight at a Ctrl-C ended in time
        self._finalize(trainer, blocking=False)
        if trainer.strategy.role.split:
            self._follow(trainer, self._decisions(trainer, final=False))
            self.stall_seconds += time.perf_counter() - t0
            return
        step = trainer.global_step
        signalled, time_due = self._agree(trainer)
        due = (self.every_n_steps and step % self.every_n_steps == 0) or time_due or signalled
        if due and step != self._scheduled_step:
            self.save(trainer)
        if signalled:
            self._stop(trainer, self._signals.received, step)
        self.stall_seconds += time.perf_counter() - t0

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        """A new best by ``keep_best``: save this step's state (every rank agrees: the figure is the same on each)."""
        best = self.best
        if best is None or trainer.sanity_checking or not self._training:
            return
        if best.figure not in trainer.callback_metrics:
            known = ", ".join(sorted(k for k in trainer.callback_metrics if k.startswith("val/")))
            raise ValueError(f"`AsyncCheckpoint.keep_best`: validation logged no {best.figure!r} (it logged: {known}).")
        step = trainer.global_step
        if not best.offer(float(trainer.callback_metrics[best.figure]), step):
            return
        if trainer.is_global_zero:
            log.info("best %s so far: %.4f at step %d", best.figure, best.value, step)
        if step == self._last_saved_step:  # its checkpoint is complete already: name it
            if trainer.is_global_zero:
                best.saved(self.dirpath / ckpt.checkpoint_name(step), step)
        elif step != self._scheduled_step:  # else the save under way names it when it completes
            self.save(trainer)

    def _stop(self, trainer, signum: int | None, step: int) -> None:
        self._finalize(trainer, blocking=True)
        name = signal.Signals(signum).name if signum else "a signal on another rank"
        log.warning(
            "%s: received %s; saved step %d to %s; stopping training",
            "interrupted" if signum == signal.SIGINT else "preemption", name, step,
            self.dirpath / ckpt.checkpoint_name(step),
        )  # fmt: skip
        self.stopped_by = signum or signal.SIGTERM
        trainer.should_stop = True

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.strategy.role.only_trains:
            self._follow(trainer, self._decisions(trainer, final=True))
        elif trainer.strategy.role.only_rolls_out:  # the decisions of the trainers' last steps, to their end
            while not trainer.strategy.placement.trainers_done:
                self._follow(trainer, self._decisions(trainer, final=True))
        elif self.save_at_end and trainer.global_step != self._scheduled_step:
            self.save(trainer)
        self._finalize(trainer, blocking=True)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._training = False
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._signals.restore()

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not self._training:
            return  # failed before training started: there is nothing new to save
        if isinstance(exception, KeyboardInterrupt):
            log.warning("interrupted: the step in flight is not saved; `latest` in %s is unchanged", self.dirpath)
            return
        if space.is_no_space(exception):
            return  # its message says what is saved; another save would meet the same full disk
        if trainer.strategy.role.split:
            self._save_after_a_rollout_failure(trainer, exception)
            return
        if trainer.global_step == self._start_step:
            log.info("not saving after %s: no step was trained since the run started", type(exception).__name__)
            return
        latest = ckpt.complete_checkpoints(self.dirpath) if self.dirpath else []
        newest = latest[0] if latest else None
        if getattr(pl_module, "partial_update", False):
            log.error(
                "not saving after %s: it interrupted an update midway (some optimizer steps of step %d were "
                "taken), so the state is inconsistent. The newest complete checkpoint is %s.",
                type(exception).__name__, trainer.global_step, newest,
            )  # fmt: skip
            return
        if trainer.world_size > 1 and not (isinstance(exception, RankFailure) and exception.agreed):
            log.error(
                "not saving after %s: other ranks may not be able to take part in a save. The newest complete "
                "checkpoint is %s.", type(exception).__name__, newest,
            )  # fmt: skip
            return
        try:
            try:
                self._finalize(trainer, blocking=True)
            except BaseException as err:  # a background save failed (torch's CheckpointException is a
                # BaseException); the synchronous one below replaces it
                log.error("the background save failed: %s", err)
            if trainer.global_step != self._last_saved_step:
                self.save(trainer, asynchronous=False)
            log.error(
                "after %s: the state after step %d is consistent and was saved to %s; the batch of the failed "
                "step is skipped on resume.", type(exception).__name__, trainer.global_step,
                self.dirpath / ckpt.checkpoint_name(trainer.global_step),
            )  # fmt: skip
        except BaseException as err:  # never hide the original error (CheckpointException is a BaseException)
            log.error("saving after %s failed too: %s", type(exception).__name__, err)

    # ------------------------------------------------------------------ saving
    def save(self, trainer, asynchronous: bool | None = None, step: int | None = None) -> None:
        """Collective: start a checkpoint of the current state (at most one in flight), named by ``step``
        (default: this rank's; a disaggregated rollout rank saves under the trainers' step)."""
        asynchronous = self.async_save if asynchronous is None else asynchronous
        if hasattr(trainer.strategy, "enter_stage"):
            trainer.strategy.enter_stage("checkpoint", trainer.global_step)
        if self._pending:
            self._finalize(trainer, blocking=True)
        step = trainer.global_step if step is None else step
        final = self.dirpath / ckpt.checkpoint_name(step)
        self._check_space(trainer, final)
        rollout = getattr(trainer.strategy, "rollout", None)
        if rollout is not None and rollout.setup is not None:  # a round without an update left it offloaded
            if getattr(getattr(trainer.lightning_module, "policy", None), "offloaded", False):
                log.info("a round without an update left the training state offloaded: onloading it for the save")
            rollout.prepare_training()
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        state["yatt_rng"] = rng_states()
        with self._no_space_is_one_screen(trainer, final):
            request = ckpt.begin(trainer.strategy, state, final, asynchronous=asynchronous)
        self._scheduled_step = step
        self._last_save_time = time.monotonic()
        if request is None:
            with self._no_space_is_one_screen(trainer, final):
                ckpt.finalize(trainer.strategy, final)
            self._done(trainer, step, final)
            return
        if self._queue is None:
            self._queue = ckpt.async_calls_queue()
        # The writer (a forked process on GPU, a thread on CPU) starts here with the preemption signals
        # blocked: a Ctrl-C sent to the process group must not cut its write, and a thread keeps the mask, so
        # they reach the main thread's handlers. This thread gets any that arrived once they are unblocked.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        try:
            with megatron_cpu_context():
                self._queue.schedule_async_request(request)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self._pending.append((step, final))

    def _finalize(self, trainer, blocking: bool) -> None:
        if not self._pending:
            return
        try:
            with megatron_cpu_context(), self._no_space_is_one_screen(trainer, self._pending[0][1]):
                done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException:  # Megatron dropped the failed call from its queue: so do we (it was not saved)
            self._pending.clear()
            raise
        for _ in done:
            step, final = self._pending.pop(0)
            self._done(trainer, step, final)

    def _check_space(self, trainer, final: Path) -> None:
        """Collective: rank 0 compares the free space with what this save needs (warns, or stops every rank)."""
        error = None
        if trainer.is_global_zero:
            self._needed, error = space.before_save(trainer.strategy, self.dirpath, final.name, self.on_no_space)
        failures.agree(error)  # on one process, the error itself

    def _no_space_is_one_screen(self, trainer, final: Path):
        return space.one_screen(self.dirpath, final, self._needed, remove_tmp=trainer.is_global_zero)

    def _done(self, trainer, step: int, final: Path) -> None:
        self._last_saved_step = step
        if trainer.is_global_zero:
            log.info("checkpoint saved: step %d at %s", step, final)
            complete = ckpt.complete_checkpoints(self.dirpath, run_id=getattr(trainer.strategy, "run_id", None))
            best = self.best.protected(self.dirpath, ckpt.checkpoint_name) if self.best is not None else None
            if self.best is not None:
                self.best.saved(final, step)
            protect = {Path(p).resolve() for p in (getattr(trainer.strategy, "resumed_from", None),
                                                    ckpt.tracked(self.dirpath), best) if p is not None}  # fmt: skip
            old = [p for p in complete[self.keep_last :] if p.resolve() not in protect]
            if old:
                threading.Thread(target=lambda: [ckpt.remove(p) for p in old], daemon=True).start()

    def _agree(self, trainer) -> tuple[bool, bool]:
        """Every rank learns whether any rank got a preemption signal and whether the timer is due on rank 0."""
        local = torch.tensor(
            [
                1.0 if (self.save_on_signal and self._signals.received is not None) else 0.0,
                1.0 if self._timer_due(trainer) else 0.0,
            ]
        )
        if trainer.world_size > 1:
            torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
        return bool(local[0]), bool(local[1])

    def _timer_due(self, trainer) -> bool:
        """Rank 0's clock: ``every_minutes`` have passed since the last save (the other ranks learn it)."""
        minutes = (time.monotonic() - self._last_save_time) / 60
        return bool(trainer.is_global_zero and self.every_minutes and minutes >= self.every_minutes)

    # ------------------------------------------------------------------ resume
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": str(self.dirpath), "best": self.best.state_dict() if self.best is not None else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # where this run writes is its own configuration, not the resumed run's; the best so far is the run's
        if self.best is not None:
            self.best.load_state_dict(state_dict.get("best"))

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # Applied at train start: the rollout engine reseeds the global RNG when it starts.
        self._restored_rng = checkpoint.get("yatt_rng")


def default_dirpath(trainer) -> Path:
    logger = trainer.logger
    save_dir, name = getattr(logger, "save_dir", None), getattr(logger, "name", None)
    if save_dir and name:
        return Path(save_dir) / name / "checkpoints"
    return Path(trainer.default_root_dir) / "checkpoints"
