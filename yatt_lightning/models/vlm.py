"""A LLaVA-family vision-language policy: Hugging Face's vision tower and projector in front of the Megatron GPT.

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
from yatt_lightning.models.gpt import HFArch

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def is_vision_language(hf_config) -> bool:
    return hasattr(hf_config, "vision_config")


def _megatron_module() -> type:
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class VisionLanguageModel(_megatron_module()):
    """One pipeline stage of a LLaVA: on the first stage the vision tower and projector, then the GPT.
    A ``MegatronModule``, so its sharded checkpoint holds the GPT's shards and the replicated vision parts."""

    def __init__(self, hf_config, gpt: torch.nn.Module, *, pre_process: bool) -> None:
        super().__init__(config=gpt.config)
        if hf_config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                f"`model.policy.path`: vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r}"
            )
        if not isinstance(hf_config.vision_feature_layer, int):
            raise ValueError("`model.policy.path`: a list of vision_feature_layer values is not supported yet.")
        self.language_model = gpt
        self.pre_process = pre_process
        self.image_token_id = hf_config.image_token_index
        self.feature_layer = hf_config.vision_feature_layer
        self.drop_class_token = hf_config.vision_feature_select_strategy == "default"
        if pre_process:
            from transformers import CLIPVisionModel
            from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

            if hf_config.vision_config.model_type != "clip_vision_model":
                raise ValueError(
                    f"`model.policy.path`: vision tower {hf_config.vision_config.model_type!r} is not supported yet "
                    "(CLIP ViT only)."
                )
            self.vision_tower = CLIPVisionModel(hf_config.vision_config)
            self.multi_modal_projector = LlavaMultiModalProjector(hf_config)

    # What Megatron's schedules and gradient finalisation look up on the model they run.
    @property
    def model_type(self) -> object:
        return self.language_model.model_type

    @property
    def post_process(self) -> bool:
        return self.language_model.post_process

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, tensor) -> None:
        self.language_model.set_input_tensor(tensor)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, tokens per image, hidden]`` from ``[images, 3, H, W]``, as transformers' LLaVA computes them."""
        hidden = self.vision_tower(pixel_values.to(self.vision_tower.dtype), output_hidden_states=True).hidden_states
        selected = hidden[self.feature_layer]
        if self.drop_class_token:
            selected = selected[:, 1:]
        return self.multi_modal_projector(selected)

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        pixel_values: torch.Tensor | None = None,
        prompt_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``prompt_lengths [b]``: image placeholders count only in each sample's prompt (a completion that
        samples the image token has it as an ordinary token, as in the engine); ``None``: anywhere."""
        if not self.pre_process:
            return self.language_model(input_ids, position_ids, attention_mask)
        if pixel_values is None:
            if bool((input_ids == self.image_token_id).any()):
                raise ValueError("a micro-batch holds image placeholder tokens but no pixel_values")
            return self.language_model(input_ids, position_ids, attention_mask)
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
        placeholders = input_ids == self.image_token_id  # [b, s]; images in sample order, then position
        if prompt_lengths is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            placeholders &= positions[None, :] < prompt_lengths.to(input_ids.device)[:, None]
        features = self.image_features(pixel_values).reshape(-1, embeddings.shape[-1]).to(embeddings.dtype)
        if int(placeholders.sum()) != features.shape[0]:
            raise ValueError(
                f"a micro-batch holds {int(placeholders.sum())} image placeholder tokens for {pixel_values.shape[0]} "
                f"images of {features.shape[0] // max(pixel_values.shape[0], 1)} tokens each"
            )
        by_sample = embeddings.transpose(0, 1).clone()
        by_sample[placeholders] = features
        return self.language_model(input_ids, position_ids, attention_mask, decoder_input=by_sample.transpose(0, 1))


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


def load_vision_weights(model: VisionLanguageModel, get: Callable[[str], torch.Tensor]) -> None:
    """The vision tower's and projector's weights, tagged as replicated over tensor parallelism."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    read = vision_reader(get)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(VISION_PREFIXES):
                set_tensor_model_parallel_attributes(param, False, -1, 1)
                param.copy_(read(name).to(param.dtype))


def export_names(name: str, full: torch.Tensor, arch: HFArch, layer_offset: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (vLLM) names for one full tensor of a :class:`VisionLanguageModel`: the vision parts keep
    their names, the language model's get the ``language_model.`` prefix of published LLaVA checkpoints."""
    if name.startswith(VISION_PREFIXES):
        yield published_name(name), full
        return
    for hf_name, tensor in convert.megatron_to_hf(name.removeprefix("language_model."), full, arch, layer_offset):
        yield f"language_model.{hf_name}", tensor
