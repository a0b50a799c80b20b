"""The Qwen2.5-VL policy module: transformers' vision transformer and patch merger in front of the Megatron GPT,
whose rotary embedding is multimodal (M-RoPE: each token has a temporal, a height and a width position).

Images come at their own resolution: the processor cuts an image into 14-pixel patches (``pixel_values [patches,
C * T * 14 * 14]``, ``image_grid_thw [images, 3]``), the vision tower merges each 2x2 of them into one token, so
an image takes ``t * h * w / 4`` placeholders in the sequence. The positions are transformers' own
(``Qwen2_5_VLModel.get_rope_index``, called on every pipeline stage from the micro-batch's ids and grids): text
counts up by one, an image's tokens take (t, row, column) offsets from where it starts, and the text after it
continues from the largest of them. Design and weight names: :mod:`yatt_lightning.models.vlm`.
"""

from __future__ import annotations

import torch

from yatt_lightning.models.vlm_model import VisionFront


class _RopeIndex:
    """transformers' M-RoPE position computation, which reads nothing of the model but its config."""

    def __init__(self, hf_config) -> None:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        self.config = hf_config  # what the two methods read of the model
        self.get_rope_index = Qwen2_5_VLModel.get_rope_index.__get__(self)
        self.get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids.__get__(self)

    def __call__(
        self, input_ids: torch.Tensor, placeholders: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        positions, _ = self.get_rope_index(input_ids, placeholders.int(), image_grid_thw=image_grid_thw)
        return positions  # [3, b, s]


class QwenVisionLanguageModel(VisionFront):
    """One pipeline stage of a Qwen2.5-VL: on the first stage the vision tower (``visual``: patch embedding,
    windowed attention blocks, merger), then the GPT with M-RoPE (``arch.mrope_section``)."""

    def __init__(self, hf_config, gpt: torch.nn.Module, *, pre_process: bool) -> None:
        super().__init__(gpt, pre_process=pre_process, image_token_id=hf_config.image_token_id)
        self.rope_index = _RopeIndex(hf_config)
        if pre_process:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

            self.visual = Qwen2_5_VisionTransformerPretrainedModel(hf_config.vision_config)

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]``: every image's merged tokens, images in order, as transformers computes them."""
        return self.visual(pixel_values.to(self.visual.dtype), grid_thw=image_grid_thw).pooler_output

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        prompt_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``position_ids`` (one per token) are replaced by the M-RoPE positions; ``prompt_lengths [b]``: see
        :meth:`VisionFront.placeholders`."""
        placeholders = self.placeholders(input_ids, prompt_lengths)
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("a micro-batch holds pixel_values without image_grid_thw, or the reverse")
        if pixel_values is None and bool(placeholders.any()):
            raise ValueError("a micro-batch holds image placeholder tokens but no pixel_values")
        positions = self.rope_index(input_ids, placeholders, image_grid_thw)
        if not self.pre_process or pixel_values is None:
            return self.language_model(input_ids, positions, attention_mask)
        features = self.image_features(pixel_values, image_grid_thw)
        decoder_input = self.with_features(input_ids, placeholders, features, image_grid_thw.shape[0])
        return self.language_model(input_ids, positions, attention_mask, decoder_input=decoder_input)
