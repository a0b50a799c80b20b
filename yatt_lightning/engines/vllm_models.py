"""Weight names vLLM's own model classes do not map: what an engine needs to load folders as transformers writes them.

transformers 5.19's ``save_pretrained`` of a LLaVA writes the CLIP tower as ``vision_tower.*`` (the tower
module lost its ``vision_model`` level), where vLLM's LLaVA (and every checkpoint written by transformers
4) has ``vision_tower.vision_model.*``; vLLM 0.32 stops at engine start (``There is no module or parameter
named 'vision_tower.embeddings'``). Decision: tell vLLM how to map the names, never rewrite the user's
folder and never keep a converted copy: a subclass of vLLM's class whose weight mapper
(``hf_to_vllm_mapper``) adds the missing level, registered under its own architecture name and selected
with ``hf_overrides``. Every layout loads through it (``vision_tower.*`` and ``vision_tower.vision_model.*``,
each also under ``model.``; ``language_model.model.*`` and ``model.language_model.*``), and so do the
names a weight push sends (vLLM's own).
"""

from __future__ import annotations

import re
from typing import Any

LLAVA = "LlavaForConditionalGeneration"
YATT_LLAVA = "YattLlavaForConditionalGeneration"


def engine_overrides(hf_config: Any) -> dict:
    """Extra ``vllm.LLM`` arguments for a model of ``hf_config`` (its ``config.json``): none for most."""
    if list(getattr(hf_config, "architectures", None) or []) != [LLAVA]:
        return {}
    _register_llava()
    return {"hf_overrides": {"architectures": [YATT_LLAVA]}}


def _register_llava() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.llava import LlavaForConditionalGeneration
    from vllm.model_executor.models.utils import WeightsMapper

    if YATT_LLAVA in ModelRegistry.get_supported_archs():
        return

    class YattLlavaForConditionalGeneration(LlavaForConditionalGeneration):
        """vLLM's LLaVA, loading the vision tower under either of transformers' names."""

        # Applied before the class's own prefixes, which then drop a leading ``model.``.
        hf_to_vllm_mapper = (
            WeightsMapper(orig_to_new_regex={re.compile(r"^(model\.)?vision_tower\.(?!vision_model\.)"): r"\1vision_tower.vision_model."})
            | LlavaForConditionalGeneration.hf_to_vllm_mapper
        )  # fmt: skip

    ModelRegistry.register_model(YATT_LLAVA, YattLlavaForConditionalGeneration)
