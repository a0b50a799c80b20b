"""LLaVA: a CLIP vision tower and projector (transformers' modules) in front of a registered text family's
decoder (its ``text_config``); its names are :data:`~yatt_lightning.models.families.vision_names.LLAVA_NAMES`."""

from yatt_lightning.models.families.registry import family_for, register
from yatt_lightning.models.families.vision_names import LLAVA_NAMES

SUPPORTED_TEXT = ("qwen2", "llama", "mistral")


@register
class Llava:
    model_type = "llava"
    vision_names = LLAVA_NAMES

    def arch(self, cfg):
        text = cfg.text_config
        if text.model_type not in SUPPORTED_TEXT:
            raise ValueError(
                f"`model.policy.path`: LLaVA's text_config.model_type {text.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_TEXT)}."
            )
        return family_for(text).arch(text)

    def vision_model(self, hf_config, gpt, *, pre_process: bool):
        from yatt_lightning.models.vlm_model import VisionLanguageModel

        return VisionLanguageModel(hf_config, gpt, pre_process=pre_process)
