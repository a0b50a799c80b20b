"""How a vision-language family's folders (and vLLM) name its tensors, from the policy's module names: the
language model's (its text family's names under a prefix) and the vision parts' (their module names)."""

from __future__ import annotations

from dataclasses import dataclass


def published_name(module_name: str) -> str:
    """The name published LLaVA checkpoints (and vLLM) give a vision-tower or projector parameter:
    ``vision_tower.vision_model.*`` for the tower (transformers 5's module is ``vision_tower.*``)."""
    if module_name.startswith("vision_tower.") and not module_name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + module_name.removeprefix("vision_tower.")
    return module_name


@dataclass(frozen=True)
class VisionNames:
    """How one vision-language family's folder (and vLLM) name its tensors, from the policy's module names.

    ``text_prefix``: put in front of the language model's Hugging Face names (``model.layers.0...``); ``lm_head``:
    the output layer's name. The vision parts keep their module names (LLaVA's tower also gets ``vision_model.``,
    :func:`published_name`).
    """

    text_prefix: str
    lm_head: str = "lm_head.weight"

    def text(self, hf_name: str) -> str:
        return self.lm_head if hf_name == "lm_head.weight" else self.text_prefix + hf_name

    def vision(self, module_name: str) -> str:
        return published_name(module_name)


# Published LLaVA checkpoints (and vLLM): language_model.model.*, language_model.lm_head.*, vision_tower.vision_model.*
LLAVA_NAMES = VisionNames(text_prefix="language_model.", lm_head="language_model.lm_head.weight")
# Qwen2-VL / Qwen2.5-VL as published and as transformers 5.19's save_pretrained writes them (vLLM's names too):
# the text model's own (model.layers.*, lm_head.weight) and visual.*.
QWEN_VL_NAMES = VisionNames(text_prefix="")
