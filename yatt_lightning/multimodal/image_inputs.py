"""How a vision-language policy sees a row's images: placeholder tokens in its ids, pixels in its micro-batches.

A prompt's text holds one image token per image (``<image>``); the policy's sequences hold each expanded
to the model's tokens per image (what transformers' processor writes, and what the loss positions count),
and the engine gets them collapsed again (:func:`collapse`).
Pixels are made here from the rows' :class:`~yatt_lightning.datamodules.images.ImageRef`, on the rank
that trains the rows, with the model's own image processor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from yatt_lightning.datamodules.images import load_image


def tokens_per_image(config) -> int:
    """How many tokens one image takes in a LLaVA's sequence (its ``config.json``): one per patch, plus the
    class token when ``vision_feature_select_strategy`` is ``full``."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + int(config.vision_feature_select_strategy == "full")


def collapse(ids: list[int], token: int, per_image: int) -> list[int]:
    """``ids`` with each image's ``per_image`` placeholders back to one (as the rollout engine wants them);
    the inverse of :meth:`ImageInputs.expand`, also for images that follow each other."""
    out: list[int] = []
    run = 0
    for t in [*ids, None]:
        if t == token:
            run += 1
            continue
        if run:
            if run % per_image:
                raise ValueError(f"a run of {run} image tokens is not a whole number of {per_image}-token images")
            out.extend([token] * (run // per_image))
            run = 0
        if t is not None:
            out.append(t)
    return out


def expand(ids: list[int], token: int, per_image: int) -> list[int]:
    """``ids`` with each image ``token`` repeated ``per_image`` times (the inverse of :func:`collapse`)."""
    out: list[int] = []
    for t in ids:
        out.extend([t] * per_image if t == token else [t])
    return out


class ImageInputs:
    """Args:
    path: The vision-language model's Hugging Face folder (its config and image processor).
    """

    def __init__(self, path: Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(path)
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.token_id = config.image_token_index
        self.tokens_per_image = tokens_per_image(config)

    def expand(self, ids: list[int]) -> list[int]:
        """``ids`` with each image token repeated ``tokens_per_image`` times (the prompt format checked that
        the row has one per image)."""
        return expand(ids, self.token_id, self.tokens_per_image)

    def pixels(self, images: list[list]) -> torch.Tensor | None:
        """``[images, 3, H, W]`` for the samples' image references (a list per sample) in order (``None``
        when they have none)."""
        images = [load_image(ref) for refs in images for ref in refs]
        if not images:
            return None
        return self.processor(images=images, return_tensors="pt")["pixel_values"]
