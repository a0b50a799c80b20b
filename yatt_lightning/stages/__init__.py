"""Post-training stages other than RL on the same strategy, policy, checkpoints and CLI: SFT and DPO
(on-policy distillation runs inside the RL step: :class:`~yatt_lightning.rewards.teacher.TeacherKL`)."""

from yatt_lightning.stages.dpo import DPOModule
from yatt_lightning.stages.preference import IPOLoss, PreferenceLoss, SigmoidLoss
from yatt_lightning.stages.sft import SFTModule

__all__ = ["DPOModule", "IPOLoss", "PreferenceLoss", "SFTModule", "SigmoidLoss"]
