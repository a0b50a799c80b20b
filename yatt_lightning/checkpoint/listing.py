"""Which checkpoints a folder holds, in step order, and which one its ``latest`` tracker names (reading only)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from yatt_lightning.checkpoint.verify import MANIFEST

TRACKER = "latest"


def step_of_name(name: str) -> int | None:
    """The step in a checkpoint folder's name (``step-00000020`` -> 20; Lightning's ``epoch=0-step=2.ckpt``
    -> 2), or ``None``."""
    m = re.search(r"step[-=](\d+)", name)
    return int(m.group(1)) if m else None


def read_manifest(folder: Path) -> dict | None:
    """The manifest of ``folder``, or ``None`` when it is missing or unreadable."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def checkpoint_step(folder: Path) -> int:
    """The step a checkpoint holds: its manifest's record (its folder name for checkpoints written before
    manifests recorded it)."""
    manifest = read_manifest(folder) or {}
    step = manifest.get("step")
    return int(step) if isinstance(step, int) else (step_of_name(Path(folder).name) or 0)


def run_id_of(folder: Path) -> str | None:
    """The id of the run that wrote ``folder`` (``None`` when unknown)."""
    return (read_manifest(folder) or {}).get("run_id")


def complete_checkpoints(directory: Path, run_id: str | None = None) -> list[Path]:
    """Checkpoint folders in ``directory`` that have a manifest, highest step first (by the step the
    manifest records, not file times); with ``run_id``, only that run's."""
    found = [p for p in Path(directory).glob("step-*") if p.is_dir() and p.name.count(".") == 0]
    complete = [p for p in found if (p / MANIFEST).is_file()]
    if run_id is not None:
        complete = [p for p in complete if run_id_of(p) == run_id]
    return sorted(complete, key=lambda p: (checkpoint_step(p), p.name), reverse=True)


def resume_target(directory: Path) -> Path | None:
    """What ``--ckpt_path last`` loads from ``directory``: its ``latest`` tracker (the strategy then picks
    the newest intact checkpoint from there), or ``None`` when no checkpoint was completed yet."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    if (directory / TRACKER).is_file() or complete_checkpoints(directory):
        return directory / TRACKER
    return None


def tracked(directory: Path) -> Path | None:
    """The checkpoint the ``latest`` tracker names, if any."""
    tracker = Path(directory) / TRACKER
    return Path(directory) / tracker.read_text().strip() if tracker.is_file() else None
