"""Does every algorithm of the library learn? The docs' algorithm table, printed by this script.

Trains each algorithm's tiny config (``configs/<name>_tiny.yaml``: GRPO, PPO with its critic, RLOO,
REINFORCE++, DAPO, GSPO, Dr. GRPO) on the built-in alphabet task with the real CLI's trainer, one after
another in this process (one torch thread; imports and the first start-up are paid once, each config
builds its own Trainer, model and engine), and reads each run's per-step mean *task* reward (the alphabet
reward's own mean, ``reward/<fn>/mean``: DAPO's overlong penalty is left out, so every row measures the
same thing) from its TensorBoard event file. Every config runs its own number of steps (150 RL steps;
PPO and GSPO take two optimizer steps per RL step). Prints a Markdown table: the paper, the YAML that
selects the algorithm, the mean task reward of the first and last ``--window`` RL steps, the gain, and
the wall time of the run's ``fit``.

    python bench/algorithms.py [--smoke] [--only NAME ...] [--window 10]

``--smoke``: every config for 20 RL steps, windows of 5 (the test's size: tests/test_benches.py; at 20 steps the
smallest gain measured was DAPO's, +0.077, 2026-12-05).

An algorithm *learned* when its last-window mean exceeds its first-window mean by more than ``--margin``
(0.2 at full size; the smoke's margin is 0.05). Last line: ``algorithms_learned=<k>/<n>``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import REPO, build_cli

TASK_REWARD = "reward/yatt_lightning.rewards.rules.alphabet_reward/mean"

# name -> (paper, what the YAML selects)
ALGORITHMS = {
    "grpo": ("Shao et al. 2024 (DeepSeekMath)", "`GRPOAdvantage` + `PPOClipLoss`"),
    "ppo": ("Schulman et al. 2017; GAE: 2016", "`GAE` + `critic: {...}` + `PPOClipLoss(dual_clip: 3)`"),
    "rloo": ("Ahmadian et al. 2024", "`RLOOAdvantage`"),
    "reinforce_pp": ("Hu 2025", "`ReinforcePlusPlus` + `kl_in_reward: true` (k1)"),
    "dapo": ("Yu et al. 2025", "`clip_eps_high: 0.28` + `dynamic_sampling` + `OverlongPenalty` + `TruncatedIS`"),
    "gspo": ("Zheng et al. 2025", "`GSPOLoss` + `SequenceMean`"),
    "drgrpo": ("Liu et al. 2025", "`GRPOAdvantage(normalize_std: false)` + `ConstantNormalizer`"),
}


def task_rewards(log_dir: Path) -> list[float]:
    """The task reward's mean per RL step, from the run's TensorBoard event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(log_dir.rglob("events.out.tfevents.*"))
    if not files:
        raise RuntimeError(f"no TensorBoard event file under {log_dir}")
    acc = EventAccumulator(str(files[-1]), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars(TASK_REWARD), key=lambda e: e.step)]


def optimizer_steps_per_rl_step(config: Path) -> int:
    """``mini_batches x ppo_epochs`` of the config; a key it leaves out has RLHFModule's default."""
    import inspect

    import yaml

    from yatt_lightning.module import RLHFModule

    keys = ("mini_batches", "ppo_epochs")
    defaults = {k: inspect.signature(RLHFModule).parameters[k].default for k in keys}
    init = {**defaults, **yaml.safe_load(config.read_text())["model"]["init_args"]}
    return int(init["mini_batches"]) * int(init["ppo_epochs"])


def run(name: str, rl_steps: int | None, root: Path) -> tuple[list[float], float]:
    """Train ``configs/<name>_tiny.yaml`` (its own steps, or ``rl_steps``); its task rewards and fit time."""
    config = REPO / "configs" / f"{name}_tiny.yaml"
    extra = [] if rl_steps is None else ["--trainer.max_steps", str(rl_steps * optimizer_steps_per_rl_step(config))]
    cli = build_cli(["--trainer.default_root_dir", str(root), *extra], logger=True, config=str(config))
    t0 = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return task_rewards(root), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--only", nargs="*", default=None, help="algorithms to run (default: all)")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--margin", type=float, default=0.2)
    args = p.parse_args()
    names = args.only or list(ALGORITHMS)
    rl_steps = None
    if args.smoke:
        rl_steps, args.window, args.margin = 20, 5, 0.05
    learned = 0
    print(f"| algorithm | paper | YAML selects | first {args.window} steps | last {args.window} steps | gain | wall |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rewards, wall = run(name, rl_steps, Path(tmp) / name)
            first, last = statistics.mean(rewards[: args.window]), statistics.mean(rewards[-args.window :])
            gain = last - first
            learned += gain > args.margin
            paper, selects = ALGORITHMS[name]
            print(f"| {name} (`configs/{name}_tiny.yaml`) | {paper} | {selects} | {first:.3f} | {last:.3f} | "
                  f"{gain:+.3f} | {wall:.0f} s |", flush=True)  # fmt: skip
    print(f"algorithms_learned={learned}/{len(names)}", flush=True)


if __name__ == "__main__":
    main()
