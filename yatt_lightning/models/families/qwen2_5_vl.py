"""Qwen2.5-VL: transformers' vision transformer and merger in front of a Qwen2 decoder (QKV bias) whose rotary
embedding is multimodal (``text_config.rope_parameters.mrope_section``); the model is
:class:`~yatt_lightning.models.qwen_vl_model.QwenVisionLanguageModel`, the names
:data:`~yatt_lightning.models.families.vision_names.QWEN_VL_NAMES`."""

from __future__ import annotations

from dataclasses import replace

from yatt_lightning.models.families.family import KEY
from yatt_lightning.models.families.qwen2 import Qwen2
from yatt_lightning.models.families.registry import register
from yatt_lightning.models.families.vision_names import QWEN_VL_NAMES


@register
class Qwen2_5_VL(Qwen2):
    model_type = "qwen2_5_vl"
    vision_names = QWEN_VL_NAMES

    def arch(self, cfg):
        text = cfg.text_config
        where = f"`{KEY}` (qwen2_5_vl config.json)"
        section = dict(getattr(text, "rope_parameters", None) or {}).get("mrope_section")
        arch = super().arch(text)
        if not section or 2 * sum(section) != arch.head_dim or len(section) != 3:
            raise ValueError(
                f"{where}: text_config.rope_parameters.mrope_section {section!r} must be three numbers of rotary "
                f"channel pairs summing to head_dim / 2 ({arch.head_dim // 2})."
            )
        tied = bool(getattr(cfg, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
        return replace(arch, model_type=self.model_type, mrope_section=tuple(section), tie_word_embeddings=tied)

    def vision_model(self, hf_config, gpt, *, pre_process: bool):
        from yatt_lightning.models.qwen_vl_model import QwenVisionLanguageModel

        return QwenVisionLanguageModel(hf_config, gpt, pre_process=pre_process)
