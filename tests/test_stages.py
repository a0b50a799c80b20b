"""Stages other than RL on the same strategy and CLI: SFT, then GRPO from its exported checkpoint."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, read_scalars, yatt


@pytest.mark.slow
def test_sft_learns_the_task_and_grpo_starts_from_its_export(tmp_path):
    """``yatt fit`` of configs/sft_tiny.yaml (60 steps, no engine) cuts its loss by more than 4x; its checkpoint
    exports to a Hugging Face folder from which GRPO on the same task starts above 0.5 mean reward."""
    sft = tmp_path / "sft"
    yatt(["fit", "--config", str(REPO / "configs" / "sft_tiny.yaml"), "--trainer.default_root_dir", str(sft)], cwd=tmp_path)
    loss = [v for _, v in read_scalars(sft / "sft_tiny")["sft/loss"]]
    assert len(loss) == 60 and loss[-1] < loss[0] / 4, loss
    yatt(["export", "--ckpt_dir", str(sft / "sft_tiny" / "checkpoints"), "--out", str(tmp_path / "hf")], cwd=tmp_path)
    rl = tmp_path / "rl"
    yatt(["fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--trainer.max_steps", "3",
          "--model.init_args.policy.path", str(tmp_path / "hf"), "--trainer.default_root_dir", str(rl)], cwd=tmp_path)  # fmt: skip
    rewards = [v for _, v in read_scalars(rl / "grpo_tiny")["reward/mean"]]
    assert min(rewards) > 0.5, rewards
