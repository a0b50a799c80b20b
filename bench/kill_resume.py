"""Kill a training run at random moments, resume it, repeat: is a reported checkpoint ever lost or broken?

A `yatt fit` run of the tiny config saves asynchronously every step (a step takes ~0.3 s, a save is in
flight for ~0.1 s of it). The bench SIGKILLs the whole process group at a random moment, uniform over
``--window`` seconds from the moment the run starts training (so rollouts, updates, saves in flight and
their finalisation are all hit), checks the checkpoint the ``latest`` tracker names, and resumes with
``--ckpt_path last``; 20 times, then one last resume that runs to its end.

- resumed: kills after which the next run loaded a checkpoint and trained.
- lost_saved_steps: checkpoints a run had reported as saved ("checkpoint saved: step N") newer than the one
  the next run resumed from.
- corrupt_loaded: resumes that found the tracked checkpoint failing verification, or failed to load it.

    python bench/kill_resume.py [--kills 20] [--window 14] [--seed 0]

Last line: ``kills=20 resumed=<n> lost_saved_steps=<n> corrupt_loaded=<n>``; target: resumed=20, 0, 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, kill_after: float | None) -> tuple[str, bool]:
    """Run ``cmd`` in its own session; SIGKILL the session ``kill_after`` seconds after it starts training
    (its rollout engine is up). Returns (log, killed)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "rollout engine started" in line:
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed = False
    if kill_after is not None:
        training.wait(timeout=300)
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
    proc.wait()
    reader.join(timeout=10)
    return "".join(lines), killed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--window", type=float, default=14.0, help="kill within this many seconds of each start")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    sys.path.insert(0, str(REPO))
    from yatt_lightning import checkpoint as ckpt

    resumed = lost = corrupt = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        saver = json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
                             "init_args": {"every_n_steps": 1, "dirpath": str(tmp / "ckpts"), "keep_last": 3}}])  # fmt: skip
        base = [sys.executable, "-m", "yatt_lightning.cli", "fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
                "--trainer.callbacks", saver, "--trainer.enable_checkpointing", "false", "--trainer.logger", "false",
                "--ckpt_path", "last"]  # fmt: skip
        reported: list[int] = []  # steps reported saved so far
        for i in range(args.kills + 1):
            last_run = i == args.kills
            latest = ckpt.tracked(tmp / "ckpts") if (tmp / "ckpts").exists() else None
            bad = bool(latest and ckpt.verify(latest))
            start_step = int(latest.name.split("-")[1]) if latest else 0
            max_steps = start_step + 3 if last_run else 100_000
            delay = None if last_run else rng.uniform(0.0, args.window)
            log, killed = _run([*base, "--trainer.max_steps", str(max_steps)], tmp, delay)
            if i > 0:  # this run resumes the previous, killed one
                m = re.search(r"resuming from \S*step-(\d+)", log)
                got = int(m.group(1)) if m else 0
                lost += sum(1 for s in reported if s > got)
                failed = "CheckpointError" in log or ("Traceback" in log and not killed)
                corrupt += bad or failed
                trained = not failed and (killed or "`Trainer.fit` stopped" in log)
                resumed += trained and (m is not None or not reported)
                end = f"killed {delay:.2f}s into training" if killed else "finished"
                print(
                    f"run {i:2d}: resumed from step {got} (newest reported saved: {max(reported, default=None)}); {end}",
                    flush=True,
                )
            reported += [int(s) for s in re.findall(r"checkpoint saved: step (\d+)", log)]
            if not killed and not last_run:
                sys.exit(f"run {i} ended before it was killed:\n{log[-3000:]}")
    print(f"kills={args.kills} resumed={resumed} lost_saved_steps={lost} corrupt_loaded={corrupt}", flush=True)


if __name__ == "__main__":
    main()
