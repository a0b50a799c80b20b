"""The best checkpoint by a validation figure (:class:`~yatt_lightning.callbacks.AsyncCheckpoint`'s ``keep_best``).

After each validation the figure is offered; a better one makes its step the best, which the callback saves
(or finds already saved). Once that checkpoint is complete, the ``best`` file in the checkpoint folder names it
(written whole, then renamed into place, as ``latest`` is), and ``keep_last`` never deletes it while it is the
best.
"""

from __future__ import annotations

import os
from pathlib import Path


class BestCheckpoint:
    """Args:
    figure: The validation figure (``val/...``).
    mode: ``max`` (higher is better) or ``min``.
    """

    def __init__(self, figure: str, mode: str) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"`AsyncCheckpoint.best_mode` must be 'max' or 'min', got {mode!r}.")
        if not figure.startswith("val/"):
            raise ValueError(f"`AsyncCheckpoint.keep_best` names a validation figure (val/...), got {figure!r}.")
        self.figure, self.mode = figure, mode
        self.step: int | None = None
        self.value: float | None = None

    def offer(self, value: float, step: int) -> bool:
        """Whether ``value`` at ``step`` is the best so far (then it is)."""
        if self.value is not None and not (value > self.value if self.mode == "max" else value < self.value):
            return False
        self.step, self.value = step, value
        return True

    def saved(self, folder: Path, step: int) -> None:
        """The checkpoint of ``step`` is complete in ``folder``: name it in ``best`` if it is the best (rank 0)."""
        if step == self.step:
            name = folder.name
            tmp = folder.parent / "best.tmp"
            tmp.write_text(name + "\n")
            os.replace(tmp, folder.parent / "best")

    def protected(self, dirpath: Path, name) -> Path | None:
        """The best checkpoint's folder (``name``: a step's folder name), which ``keep_last`` keeps."""
        return dirpath / name(self.step) if self.step is not None else None

    def state_dict(self) -> dict:
        return {"step": self.step, "value": self.value}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.step, self.value = state["step"], state["value"]
