"""RunConsole: what a ``yatt fit`` terminal shows -- yatt's own lines, one progress bar, errors, a summary.

Everything else the libraries print (vLLM, Megatron-Core, Lightning, torch's C++ warnings, tqdm bars of
loaders) goes to ``output.log`` in the run's folder (``trainer.log_dir``; ``output.rank<r>.log`` for
the other ranks), from the moment the processes are up until training ends; errors are shown on the
terminal as usual. ``yatt fit --verbose`` (or ``YATT_VERBOSE=1``) leaves all output on the terminal.

The bar counts optimizer steps against ``max_steps`` and shows the step's mean reward and the
rollout and training times. Without a terminal (a log file of a batch job) it prints a line every tenth
of the run instead. At the end: steps, the mean reward of the first and last steps, where the TensorBoard
logs and the checkpoints are, and the commands to resume and to export.
"""

from __future__ import annotations

import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from typing_extensions import override

from yatt_lightning.distributed import console


class RunConsole(ProgressBar):
    """Args:
    verbose: Leave every library's output on the terminal (also ``YATT_VERBOSE=1``).
    summary_window: Steps averaged for the first and last mean reward of the summary.
    """

    def __init__(self, verbose: bool = False, summary_window: int = 10) -> None:
        super().__init__()
        if summary_window < 1:
            raise ValueError(f"`RunConsole.summary_window` must be >= 1, got {summary_window}.")
        self.verbose = verbose
        self.summary_window = summary_window
        console.capture_to_come = not verbose  # setup opens the log: output before then waits for it
        self._enabled = True
        self._capture: console.Capture | None = None
        self._bar = None
        self._bar_safe = None
        self._rewards: list[float] = []
        self._failed: BaseException | None = None
        self._started = 0.0
        self._first_step = 0
        self._last_step = 0
        self._every = 1

    # ------------------------------------------------------------------ Lightning's progress-bar protocol
    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @property
    def _out(self) -> TextIO:
        return self._capture.terminal if self._capture is not None else sys.stderr

    @override
    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, file=self._out, flush=True, **kwargs)

    # ------------------------------------------------------------------ life cycle
    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)  # collective: rank 0's folder, on every rank
        if self.verbose or console.verbose() or self._capture is not None:
            return
        name = "output.log" if trainer.global_rank == 0 else f"output.rank{trainer.global_rank}.log"
        self._capture = console.Capture(log_dir / name)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self._started = time.perf_counter()
        self._first_step = trainer.global_step
        total = self._total(trainer)
        self._last_step = self._first_step + total
        self._every = max(1, total // 10)
        if not (trainer.is_global_zero and self._enabled):
            return
        strategy = trainer.strategy
        layout = ""
        if hasattr(strategy, "tensor_model_parallel_size"):
            ep = getattr(strategy, "expert_model_parallel_size", 1)
            layout = (f" (tp={strategy.tensor_model_parallel_size} pp={strategy.pipeline_model_parallel_size} "
                      f"dp={strategy.data_parallel_size}{f' ep={ep}' if ep > 1 else ''})")  # fmt: skip
        params = sum(p.numel() for p in pl_module.parameters())  # this rank's (its shards, its experts)
        where = f"; library output: {self._capture.path}" if self._capture is not None else ""
        self.print(
            f"[yatt] training {_count(params)} parameters for {total} steps on {trainer.world_size} "
            f"process{'es' if trainer.world_size > 1 else ''}{layout}{where}"
        )
        if self._out.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=trainer.global_step + total, initial=trainer.global_step, desc="step", file=self._out,
                dynamic_ncols=True, leave=True, bar_format="{desc} {n_fmt}/{total_fmt} {bar:30} [{elapsed}<{remaining}]{postfix}",
            )  # fmt: skip
            self._bar_safe = console.route_yatt_logger(_AboveTheBar(self._bar, self._out))

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.progress_bar_metrics
        if "reward" in metrics:
            self._rewards.append(float(metrics["reward"]))
        if not (trainer.is_global_zero and self._enabled):
            return
        status = _status(metrics)
        step = trainer.global_step
        if self._bar is not None:
            self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(step - self._bar.n)
        elif (step - self._first_step) % self._every == 0 or step == self._last_step:
            self.print(f"[yatt] step {step}/{self._last_step}  {status}")

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._failed = exception
        self._close(trainer)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close(trainer)
        if self._failed is None and stage == "fit" and trainer.is_global_zero and self._enabled and self._started:
            self.print("\n".join(self.summary(trainer)))

    def _close(self, trainer) -> None:
        if self._bar_safe is not None:
            console.unroute_yatt_logger(self._bar_safe)
            self._bar_safe = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._capture is not None:  # before an error is shown: it goes to the terminal again
            self._capture.close()
            self._capture = None

    # ------------------------------------------------------------------ the summary
    def summary(self, trainer) -> list[str]:
        """The closing lines: steps, rewards, where the logs and checkpoints are, how to resume and export."""
        steps = trainer.global_step - self._first_step
        k = min(self.summary_window, len(self._rewards))
        took = time.perf_counter() - self._started
        stopped = next((cb.stopped_by for cb in trainer.callbacks if getattr(cb, "stopped_by", None)), None)
        how = f"stopped by {signal.Signals(stopped).name} after" if stopped else "done:"
        lines = [f"[yatt] {how} {steps} steps (now at step {trainer.global_step}), {took:.0f} s of training"]
        if k:
            first, last = statistics.mean(self._rewards[:k]), statistics.mean(self._rewards[-k:])
            lines.append(f"       mean reward: {first:.3f} over the first {k} steps, {last:.3f} over the last {k}")
        logger = trainer.logger
        if logger is not None and getattr(logger, "log_dir", None):
            root = Path(logger.log_dir).parent
            lines.append(f"       TensorBoard: tensorboard --logdir {root}   (this run: {logger.log_dir})")
        saver = _checkpoint_dir(trainer)
        if saver is not None:
            from yatt_lightning.checkpoint import folder as ckpt

            newest = ckpt.complete_checkpoints(saver)
            lines.append(f"       checkpoints: {saver}" + (f" (newest: {newest[0].name})" if newest else " (none yet)"))
            lines.append(f"       resume:      {resume_command(sys.argv[1:])}")
            lines.append(f"       export:      yatt export --ckpt_dir {saver} --out {saver.parent / 'hf'}")
        return lines

    @staticmethod
    def _total(trainer) -> int:
        if trainer.max_steps and trainer.max_steps > 0:
            return max(trainer.max_steps - trainer.global_step, 0)
        return int(trainer.estimated_stepping_batches)


