"""Post-training stages other than RL on the same strategy, policy, checkpoints and CLI (issue 24, WIP)."""

from yatt_lightning.stages.sft import SFTModule

__all__ = ["SFTModule"]
