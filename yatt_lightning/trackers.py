"""What yatt writes to Lightning's loggers beyond ``log_metrics``: tables of samples, and figure names each takes.

A run logs to whatever ``--trainer.logger`` names (TensorBoard by default; W&B, MLflow, CSV, several at once).
Scalars go through Lightning's own calls; a table of samples has a different call in each tracker:

* TensorBoard: a markdown table as text (``add_text``);
* W&B: a ``wandb.Table`` (``WandbLogger.log_text``);
* MLflow: a markdown artifact ``<key>/step_<step>.md`` of the run;

another logger gets the scalars only. MLflow's metric names allow letters, digits and ``_ / . -`` and space:
``val/pass@4`` reaches it as ``val/pass_at_4`` (Lightning would drop the ``@`` and warn at every step).
"""

from __future__ import annotations

import re

COLUMNS = ["prompt", "completion", "reward"]


def _kind(logger) -> str:
    return type(logger).__name__


def mlflow_name(key: str) -> str:
    """``key`` as MLflow takes it: ``@`` spelt ``_at_``, any other character it refuses dropped."""
    return re.sub(r"[^a-zA-Z0-9_/. -]+", "", key.replace("@", "_at_"))


def log_figures(loggers, figures: dict[str, float], step: int) -> None:
    """``figures`` to every logger at ``step`` (called on global rank 0)."""
    for logger in loggers:
        named = {mlflow_name(k): v for k, v in figures.items()} if _kind(logger) == "MLFlowLogger" else figures
        logger.log_metrics(named, step=step)


def markdown(samples: list[tuple[str, str, float]]) -> str:
    lines = ["| prompt | completion | reward |", "|---|---|---|"]
    for prompt, completion, reward in samples:
        cells = [c.replace("|", "\\|").replace("\n", " ") for c in (prompt, completion)]
        lines.append(f"| {cells[0]} | {cells[1]} | {reward:.3f} |")
    return "\n".join(lines)


def log_samples(loggers, key: str, samples: list[tuple[str, str, float]], step: int) -> None:
    """A table of (prompt, completion, reward) rows to every logger that takes one (called on global rank 0)."""
    if not samples:
        return
    for logger in loggers:
        kind = _kind(logger)
        if kind == "WandbLogger":
            logger.log_text(key=key, columns=COLUMNS, data=[list(s) for s in samples], step=step)
        elif kind == "MLFlowLogger":
            logger.experiment.log_text(logger.run_id, markdown(samples), f"{mlflow_name(key)}/step_{step:08d}.md")
        elif hasattr(getattr(logger, "experiment", None), "add_text"):
            logger.experiment.add_text(key, markdown(samples), step)
