"""Model families, one file each, registered by Hugging Face ``model_type`` (:mod:`.registry`); what a family
holds is :mod:`.family`, its weight table :mod:`.weights`."""

from yatt_lightning.models.families import llama, llava, mistral, qwen2, qwen2_5_vl, qwen3, qwen3_moe  # noqa: F401 (registers)
from yatt_lightning.models.families.registry import (
    arch_of,
    family_for,
    family_named,
    register,
    registered,
    weight_table,
)

__all__ = ["arch_of", "family_for", "family_named", "register", "registered", "weight_table"]
