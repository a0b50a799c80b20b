"""StepLogger: the one place a step's statistics are written (TensorBoard and the progress bar).

``RLHFModule.training_step`` returns the step's :class:`~yatt_lightning.training.step_metrics.StepStats` (already
reduced over ranks); this callback logs its scalars through Lightning's loggers, gives the progress bar
its figures, and writes a few completions as a table to every logger that takes one (TensorBoard's Text
tab, a W&B table, an MLflow artifact: :mod:`yatt_lightning.trackers`) every ``log_every_n_steps``. The module adds it (``configure_callbacks``), so every run has it.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from typing_extensions import override

from yatt_lightning.trackers import log_samples


class StepLogger(Callback):
    """Writes each step's :class:`~yatt_lightning.training.step_metrics.StepStats`."""

    def __init__(self) -> None:
        self.steps = 0  # RL steps ended (with or without an update): the step Lightning logs scalars at

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = outputs.get("stats") if isinstance(outputs, dict) else None
        step, self.steps = self.steps, self.steps + 1
        if stats is None:
            return
        pl_module.log_dict(
            stats.scalars, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=stats.samples_count
        )
        pl_module.log_dict(
            stats.progress, prog_bar=True, logger=False, on_step=True, on_epoch=False, rank_zero_only=True
        )
        if stats.samples and trainer.is_global_zero and not step % trainer.log_every_n_steps:
            log_samples(trainer.loggers, "rollout/samples", stats.samples, step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = state_dict["steps"]
