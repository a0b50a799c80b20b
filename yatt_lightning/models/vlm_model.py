"""A vision-language policy module: on the first pipeline stage the vision parts, then the Megatron GPT.
:class:`VisionFront` is what every such module shares (what Megatron's schedules look up, the placeholders,
writing features over them); :class:`VisionLanguageModel` is LLaVA's.

Design and weight names: :mod:`yatt_lightning.models.vlm`.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule


class VisionFront(MegatronModule):
    """The vision parts of a vision-language policy in front of its Megatron GPT (``language_model``). A
    ``MegatronModule``, so its sharded checkpoint holds the GPT's shards and the replicated vision parts."""

    def __init__(self, gpt: torch.nn.Module, *, pre_process: bool, image_token_id: int) -> None:
        super().__init__(config=gpt.config)
        self.language_model = gpt
        self.pre_process = pre_process
        self.image_token_id = image_token_id

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

    def placeholders(self, input_ids: torch.Tensor, prompt_lengths: torch.Tensor | None) -> torch.Tensor:
        """``[b, s]``: where image features go. ``prompt_lengths [b]``: placeholders count only in each
        sample's prompt (a completion that samples the image token has it as an ordinary token, as in the
        engine); ``None``: anywhere."""
        placeholders = input_ids == self.image_token_id
        if prompt_lengths is not None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            placeholders &= positions[None, :] < prompt_lengths.to(input_ids.device)[:, None]
        return placeholders

    def with_features(
        self, input_ids: torch.Tensor, placeholders: torch.Tensor, features: torch.Tensor, images: int
    ) -> torch.Tensor:
        """The decoder's input ``[s, b, h]``: the token embeddings with ``features [n, h]`` written over the
        ``n`` placeholders, in sample order then position (``images``: how many images they came from)."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        if int(placeholders.sum()) != features.shape[0]:
            raise ValueError(
                f"a micro-batch holds {int(placeholders.sum())} image placeholder tokens for {images} images of "
                f"{features.shape[0]} tokens in all"
            )
        by_sample = embeddings.transpose(0, 1).clone()
        by_sample[placeholders] = features.to(embeddings.dtype)
        return by_sample.transpose(0, 1)


class VisionLanguageModel(VisionFront):
    """One pipeline stage of a LLaVA: on the first stage the CLIP vision tower and projector, then the GPT."""

    def __init__(self, hf_config, gpt: torch.nn.Module, *, pre_process: bool) -> None:
        if hf_config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                f"`model.policy.path`: vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r}"
            )
        if not isinstance(hf_config.vision_feature_layer, int):
            raise ValueError("`model.policy.path`: a list of vision_feature_layer values is not supported yet.")
        super().__init__(gpt, pre_process=pre_process, image_token_id=hf_config.image_token_index)
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
        """``prompt_lengths [b]``: see :meth:`VisionFront.placeholders`."""
        if not self.pre_process:
            return self.language_model(input_ids, position_ids, attention_mask)
        if pixel_values is None:
            if bool((input_ids == self.image_token_id).any()):
                raise ValueError("a micro-batch holds image placeholder tokens but no pixel_values")
            return self.language_model(input_ids, position_ids, attention_mask)
        features = self.image_features(pixel_values).reshape(-1, self.config.hidden_size)
        decoder_input = self.with_features(input_ids, self.placeholders(input_ids, prompt_lengths), features,
                                           pixel_values.shape[0])  # fmt: skip
        return self.language_model(input_ids, position_ids, attention_mask, decoder_input=decoder_input)
