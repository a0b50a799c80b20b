"""Does the tiny VLM learn to look? Reward before and after training, and on real versus shuffled images.

Runs ``configs/grpo_vlm_tiny.yaml`` (the built-in colour task, builtin:tiny-llava) in this process
through the CLI's trainer, then, with the trained policy, samples answers for held-out rows (a ColourTask
of another seed) twice: with each row's own image, and with the images shuffled among the rows (the
answers stay). A policy that reads the image scores high on the first and near chance on the second.

    python bench/vlm_learning.py [--smoke] [--steps 300] [--window 10] [--rows 128] [yatt overrides,
        e.g. --trainer.devices 2]

``--smoke``: 12 steps, windows of 3, 16 held-out rows.

Last line: ``vlm_reward_first10=<f> vlm_reward_last10=<l> real_images=<r> shuffled_images=<s>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from _common import REPO, build_cli, pop_smoke
from lightning.pytorch import Callback

CONFIG = str(REPO / "configs" / "grpo_vlm_tiny.yaml")


class HeldOut(Callback):
    """Per-step mean rewards (rank 0), then the held-out evaluation at the end of training (every rank)."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.rewards: list[float] = []
        self.real = self.shuffled = float("nan")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if outputs is not None:
            self.rewards.append(outputs["stats"].scalars["reward/mean"])

    def on_train_end(self, trainer, module) -> None:
        from yatt_lightning.datamodules.image_prompt import ImagePromptDataModule
        from yatt_lightning.datamodules.tasks import ColourTask

        held = ImagePromptDataModule(task=ColourTask(num_rows=self.num_rows, seed=12345), shuffle=False)
        held.setup("fit")
        dp, rank = trainer.strategy.data_parallel_size, trainer.strategy.data_parallel_rank
        rows = [held.dataset[i] for i in range(rank, self.num_rows, dp)]  # this rank's share
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
        shuffled = [dict(row, images=rows[j]["images"]) for row, j in zip(rows, order, strict=True)]
        means = []
        for part in (rows, shuffled):
            rollouts = module.rollout(part)
            means.append(float(module.reward(rollouts).total.mean()))
        t = torch.tensor(means, dtype=torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
            t /= torch.distributed.get_world_size()
        self.real, self.shuffled = t.tolist()


def main() -> None:
    argv = sys.argv[1:]
    smoke = pop_smoke(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12 if smoke else 300)
    p.add_argument("--window", type=int, default=3 if smoke else 10)
    p.add_argument("--rows", type=int, default=16 if smoke else 128)
    args, overrides = p.parse_known_args(argv)
    steps, window = args.steps, args.window
    probe = HeldOut(args.rows)
    cli = build_cli(["--trainer.max_steps", str(steps), *overrides], config=CONFIG)
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if not cli.trainer.is_global_zero:
        return
    first, last = statistics.mean(probe.rewards[:window]), statistics.mean(probe.rewards[-window:])
    print(f"| steps | first {window} | last {window} | held-out, real images | held-out, shuffled images |")
    print("|---|---|---|---|---|")
    print(f"| {steps} | {first:.3f} | {last:.3f} | {probe.real:.3f} | {probe.shuffled:.3f} |")
    print(
        f"vlm_reward_first{window}={first:.3f} vlm_reward_last{window}={last:.3f} "
        f"real_images={probe.real:.3f} shuffled_images={probe.shuffled:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
