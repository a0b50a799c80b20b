"""The LLaVA policy module: on the first pipeline stage the vision tower and projector, then the Megatron GPT.

Design and weight names: :mod:`yatt_lightning.models.vlm`.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule


class VisionLanguageModel(MegatronModule):
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
