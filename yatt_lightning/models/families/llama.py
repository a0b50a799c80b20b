"""Llama 2 and Llama 3.x: the Llama block; Llama 3.1-3.3's ``llama3`` rope scaling (and ``linear``) through
transformers' own frequencies (:class:`~yatt_lightning.models.families.family.DecoderFamily`)."""

from yatt_lightning.models.families.family import DecoderFamily
from yatt_lightning.models.families.registry import register


@register
class Llama(DecoderFamily):
    model_type = "llama"
