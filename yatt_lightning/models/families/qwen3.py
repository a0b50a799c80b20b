"""Qwen3 (dense): the Llama block without a QKV bias, with an RMSNorm over each head's query and key before
the rotary embedding (Megatron's ``qk_layernorm``)."""

from yatt_lightning.models.families.family import DecoderFamily
from yatt_lightning.models.families.registry import register
from yatt_lightning.models.families.weights import QK_NORM_ROWS


@register
class Qwen3(DecoderFamily):
    model_type = "qwen3"
    qk_norm = True

    def rows(self, arch) -> list:
        return super().rows(arch) + QK_NORM_ROWS