class _AboveTheBar:
    """A stream for log lines that prints them above the progress bar instead of through it."""

    def __init__(self, bar, terminal: TextIO) -> None:
        self.bar, self.terminal = bar, terminal

    def write(self, text: str) -> None:
        if text.strip():
            self.bar.write(text.rstrip("\n"), file=self.terminal)

    def flush(self) -> None:
        self.terminal.flush()


def resume_command(argv: list[str]) -> str:
    """The command line that resumes this run: the same arguments with ``--ckpt_path last``."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--ckpt_path":
            skip = True
            continue
        if arg.startswith("--ckpt_path="):
            continue
        args.append(arg)
    return shlex.join(["yatt", *args, "--ckpt_path", "last"])


def _status(metrics: dict) -> str:
    parts = []
    if "reward" in metrics:
        parts.append(f"reward {float(metrics['reward']):.3f}")
    if "t_roll" in metrics:
        parts.append(f"rollout {float(metrics['t_roll']):.2f}s")
    if "t_train" in metrics:
        parts.append(f"train {float(metrics['t_train']):.2f}s")
    return "  ".join(parts)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _checkpoint_dir(trainer) -> Path | None:
    from yatt_lightning.callbacks.async_checkpoint import AsyncCheckpoint

    for cb in trainer.callbacks:
        if isinstance(cb, AsyncCheckpoint) and cb.dirpath is not None:
            return Path(cb.dirpath)
    return None
