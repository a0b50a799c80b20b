"""Mistral: the Llama block; ``sliding_window`` (every layer) trained as a window, as transformers and the
engine attend."""

from yatt_lightning.models.families.family import DecoderFamily
from yatt_lightning.models.families.registry import register


@register
class Mistral(DecoderFamily):
    model_type = "mistral"
