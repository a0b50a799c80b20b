"""Shared pieces of the bench scripts: build a trainer from the real CLI with extra callbacks."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "grpo_tiny.yaml")


def build_cli(overrides: list[str], *, logger: bool = False, config: str = TINY):
    """A YattCLI (not yet run) for ``config`` (the tiny one by default) with ``overrides``; checkpointing off."""
    import os

    import torch

    from yatt_lightning.run.cli import YattCLI
    from yatt_lightning.run.logging_setup import configure_logging

    configure_logging()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = ["--config", config, "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false"]
    if not logger:
        args += ["--trainer.logger", "false"]
    return YattCLI(args=args + overrides, run=False)


def all_reduce_max(values: list[float]) -> list[float]:
    import torch

    t = torch.tensor(values, dtype=torch.float64).nan_to_num(nan=-1.0)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def pop_smoke(argv: list[str]) -> bool:
    """Remove ``--smoke`` from ``argv`` (in place); True if it was there. Every bench has a smoke size that a
    test runs (tests/test_benches.py), so that none can rot."""
    if "--smoke" in argv:
        argv.remove("--smoke")
        return True
    return False


def yatt(*args: str, cwd: Path) -> None:
    """The real ``yatt`` command in a new process; its last output lines if it fails."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "yatt_lightning.run.cli", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"`yatt {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def fit(config: str, root: Path, *overrides: str) -> dict[str, list[float]]:
    """``yatt fit`` of configs/<config>.yaml into ``root``; its scalars by tag, in step order."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    start = time.perf_counter()
    yatt("fit", "--config", str(REPO / "configs" / f"{config}.yaml"), "--trainer.default_root_dir", str(root),
         *overrides, cwd=root.parent)  # fmt: skip
    print(f"  {config} {' '.join(overrides)}: {time.perf_counter() - start:.0f} s", flush=True)
    (events,) = sorted(root.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.step)] for tag in acc.Tags()["scalars"]}
