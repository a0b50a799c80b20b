"""Does the tiny default config learn? The README's learning table, printed by this script.

Runs ``yatt fit --config configs/grpo_tiny.yaml`` (150 steps) with seeds 0, 1 and 2 on one process
and with seed 0 on two data-parallel processes, through the real CLI, and reads each run's mean reward
per step from its TensorBoard event file. Prints the table (mean reward of the first and last 10 steps,
wall time including start-up) as Markdown.

    python bench/learning.py [--smoke] [--steps 150] [--window 10]

``--smoke``: one run of 12 steps, windows of 3.

Last line: ``learning_min_margin=<smallest last-window minus first-window mean over the runs>``; the
README states the margin it promises (0.45 at 150 steps).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "`--seed_everything 0`": ["--seed_everything", "0"],
    "`--seed_everything 1`": ["--seed_everything", "1"],
    "`--seed_everything 2`": ["--seed_everything", "2"],
    "`--trainer.devices 2` (data parallel)": ["--seed_everything", "0", "--trainer.devices", "2"],
}


def rewards(log_dir: Path) -> list[float]:
    """Mean reward per step, from the run's TensorBoard event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(log_dir.rglob("events.out.tfevents.*"))
    if not files:
        sys.exit(f"no TensorBoard event file under {log_dir}")
    acc = EventAccumulator(str(files[-1]), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars("reward/mean"), key=lambda e: e.step)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    runs = RUNS
    if args.smoke:
        args.steps, args.window = 12, 3
        runs = dict(list(RUNS.items())[:1])
    margins = []
    print(f"| run | mean reward, first {args.window} steps | last {args.window} steps | wall time |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(runs.items()):
            root = Path(tmp) / str(i)
            cmd = [sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
                   "--trainer.max_steps", str(args.steps), "--trainer.default_root_dir", str(root),
                   "--trainer.callbacks", "[]", *extra]  # fmt: skip
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=1800)
            wall = time.perf_counter() - t0
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
            r = rewards(root)
            if len(r) != args.steps:
                sys.exit(f"{name}: {len(r)} logged steps, expected {args.steps}")
            first, last = statistics.mean(r[: args.window]), statistics.mean(r[-args.window :])
            margins.append(last - first)
            print(f"| {name} | {first:.3f} | {last:.3f} | {wall:.0f} s |", flush=True)
    print(f"learning_min_margin={min(margins):.3f}", flush=True)


if __name__ == "__main__":
    main()
