"""Vision-language policies: Hugging Face's vision tower (and projector) in front of the Megatron GPT.

This module holds the weight names (loading, export), without importing Megatron, so that ``yatt export``
stays light; the models themselves are :class:`~yatt_lightning.models.vlm_model.VisionLanguageModel` (LLaVA)
and :class:`~yatt_lightning.models.qwen_vl_model.QwenVisionLanguageModel` (Qwen2-VL, Qwen2.5-VL).

Decision: the language model is Megatron-Core's GPT (tensor / pipeline parallel, the conversion of
:mod:`~yatt_lightning.models.convert`); the vision tower and the projector (LLaVA's CLIP, Qwen's ViT and
merger) are transformers' own modules, replicated on every tensor-parallel rank of the first pipeline stage,
as Megatron-Bridge does for Qwen2.5-VL. Their numerics are then transformers' and vLLM's by construction (no
second ViT to convert and keep in step), and their weights keep their Hugging Face names both ways. Megatron's
DDP and distributed optimizer train them with the rest (they are tagged as replicated, so the gradient norm
counts them once).

Sequences hold the model's image tokens expanded (as transformers' processor writes them: a fixed count per
image for LLaVA, one per merged patch of the image's grid for Qwen); the forward writes each image's features
over its placeholders. The rollout engine receives one placeholder per image and expands it itself.

How a family names its tensors is a :class:`VisionNames` (the family's ``vision_names``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from yatt_lightning.models import convert
from yatt_lightning.models.families.arch import HFArch
from yatt_lightning.models.families.vision_names import LLAVA_NAMES, VisionNames, published_name  # noqa: F401 (re-exported)

# The vision parts' module names in a policy: LLaVA's tower and projector, Qwen-VL's ViT with its merger.
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.")


def is_vision_language(hf_config) -> bool:
    return hasattr(hf_config, "vision_config")


def image_token_id(hf_config) -> int:
    """The image placeholder token of a vision-language model's ``config.json`` (LLaVA's ``image_token_index``,
    Qwen-VL's ``image_token_id``)."""
    return hf_config.image_token_index if hasattr(hf_config, "image_token_index") else hf_config.image_token_id


# ------------------------------------------------------------------------------------ weight names
def text_reader(get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """Read the language model's tensors under their text-model names (``model.layers.0...``, ``lm_head.weight``)
    from a vision-language checkpoint in any layout: ``language_model.model.*`` (published LLaVA, vLLM's),
    ``model.language_model.*`` (what transformers 5 writes) or the text names themselves (published Qwen2-VL
    and Qwen2.5-VL)."""

    def read(name: str) -> torch.Tensor:
        candidates = [f"language_model.{name}"]
        if name.startswith("model."):
            candidates.append("model.language_model." + name.removeprefix("model."))
        candidates.append(name)
        return _first(get, candidates)

    return read


def _first(get: Callable[[str], torch.Tensor], candidates: list[str]) -> torch.Tensor:
    for candidate in candidates:
        try:
            return get(candidate)
        except KeyError:
            continue
    raise KeyError(f"`model.policy.path`: no tensor {' or '.join(candidates)}")


def vision_reader(get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """Read a vision-tower or projector tensor by its module name, in either checkpoint layout
    (``vision_tower.vision_model.*`` / ``multi_modal_projector.*``, or the same under ``model.``)."""

    def read(name: str) -> torch.Tensor:
        published = published_name(name)
        return _first(get, list(dict.fromkeys([published, f"model.{published}", f"model.{name}", name])))

    return read


def load_vision_weights(model: torch.nn.Module, get: Callable[[str], torch.Tensor]) -> None:
    """The vision tower's and projector's weights, tagged as replicated over tensor parallelism."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    read = vision_reader(get)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(VISION_PREFIXES):
                set_tensor_model_parallel_attributes(param, False, -1, 1)
                param.copy_(read(name).to(param.dtype))


def export_names(
    name: str,
    full: torch.Tensor,
    arch: HFArch,
    layer_offset: int,
    grouped: bool = False,
    names: VisionNames = LLAVA_NAMES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (vLLM) names for one full tensor of a vision-language policy: the vision parts keep their
    module names, the language model's get the family's prefix (``names``)."""
    if name.startswith(VISION_PREFIXES):
        yield names.vision(name), full
        return
    text_name = name.removeprefix("language_model.")
    for hf_name, tensor in convert.megatron_to_hf(text_name, full, arch, layer_offset, grouped):
        yield names.text(hf_name), tensor
