"""How a policy's Megatron tensors become the Hugging Face tensors a rollout engine loads.

:class:`HFNames` is the conversion of one full (TP-gathered) Megatron tensor, as a small picklable value: the
policy's own export applies it on the trainer, and a trainer that publishes its parameters as they are (a
model-parallel group of one) sends it once with the index, so that the rollout rank applies it to the
received tensors (the split of a fused QKV weight into q, k and v is then the rollout rank's copy, into
buffers it reuses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yatt_lightning.models import convert, vlm
from yatt_lightning.models.families.arch import HFArch


@dataclass(frozen=True)
class HFNames:
    """Megatron name and full tensor -> Hugging Face (name, tensor) pairs (views where the layout allows)."""

    arch: HFArch
    vision: vlm.VisionNames | None = None  # a vision-language policy: how its family names the tensors
    layer_offset: int = 0

    def __call__(self, name: str, full: torch.Tensor, grouped: bool = False) -> list[tuple[str, torch.Tensor]]:
        """``grouped``: q, k and v as views of the fused tensor by query group (one dimension more than it),
        which the caller flattens (:func:`~yatt_lightning.models.convert.split_qkv`)."""
        if self.vision is not None:
            return list(vlm.export_names(name, full, self.arch, self.layer_offset, grouped, self.vision))
        return convert.megatron_to_hf(name, full, self.arch, self.layer_offset, grouped)
