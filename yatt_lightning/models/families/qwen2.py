"""Qwen2 / Qwen2.5: the Llama block with a bias on q, k and v; sliding windows from ``layer_types``."""

from yatt_lightning.models.families.family import DecoderFamily
from yatt_lightning.models.families.registry import register


@register
class Qwen2(DecoderFamily):
    model_type = "qwen2"

    def qkv_bias(self, cfg) -> bool:
        return True
