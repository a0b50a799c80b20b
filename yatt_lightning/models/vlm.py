"""A LLaVA-family vision-language policy: Hugging Face's vision tower and projector in front of the Megatron GPT.

This module holds the weight names (loading, export), without importing Megatron, so that ``yatt export``
stays light; the model itself is :class:`~yatt_lightning.models.vlm_model.VisionLanguageModel`.

Decision: the language model is Megatron-Core's GPT (tensor / pipeline parallel, the conversion of
:mod:`~yatt_lightning.models.convert`); the CLIP vision tower and the projector are transformers' own
modules, replicated on every tensor-parallel rank of the first pipeline stage, as Megatron-Bridge does for
Qwen2.5-VL. Their numerics are then transformers' and vLLM's by construction (no second ViT to convert and
keep in step), and their weights keep their Hugging Face names both ways. Megatron's DDP and distributed
optimizer train them with the rest (they are tagged as replicated, so the gradient norm counts them once).

Sequences hold the model's image tokens expanded (``image_seq_length`` placeholders per image, as
transformers' processor writes them); the forward writes each image's projected features over its
placeholders. The rollout engine receives one placeholder per image and expands it itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from yatt_lightning.models import convert
from yatt_lightning.models.families.arch import HFArch

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def is_vision_language(hf_config) -> bool:
    return hasattr(hf_config, "vision_config")


# ------------------------------------------------------------------------------------ weight names
def text_reader(get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """Read the language model's tensors under their text-model names (``model.layers.0...``, ``lm_head.weight``)
    from a LLaVA checkpoint in either layout: ``language_model.model.*`` (the published one, vLLM's) or
    ``model.language_model.*`` (what transformers 5 writes)."""

    def read(name: str) -> torch.Tensor:
        candidates = [f"language_model.{name}"]
        if name.startswith("model."):
            candidates.append("model.language_model." + name.removeprefix("model."))
        else:
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


def published_name(module_name: str) -> str:
    """The name published LLaVA checkpoints (and vLLM) give a vision-tower or projector parameter:
    ``vision_tower.vision_model.*`` for the tower (transformers 5's module is ``vision_tower.*``)."""
    if module_name.startswith("vision_tower.") and not module_name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + module_name.removeprefix("vision_tower.")
    return module_name


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
    name: str, full: torch.Tensor, arch: HFArch, layer_offset: int, grouped: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (vLLM) names for one full tensor of a :class:`~yatt_lightning.models.vlm_model.VisionLanguageModel`: the vision parts keep
    their names, the language model's get the ``language_model.`` prefix of published LLaVA checkpoints."""
    if name.startswith(VISION_PREFIXES):
        yield published_name(name), full
        return
    text_name = name.removeprefix("language_model.")
    for hf_name, tensor in convert.megatron_to_hf(text_name, full, arch, layer_offset, grouped):
        yield f"language_model.{hf_name}", tensor
